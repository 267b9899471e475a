"""Rows of local text, CSV and parquet files (`format = "text"`, `"csv"`, `"parquet"`), read
by fibctl itself, file by file, from the paths the recipe's globs matched.

The datasets library's builders, which read them before, matched each path as a glob once
more (a file named `part[1].txt` was skipped and `part1.txt` read in its place, `a::b.txt`
was not found), read a CSV row of more cells than its header with the first cells as an
index (every column shifted, silently), skipped a CSV file without the text column, and
failed a parquet source whose shards differed inside a struct column the recipe does not
read. Here each file is read as it is and checked against its own header or schema.
JSON files have their own reader, fibctl.data.json_files.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator

from fibctl.data.decoding import open_text
from fibctl.errors import FibctlError, shown_path

# a document is one cell: the csv module's default cap (128 KiB) would refuse a long one (the
# cap is a C long: 2**31 - 1 where that is 32 bits)
csv.field_size_limit(2**31 - 1)


def text_rows(path: str, sample_by: str) -> Iterator[tuple[str, dict]]:
    """A text file's documents as rows of one field, `text`: the whole file, each paragraph
    (lines up to a blank one: empty, or only whitespace) or each line. Line breaks are
    universal: \\r\\n and a lone \\r end a line as \\n does. A row's place is not said
    (''): its text is never refused."""
    with open_text(path, newline=None) as f:
        if sample_by == "document":
            head = f.read(LONG_TEXT_CHARS + 1)
            # a longer file is read again, in pieces, each time its text is needed
            yield "", {"text": head if len(head) <= LONG_TEXT_CHARS else LongText(path)}
        elif sample_by == "line":
            for line in f:
                yield "", {"text": line}
        else:
            paragraph: list[str] = []
            for line in f:
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "", {"text": "".join(paragraph)}
                    paragraph = []
            if paragraph:
                yield "", {"text": "".join(paragraph)}


LONG_TEXT_CHARS = 1 << 22  # a text file's document longer than this is never held whole (LongText)
READ_CHARS = 1 << 18  # read at a time from such a file


def text_hash(text: str) -> int:
    """The hash that decides whether a text (a document's key) is held out: its UTF-8 bytes'
    8-byte BLAKE2b digest, read as a big-endian integer (below 2**64)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class LongText:
    """A text file's whole document (sample_by = "document") longer than LONG_TEXT_CHARS,
    never held whole: a 1 GB dump would not fit in memory as one string (it took twice its
    size, and encoding it more). One pass over the file when it is found measures its text
    as a held document's is taken (byte-order marks, then whitespace, stripped from its start,
    whitespace from its end), and hashes it as `text_hash` hashes a held text: `key_hash`,
    the document being its own key (a text file has the one field). `chunks` reads that text
    again, a piece at a time; `len` is its length in characters (0: an empty document)."""

    def __init__(self, path: str):
        self.path = path
        self.lead = self.length = 0  # characters dropped before the text; the text's length
        whole = hashlib.blake2b(digest_size=8)  # of everything after `lead` read so far
        kept = whole.copy()  # of the text up to its last non-space character read so far
        read = 0  # characters after `lead`
        dropping = "\ufeff"  # at the start: byte-order marks, then whitespace (" "); "": in the text
        with open_text(path, newline=None) as f:
            for chunk in iter(lambda: f.read(READ_CHARS), ""):
                if dropping == "\ufeff":
                    rest = chunk.lstrip("\ufeff")
                    self.lead, chunk = self.lead + len(chunk) - len(rest), rest
                    dropping = " " if chunk else dropping
                if dropping == " ":
                    rest = chunk.lstrip()
                    self.lead, chunk = self.lead + len(chunk) - len(rest), rest
                    dropping = "" if chunk else dropping
                body = chunk.rstrip()
                if body:  # the text reaches this far; the whitespace after it only if more text follows
                    whole.update(body.encode())
                    kept, self.length = whole.copy(), read + len(body)
                whole.update(chunk[len(body):].encode())
                read += len(chunk)
        self.key_hash = int.from_bytes(kept.digest(), "big")

    def __len__(self) -> int:
        return self.length

    def chunks(self) -> Iterator[str]:
        """The text, read again from the file, READ_CHARS characters at a time."""
        with open_text(self.path, newline=None) as f:
            skip, left = self.lead, self.length
            while skip:  # a piece at a time: a file may open with any amount of whitespace
                skip -= len(f.read(min(skip, READ_CHARS))) or skip
            while left:
                chunk = f.read(min(left, READ_CHARS))
                if not chunk:
                    raise FibctlError(f"{shown_path(self.path)} changed while it was read; prepare again")
                left -= len(chunk)
                yield chunk


def csv_rows(path: str, delimiter: str, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """A CSV (or TSV) file's rows as mappings from its header's names to cells, as written,
    each with its line (`line 3`).

    The header is the first line that is not blank; a file without one holds no rows. The
    header must name each of `fields`, once. A row must have as many cells as the header: a
    row of more or fewer is refused, naming its line (an unquoted delimiter inside a cell, or
    a cell lost, would otherwise move text to another column), as is a quote mark out of place
    (a quoted cell left open swallowed the rest of the file). A TSV has no quoting: a quote
    mark is part of its cell."""
    name = shown_path(path)
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    with open_text(path, newline="") as f:
        # strict: a quote mark out of place is an error, not a cell that swallows the file
        reader = csv.reader(f, delimiter=delimiter, quoting=quoting, strict=True)
        rows = ((start, row) for start, row in _numbered(name, delimiter, reader)
                if any(cell.strip() for cell in row))  # blank lines skipped
        header = next(rows, (0, None))[1]
        if header is None:
            return
        missing = [field for field in fields if field not in header]
        if missing:
            raise FibctlError(f"{name} has no column {', '.join(missing)}; columns: {', '.join(header)}; "
                              f"set text = [...] in the recipe{delimiter_hint(header)}")
        twice = [field for field in fields if header.count(field) > 1]
        if twice:
            raise FibctlError(f"{name}: its header names column {twice[0]} more than once")
        for start, row in rows:
            if len(row) != len(header):
                raise FibctlError(f"{name}: line {start} has {len(row)} cells, the header {len(header)} "
                                  f"(is a {delimiter!r} inside a cell not quoted?)")
            yield f"line {start}", dict(zip(header, row))


def _numbered(name: str, delimiter: str, reader) -> Iterator[tuple[int, list[str]]]:
    """Each row of a CSV reader with the line it starts on (a quoted cell may hold line
    breaks); a row whose quoting is broken is refused, naming that line."""
    end = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise FibctlError(f"{name}: line {end + 1}: its quoting is broken ({e}, reading line {reader.line_num}); "
                              f"a cell holding {delimiter!r}, a quote mark or a line break is quoted whole, "
                              f"its own quote marks doubled") from None
        yield end + 1, row
        end = reader.line_num


def delimiter_hint(header: list[str]) -> str:
    """For a CSV header read as one column whose name holds another likely delimiter: which
    to set."""
    if len(header) != 1:
        return ""
    found = [d for d in ("\t", ";", "|") if d in header[0]]
    return f", or delimiter = {json.dumps(found[0])} (the header is one column)" if found else ""


PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: a file's size is never held


def parquet_rows(path: str, columns: list[str]) -> Iterator[tuple[str, dict]]:
    """A parquet file's rows, the named columns only (a struct column as a mapping), each
    with its number (`row 3`)."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:
        rows = (row for batch in f.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns)
                for row in batch.to_pylist())
        for n, row in enumerate(rows, 1):
            yield f"row {n}", row
