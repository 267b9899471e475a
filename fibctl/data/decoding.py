"""A local file's bytes and text, for the readers of fibctl.data.json_files and local_files:
decompressed by its extension (`.gz`, `.bz2`, `.xz`; `.zst` with the zstandard package), read
as UTF-8 with a byte-order mark dropped. A file that is not UTF-8 is refused, naming it."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
from typing import IO

from fibctl.data.recipe import shown_path
from fibctl.errors import FibctlError

NEEDS_ZSTANDARD = "reading .zst files needs the zstandard package: pip install zstandard (or decompress them: zstd -d)"


def open_binary(path: str) -> IO[bytes]:
    """The file's bytes, decompressed by its extension."""
    ext = os.path.splitext(path)[1]
    if ext == ".zst":
        try:
            import zstandard
        except ImportError:
            raise FibctlError(NEEDS_ZSTANDARD) from None
        return zstandard.open(path, "rb")
    return {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(ext, open)(path, "rb")


def open_text(path: str, newline: str | None) -> IO[str]:
    """The file's text, decoded as UTF-8 (a byte-order mark dropped); `newline` as open's."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", newline=newline)


def not_utf8(path: str) -> str:
    """Why a file that failed to decode as UTF-8 is refused, and how to convert it."""
    with open_binary(path) as f:  # decompressed: a .gz file's own bytes are not text
        start = f.read(2)
    if start in (b"\xff\xfe", b"\xfe\xff"):
        return f"{shown_path(path)} is UTF-16 text, not UTF-8; convert it (e.g. iconv -f utf-16 -t utf-8)"
    return f"{shown_path(path)} is not UTF-8 text; convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
