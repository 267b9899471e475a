"""Writes that must outlive a crash or a power loss: a file's bytes, or a folder's entries
after a rename, flushed to the disk (checkpoints, data folders)."""

from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush the writes to a file, or to a folder's entries (renames into it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
