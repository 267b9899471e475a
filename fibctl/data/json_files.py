"""Records of local JSON files (`format = "json"`), read by fibctl itself, file by file.

The datasets library's JSON builder fixes a source's columns from its first file (or first
10 MB block): a later file or block with one more field, an optional `url` or `title`, failed
the whole source ("Couldn't cast ... because column names don't match"). Read here, each
record keeps its own fields. A file is JSON Lines (one object per line, blank lines skipped),
one array of objects, or one object spread over lines; a byte-order mark is dropped; `.gz`,
`.bz2`, `.xz` and (with the zstandard package) `.zst` are decompressed.
"""

from __future__ import annotations

import bz2
import gzip
import io
import itertools
import json
import lzma
import os
import re
from collections.abc import Iterator
from typing import IO

from fibctl.errors import FibctlError

_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape that may stand for half a character
_LONE = re.compile("[\ud800-\udfff]")


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


def records(path: str) -> Iterator[dict]:
    """Each record of one JSON file, in order. A line that is not JSON, or a record that is
    not an object, names the file and the line."""
    with open_binary(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig", newline=None) as f:
        start, skipped = _first_char(f)
        if not start:
            return
        if start == "[":
            yield from _whole(path, start + f.read())
            return
        first = start + f.readline()
        if start == "{" and not _an_object(first):  # one object spread over lines
            yield from _whole(path, first + f.read())
            return
        for n, line in enumerate(itertools.chain([first], f), skipped + 1):
            if line.strip():
                yield _record(path, f"line {n}", _loads(path, f"line {n}", line))


def _first_char(f: IO[str]) -> tuple[str, int]:
    """The first character that is not whitespace ('' for an empty file), consumed, and the
    line breaks before it."""
    breaks = 0
    while (c := f.read(1)) and c.isspace():
        breaks += c == "\n"
    return c, breaks


def _an_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False
    except RecursionError:  # a whole line, too deep to read: said as the line's own error
        return True


def _whole(path: str, text: str) -> Iterator[dict]:
    data = _loads(path, "the file", text)
    if isinstance(data, list):
        for i, item in enumerate(data):
            yield _record(path, f"item {i}", item)
    else:
        yield _record(path, "the file", data)


def _loads(path: str, where: str, text: str):
    try:
        value = json.loads(text)
    except ValueError as e:
        raise FibctlError(f"{path}: {where} is not JSON ({getattr(e, 'msg', e)})") from None
    except RecursionError:  # the parser recurses once per level
        raise FibctlError(f"{path}: {where} nests its values too deeply to read") from None
    if _SURROGATE.search(text) and _LONE.search(json.dumps(value, ensure_ascii=False)):
        raise FibctlError(f"{path}: {where} holds a lone surrogate escape (half of a character, e.g. \\ud800), "
                          "not text")
    return value


def _record(path: str, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise FibctlError(f"{path}: {where} is a JSON {type(value).__name__}, not an object of fields")
    return value
