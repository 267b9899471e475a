"""Records of local JSON files (`format = "json"`), read by fibctl itself, file by file.

The datasets library's JSON builder fixes a source's columns from its first file (or first
10 MB block): a later file or block with one more field, an optional `url` or `title`, failed
the whole source ("Couldn't cast ... because column names don't match"). Read here, each
record keeps its own fields. A file is JSON Lines (one object per line, blank lines skipped),
one array of objects (parsed item by item, so its size is not held in memory), or one object
spread over lines; fibctl.data.decoding opens it (decompressed, UTF-8).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import IO

from fibctl.data.decoding import open_text
from fibctl.data.recipe import shown_path
from fibctl.errors import FibctlError

_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape that may stand for half a character
_LONE = re.compile("[\ud800-\udfff]")


def _int(digits: str) -> int | float:
    return int(digits) if len(digits) <= 4300 else float(digits)


class _Decoder(json.JSONDecoder):
    """json's decoder, except that an integer of more than 4,300 digits, which Python refuses
    to convert (a guard against slow parsing), is read as its float: it is never text, and
    the record reads on. Only a text holding one is parsed again with the Python-level hook:
    a hook on every integer made records of many numbers three times slower to read."""

    _long = json.JSONDecoder(parse_int=_int)

    def raw_decode(self, s: str, idx: int = 0):
        try:
            return super().raw_decode(s, idx)
        except ValueError as e:
            if "integer string conversion" not in str(e):
                raise
            return self._long.raw_decode(s, idx)


_DECODER = _Decoder()


def records(path: str) -> Iterator[dict]:
    """Each record of one JSON file, in order. A line that is not JSON, or a record that is
    not an object, names the file and the line."""
    with open_text(path, newline=None) as f:
        name = shown_path(path)  # in messages: one line, whatever the file is called
        start, skipped = _first_char(f)
        if not start:
            return
        if start == "[":
            yield from _array(name, f)
            return
        first = start + f.readline()
        if start == "{" and not _an_object(first):  # one object spread over lines
            yield from _whole(name, first + f.read())
            return
        for n, line in enumerate(itertools.chain([first], f), skipped + 1):
            if line.strip():
                yield _record(name, f"line {n}", _loads(name, f"line {n}", line))


def _first_char(f: IO[str]) -> tuple[str, int]:
    """The first character that is not whitespace ('' for an empty file), consumed, and the
    line breaks before it."""
    breaks = 0
    while (c := f.read(1)) and c.isspace():
        breaks += c == "\n"
    return c, breaks


def _an_object(line: str) -> bool:
    try:
        return isinstance(_DECODER.decode(line), dict)
    except ValueError:
        return False
    except RecursionError:  # a whole line, too deep to read: said as the line's own error
        return True


def _whole(path: str, text: str) -> Iterator[dict]:
    """The one object of a file whose first line is not one; an error names its line (a
    JSON Lines file whose first line is broken ends up here too)."""
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # records one after another, pretty-printed or with commas
            raise FibctlError(f"{path}: line {e.lineno} is not JSON (text after a whole record, at column "
                              f"{e.colno}; a file is JSON Lines, one array or one object: `jq -c .` writes "
                              "records one per line)") from None
        raise FibctlError(f"{path}: line {e.lineno} is not JSON ({e.msg})") from None
    except RecursionError:
        raise FibctlError(f"{path}: the file nests its values too deeply to read") from None
    _check_surrogates(path, "the file", text, value)
    yield _record(path, "the file", value)


ARRAY_CHUNK = 1 << 20  # characters read at a time from a file of one array
_SPACE = re.compile(r"[ \t\n\r]*")


def _array(path: str, f: IO[str]) -> Iterator[dict]:
    """The items of the JSON array whose "[" was just read, parsed one at a time from chunks
    of the file: a file of one array can be a whole corpus (read whole, 250 MB took 660 MB)."""
    buf, pos, eof, i = "", 0, False, 0

    def fill() -> bool:  # read more (as much again as is held, at least a chunk); False at the end
        nonlocal buf, pos, eof
        chunk = f.read(max(ARRAY_CHUNK, len(buf) - pos))
        buf, pos, eof = buf[pos:] + chunk, 0, not chunk
        return not eof

    def next_char() -> str:  # the next character that is not whitespace, not consumed; '' at the end
        nonlocal pos
        while True:
            pos = _SPACE.match(buf, pos).end()
            if pos < len(buf) or not fill():
                return buf[pos:pos + 1]

    if next_char() == "]":
        pos += 1
    else:
        while True:
            try:
                item, end = _DECODER.raw_decode(buf, pos)
            except ValueError as e:
                if fill():  # cut by the chunk's end, or not JSON
                    continue
                raise FibctlError(f"{path}: item {i} is not JSON ({getattr(e, 'msg', e)})") from None
            except RecursionError:
                raise FibctlError(f"{path}: item {i} nests its values too deeply to read") from None
            if end == len(buf) and not eof:  # a number may go on in the next chunk: parse it again
                fill()
                continue
            _check_surrogates(path, f"item {i}", buf[pos:end], item)
            yield _record(path, f"item {i}", item)
            pos, i = end, i + 1
            c = next_char()
            if c == "]":
                pos += 1
                break
            if c != ",":
                raise FibctlError(f"{path}: after item {i - 1}, {c!r} is not JSON (expecting ',' or ']')"
                                  if c else f"{path}: the array is not closed (']' is missing)")
            pos += 1
            next_char()
    if next_char():
        raise FibctlError(f"{path}: the file is not JSON (text after the array's ']')")


def _loads(path: str, where: str, text: str):
    try:
        value = _DECODER.decode(text)
    except ValueError as e:
        raise FibctlError(f"{path}: {where} is not JSON ({getattr(e, 'msg', e)})") from None
    except RecursionError:  # the parser recurses once per level
        raise FibctlError(f"{path}: {where} nests its values too deeply to read") from None
    _check_surrogates(path, where, text, value)
    return value


def _check_surrogates(path: str, where: str, text: str, value) -> None:
    if _SURROGATE.search(text) and _LONE.search(json.dumps(value, ensure_ascii=False)):
        raise FibctlError(f"{path}: {where} holds a lone surrogate escape (half of a character, e.g. \\ud800), "
                          "not text")


def _record(path: str, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise FibctlError(f"{path}: {where} is a JSON {type(value).__name__}, not an object of fields")
    return value
