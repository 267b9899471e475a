"""Records of local JSON files (`format = "json"`), read by fibctl itself, file by file.

The datasets library's JSON builder fixes a source's columns from its first file (or first
10 MB block): a later file or block with one more field, an optional `url` or `title`, failed
the whole source ("Couldn't cast ... because column names don't match"). Read here, each
record keeps its own fields. A file is JSON Lines (one object per line, blank lines skipped),
one array of objects (parsed item by item, so its size is not held in memory), or one object
spread over lines (parsed from chunks too, so that an error is found before the file is read
whole); fibctl.data.decoding opens it (decompressed, UTF-8).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import IO

from fibctl.data.decoding import open_text
from fibctl.errors import FibctlError, shown_path

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


def records(path: str) -> Iterator[tuple[str, dict]]:
    """Each record of one JSON file, in order, with where it is in the file (`line 3`, `item
    2`; '' for the file's one object). A line that is not JSON, or a record that is not an
    object, names the file and the line."""
    with open_text(path, newline=None) as f:
        name = shown_path(path)  # in messages: one line, whatever the file is called
        start, line, column = _first_char(f)
        if not start:
            return
        first = " " * (column - 1) + start  # the whitespace before it as spaces: an error's column is the file's
        if start == "[":
            yield from _array(name, _Chunks(f, first, line, pos=column))
            return
        first += f.readline()
        if start == "{" and not _an_object(first):  # one object spread over lines
            yield from _whole(name, _Chunks(f, first, line, pos=column - 1))
            return
        for n, text in enumerate(itertools.chain([first], f), line):
            # a byte-order mark opening a line is that of a file joined on (`cat a.jsonl b.jsonl`):
            # dropped, as the file's own is, rather than "not JSON" at a column that looks fine
            text = text.removeprefix("\ufeff")
            if text.strip():
                where = f"line {n}"
                yield where, _record(name, where, _loads(name, where, text))


def _first_char(f: IO[str]) -> tuple[str, int, int]:
    """The first character that is not whitespace ('' for an empty file), consumed, and its
    line and column."""
    line, column = 1, 1
    while (c := f.read(1)) and c.isspace():
        line, column = (line + 1, 1) if c == "\n" else (line, column + 1)
    return c, line, column


def _an_object(line: str) -> bool:
    try:
        return isinstance(_DECODER.decode(line), dict)
    except ValueError:
        return False
    except RecursionError:  # a whole line, too deep to read: said as the line's own error
        return True


ARRAY_CHUNK = 1 << 20  # characters read at a time from a file of one array or object
_SPACE = re.compile(r"[ \t\n\r]*")
# an error this near the end of the text read may be its end cutting a value short (`tru`, `1.`,
# `-Infinit`, a `\u` escape); an unterminated string may be a string cut short
_CUT_CHARS = 16


class _Chunks:
    """A file's text from `text` (at column 1 of `line`) on, read in chunks (as much again as
    is held, at least ARRAY_CHUNK) as its values are parsed one at a time from `pos`: memory
    holds a value, not the file, and an error is found in the chunks read so far."""

    def __init__(self, f: IO[str], text: str, line: int, pos: int = 0):
        self.f, self.buf, self.pos = f, text, pos
        self.line, self.column = line, 1  # of buf[0]

    def fill(self) -> bool:
        """Read more, dropping what was parsed; False at the end of the file, where the text
        held is left as it is (an error's position is in it)."""
        chunk = self.f.read(max(ARRAY_CHUNK, len(self.buf) - self.pos))
        if not chunk:
            return False
        self.line, self.column = self.where(self.pos)
        self.buf, self.pos = self.buf[self.pos:] + chunk, 0
        return True

    def where(self, pos: int) -> tuple[int, int]:
        """The line and column of buf[pos] in the file."""
        breaks = self.buf.count("\n", 0, pos)
        return self.line + breaks, pos - self.buf.rfind("\n", 0, pos) if breaks else self.column + pos

    def next_char(self) -> str:
        """The next character that is not whitespace, not consumed; '' at the end."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.fill():
                return self.buf[self.pos:self.pos + 1]

    def value(self) -> tuple[object, int]:
        """The JSON value at pos and where it ends, pos left at its start; its JSONDecodeError
        once the text read goes on far enough past the error for the error to be the value's."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or len(self.buf) - e.pos <= _CUT_CHARS
                if cut and self.fill():
                    continue
                raise
            if end == len(self.buf) and self.fill():  # a number may go on in the next chunk: parse it again
                continue
            return value, end


def _value(name: str, chunks: _Chunks, item: int | None = None):
    """The value at the chunks' pos, consumed: item `item` of an array, else the file's one
    object; an error names the file and its line and column."""
    where = "the file" if item is None else f"item {item}"
    try:
        value, end = chunks.value()
        value = _unpaired(value, _SURROGATE.search(chunks.buf, chunks.pos, end))
    except json.JSONDecodeError as e:
        line, column = chunks.where(e.pos)
        if item is None:  # the file's one object: named by the line
            raise _not_json(name, f"line {line}", e.msg, f"column {column}") from None
        raise _not_json(name, where, e.msg, f"line {line}, column {column}") from None
    except RecursionError:  # the parser recurses once per level
        raise FibctlError(f"{name}: {where} nests its values too deeply to read") from None
    chunks.pos = end
    return _record(name, where, value)


def _whole(name: str, chunks: _Chunks) -> Iterator[tuple[str, dict]]:
    """The one object of a file whose first line is not one, read in chunks: a JSON Lines file
    whose first line is broken, or one of records spread over lines, ends up here too (read
    whole before its error, a large one filled memory), its error found in the first chunks."""
    value = _value(name, chunks)
    if chunks.next_char():  # records one after another, pretty-printed or with commas
        line, column = chunks.where(chunks.pos)
        raise _not_json(name, f"line {line}", "Extra data", f"column {column}")
    yield "", value


def _array(name: str, chunks: _Chunks) -> Iterator[tuple[str, dict]]:
    """The items of the JSON array whose "[" the chunks have just read, parsed one at a time:
    a file of one array can be a whole corpus (read whole, 250 MB took 660 MB)."""
    if chunks.next_char() == "]":
        chunks.pos += 1
    else:
        for i in itertools.count():
            yield f"item {i}", _value(name, chunks, i)
            c = chunks.next_char()
            if c == "]":
                chunks.pos += 1
                break
            if c != ",":
                raise FibctlError(f"{name}: after item {i}, {c!r} is not JSON (expecting ',' or ']')"
                                  if c else f"{name}: the array is not closed (']' is missing)")
            chunks.pos += 1
            chunks.next_char()
    if chunks.next_char():
        raise FibctlError(f"{name}: the file is not JSON (text after the array's ']')")


def _loads(name: str, where: str, text: str):
    try:
        return _unpaired(_DECODER.decode(text), _SURROGATE.search(text))
    except json.JSONDecodeError as e:
        raise _not_json(name, where, e.msg, f"column {e.colno}") from None
    except RecursionError:  # the parser recurses once per level
        raise FibctlError(f"{name}: {where} nests its values too deeply to read") from None


def _not_json(name: str, where: str, msg: str, at: str) -> FibctlError:
    """The error for a JSONDecodeError's `msg` at `at` (its column, or its line and column)."""
    if msg == "Extra data":  # records one after another, pretty-printed or with commas
        return FibctlError(f"{name}: {where} is not JSON (text after a whole record, at {at}; a file is JSON Lines, "
                           "one array or one object: `jq -c .` writes records one per line)")
    return FibctlError(f"{name}: {where} is not JSON ({msg.removesuffix(' at')} at {at})")


class Unpaired(str):
    """A JSON string holding a lone surrogate escape (half of a character, e.g. \\ud800): not
    text, refused where a source reads it as text (fibctl.data.sources), and no matter in a
    field it does not read."""


def _unpaired(value, escaped: object):
    """`value` with each string in it that holds a lone surrogate made Unpaired, where its JSON
    text holds an escape that may stand for one (`escaped`): a record without one is not walked."""
    if not escaped:
        return value
    if isinstance(value, str):
        return Unpaired(value) if _LONE.search(value) else value
    if isinstance(value, dict):
        return {k: _unpaired(v, True) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpaired(v, True) for v in value]
    return value


# a value's kind as JSON names it (Python's names, `NoneType` and `list`, are not the file's)
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null", Unpaired: "a string"}


def _record(name: str, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise FibctlError(f"{name}: {where} is {_JSON_KINDS[type(value)]}, not a JSON object of fields")
    return value
