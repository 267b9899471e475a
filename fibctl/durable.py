"""Writes that must outlive a crash or a power loss: a file's bytes, or a folder's entries
after a rename, flushed to the disk (checkpoints, data folders); and whether the process
that left a temporary behind still runs."""

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


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (this process does): a temporary named
    after it is still in use."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # none has that number
        return False
    except PermissionError:  # another user's
        return True
    return True
