"""Writing a report's files. Each is written beside its final path and then renamed onto
it, so a file already there, or a link (to a file outside the report's folder, say), is
replaced, never written through; and a reader never sees half of a file."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def replace_file(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write` with a new file's path in path's folder (same suffix), then rename it to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}.part{path.suffix}")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode, as open() gives
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    return replace_file(path, lambda tmp: tmp.write_text(text))
