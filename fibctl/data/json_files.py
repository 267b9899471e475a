"""Records of local JSON files (`format = "json"`), read by fibctl itself, file by file.

The datasets library's JSON builder fixes a source's columns from its first file (or first
10 MB block): a later file or block with one more field, an optional `url` or `title`, failed
the whole source ("Couldn't cast ... because column names don't match"). Read here, each
record keeps its own fields. A file is JSON Lines (one object per line, blank lines skipped),
one array of objects (parsed item by item, so its size is not held in memory), or one object
spread over lines (parsed from chunks too, so that an error is found before the file is read
whole); fibctl.data.decoding opens it (decompressed, UTF-8). A file of one object that holds
its records in an array (`{"version": ..., "data": [...]}`, a recipe's `records = "data"`) is
walked in chunks to that array, whose items are parsed one at a time as an array file's are.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from typing import IO

from fibctl.data.decoding import open_text
from fibctl.errors import FibctlError, shown_path

_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # an escape that may stand for half a character
_LONE = re.compile("[\ud800-\udfff]")


class LongInt(float):
    """An integer of more digits than Python converts (4,300 unless set otherwise: a guard
    against slow parsing), held as its float: a message still names it an int, not a float
    (a 5,000-digit text field was said to hold "float values")."""


def _int(digits: str) -> int | float:
    limit = sys.get_int_max_str_digits()  # 0: no limit
    return LongInt(digits) if limit and len(digits.lstrip("-")) > limit else int(digits)


class _Decoder(json.JSONDecoder):
    """json's decoder, except that an integer longer than Python converts is read as a LongInt:
    it is never text, and the record reads on. Only a text holding one is parsed again with
    the Python-level hook: a hook on every integer made records of many numbers three times
    slower to read."""

    _long = json.JSONDecoder(parse_int=_int)

    def raw_decode(self, s: str, idx: int = 0):
        try:
            return super().raw_decode(s, idx)
        except ValueError as e:
            if "integer string conversion" not in str(e):
                raise
            return self._long.raw_decode(s, idx)


_DECODER = _Decoder()


def records(path: str, inside: str | None = None) -> Iterator[tuple[str, dict]]:
    """Each record of one JSON file, in order, with where it is in the file (`line 3`, `item
    2`; '' for the file's one object). With `inside` (a recipe's `records`: `data`, a dotted
    path) the records are the items of the array there in the file's one object (`item 2 of
    data`). A line that is not JSON, or a record that is not an object, names the file and the
    line."""
    with open_text(path, newline=None) as f:
        name = shown_path(path)  # in messages: one line, whatever the file is called
        start, line, column = _first_char(f)
        if not start:
            return
        first = " " * (column - 1) + start  # the whitespace before it as spaces: an error's column is the file's
        if inside is not None:  # read in chunks, even on one line: a dump is often one line of a whole corpus
            chunks = _Chunks(f, first, line, pos=column - 1)
            yield from _walk(name, chunks, inside.split("."), "")
            if chunks.next_char():
                line, column = chunks.where(chunks.pos)
                raise FibctlError(f"{name}: line {line} is not JSON (text after the file's one value, at column "
                                  f"{column}; with records set, a file holds one object)")
            return
        if start == "[":
            yield from _array(name, _Chunks(f, first, line, pos=column - 1))
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


def _parse(name: str, chunks: _Chunks, item: str | None = None):
    """The JSON value at the chunks' pos, consumed: `item` of an array (`item 2`), else a value
    named by its line; an error names the file and its line and column."""
    try:
        value, end = chunks.value()
        value = _unpaired(value, _SURROGATE.search(chunks.buf, chunks.pos, end))
    except json.JSONDecodeError as e:
        line, column = chunks.where(e.pos)
        if item is None:  # the file's one object, or a value inside it: named by the line
            raise _not_json(name, f"line {line}", e.msg, f"column {column}") from None
        raise _not_json(name, item, e.msg, f"line {line}, column {column}") from None
    except RecursionError:  # the parser recurses once per level
        raise FibctlError(f"{name}: {item or 'the file'} nests its values too deeply to read") from None
    chunks.pos = end
    return value


def _whole(name: str, chunks: _Chunks) -> Iterator[tuple[str, dict]]:
    """The one object of a file whose first line is not one, read in chunks: a JSON Lines file
    whose first line is broken, or one of records spread over lines, ends up here too (read
    whole before its error, a large one filled memory), its error found in the first chunks."""
    value = _record(name, "the file", _parse(name, chunks))
    if chunks.next_char():  # records one after another, pretty-printed or with commas
        line, column = chunks.where(chunks.pos)
        raise _not_json(name, f"line {line}", "Extra data", f"column {column}")
    yield "", value


def _array(name: str, chunks: _Chunks) -> Iterator[tuple[str, dict]]:
    """The items of the JSON array at the chunks' pos, parsed one at a time: a file of one
    array can be a whole corpus (read whole, 250 MB took 660 MB)."""
    yield from _items(name, chunks, "")
    if chunks.next_char():
        raise FibctlError(f"{name}: the file is not JSON (text after the array's ']')")


def _items(name: str, chunks: _Chunks, at: str) -> Iterator[tuple[str, dict]]:
    """The records of the array at the chunks' pos (`at` its path in the file's object, ''
    for the file's own array), each parsed as it comes."""
    for i in _elements(name, chunks, at):
        where = f"item {i} of {at}" if at else f"item {i}"
        yield where, _record(name, where, _parse(name, chunks, where))


def _elements(name: str, chunks: _Chunks, at: str) -> Iterator[int]:
    """The index of each item of the array whose '[' is at the chunks' pos, the pos at the item:
    the caller consumes it before the next is asked for. The pos ends after the ']'."""
    of = f" of {at}" if at else ""
    chunks.pos += 1
    if chunks.next_char() == "]":
        chunks.pos += 1
        return
    for i in itertools.count():
        yield i
        c = chunks.next_char()
        if c == "]":
            chunks.pos += 1
            return
        if c != ",":
            raise FibctlError(f"{name}: after item {i}{of}, {c!r} is not JSON (expecting ',' or ']')"
                              if c else f"{name}: the array{of} is not closed (']' is missing)")
        chunks.pos += 1
        chunks.next_char()


def _members(name: str, chunks: _Chunks) -> Iterator[str]:
    """Each key of the object whose '{' is at the chunks' pos, the pos at its value: the caller
    consumes the value before the next key is asked for. The pos ends after the '}'."""
    chunks.pos += 1
    c = chunks.next_char()
    if c == "}":
        chunks.pos += 1
        return
    while True:
        if c != '"':
            raise _expecting(name, chunks, "property name enclosed in double quotes")
        key = _parse(name, chunks)
        if chunks.next_char() != ":":
            raise _expecting(name, chunks, "':' delimiter")
        chunks.pos += 1
        chunks.next_char()
        yield key
        c = chunks.next_char()
        if c == "}":
            chunks.pos += 1
            return
        if c != ",":
            raise _expecting(name, chunks, "',' delimiter")
        chunks.pos += 1
        c = chunks.next_char()


def _expecting(name: str, chunks: _Chunks, what: str) -> FibctlError:
    """What json's parser says of a character out of place inside an object, at its line."""
    if not chunks.next_char():
        return FibctlError(f"{name}: the file is not JSON (it ends inside an object: '}}' is missing)")
    line, column = chunks.where(chunks.pos)
    return _not_json(name, f"line {line}", f"Expecting {what}", f"column {column}")


_SHOWN_KEYS = 8  # an object's keys named when the one sought is not among them


def _walk(name: str, chunks: _Chunks, path: list[str], at: str) -> Iterator[tuple[str, dict]]:
    """The records of the array that `path` (a recipe's `records`, split) reaches from the value
    at the chunks' pos (`at`: the path to that value, '' for the file's), the value consumed:
    only one record, and each value beside the path, is held at a time. A key in an object, an
    index or `*` (each item) in an array; the path missing, or reaching no array, names the file
    and what is there."""
    c = chunks.next_char()
    if not path:
        if c != "[":
            raise FibctlError(f"{name}: {at} is {_kind(_parse(name, chunks))}, not an array of records")
        yield from _items(name, chunks, at)
        return
    part, rest = path[0], path[1:]
    wanted = None if part == "*" else index(part)
    if c == "{":
        found, keys, shown = False, 0, []  # keys counted, not held: an object may hold a corpus by id
        for key in _members(name, chunks):
            if key == part and found:  # json.loads would keep the last: which is meant is unsaid
                raise FibctlError(f"{name}: {at or 'the file'} has key {part!r} twice")
            if key == part:
                found = True
                yield from _walk(name, chunks, rest, f"{at}.{part}" if at else part)
            else:
                _parse(name, chunks)
            keys += 1
            if len(shown) < _SHOWN_KEYS:
                shown.append(key)
        if not found:
            listed = ", ".join(shown) + (", ..." if keys > len(shown) else "")
            raise FibctlError(f"{name}: {at or 'the file'} has no key {part!r} (its keys: {listed or 'none'}); "
                              f"records names the array of records in each file's object")
    elif c == "[" and (part == "*" or wanted is not None):
        count = 0
        for i in _elements(name, chunks, at):
            if wanted in (None, i):
                yield from _walk(name, chunks, rest, f"{at}.{i}" if at else str(i))
            else:
                _parse(name, chunks)
            count = i + 1
        if wanted is not None and wanted >= count:
            raise FibctlError(f"{name}: {at or 'the file'} has {count} items, no item {part}")
    else:
        kind = "an array" if part == "*" or wanted is not None else f"an object with key {part!r}"
        raise FibctlError(f"{name}: {at or 'the file'} is {_kind(_parse(name, chunks))}, not {kind}")


def index(part: str) -> int | None:
    """A dotted name's part as an array's index (`0`, `12`), else None."""
    return int(part) if part.isascii() and part.isdigit() else None


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
_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               LongInt: "a number", bool: "a boolean", type(None): "null", Unpaired: "a string"}


def _kind(value) -> str:
    return _JSON_KINDS[type(value)]


def _record(name: str, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise FibctlError(f"{name}: {where} is {_kind(value)}, not a JSON object of fields")
    return value
