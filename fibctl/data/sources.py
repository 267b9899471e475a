"""Documents from each kind of source, as an iterator of strings (`Document`s, each with the key
that decides whether it is held out) that never holds a corpus.

Hub sources stream through `datasets.load_dataset(..., streaming=True)`; local files are read by
fibctl itself (fibctl.data.json_files, fibctl.data.local_files), each as it is, so that files may
differ in their fields; `installed-docs` and `generated` need no download.
`fingerprint` says what else, besides the recipe, the documents depend on.
"""

from __future__ import annotations

import itertools
import lzma
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from rich.progress import Progress

from fibctl.data import decoding, generated, installed_docs, json_files, local_files
from fibctl.data.recipe import Recipe, Source
from fibctl.errors import FibctlError, shown_path


class Document(str):
    """A document's text, with `key`: the text whose hash decides whether it is held out (its
    `heldout_by` fields' text, so that a problem's solutions go together; else its whole text)."""

    def __new__(cls, text: str, key: str | None = None) -> Document:
        doc = super().__new__(cls, text)
        doc._key = key
        return doc

    @property
    def key(self) -> str:
        return self if self._key is None else self._key

    @property
    def key_hash(self) -> int:
        return local_files.text_hash(self.key)


def documents(recipe: Recipe, source: Source, scratch: Path,
              progress: Progress | None = None) -> Iterator[Document]:
    """The source's documents in a fixed order. `scratch` holds the installed-docs harvest."""
    if source.kind == "generated":
        return map(Document, generated.documents(source.seed, source.documents))
    if source.kind == "installed-docs":
        path = scratch / f"{source.name}.installed-docs.jsonl"
        if not path.exists():  # harvested once per prepare, read for the tokenizer and the streams
            installed_docs.harvest(path, _packages(source), progress)
        return map(Document, installed_docs.read(path))
    if source.kind == "local":
        return _local_documents(recipe, source)
    return _hub_documents(source)


def fingerprint(recipe: Recipe, source: Source) -> dict:
    """What the documents depend on beyond the recipe: file sizes and times, package versions."""
    if source.kind == "local":
        return {p: [os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in recipe.local_files(source)}
    if source.kind == "installed-docs":
        return installed_docs.package_versions(_packages(source))
    return {}


def _packages(source: Source) -> tuple[str, ...]:
    return source.packages or installed_docs.PACKAGES


def _local_documents(recipe: Recipe, source: Source) -> Iterator[Document]:
    # an empty file holds no document (a 0-byte parquet file has no footer to read)
    files = [f for f in recipe.local_files(source) if os.path.getsize(f) > 0]
    if source.format == "parquet":
        files, columns = _check_columns(source, files)
    if source.format == "json":
        def read(path: str) -> Iterator[tuple[str, dict]]:
            return json_files.records(path, source.records)

        yield from _texts(source, _rows(source, files, read), again=lambda: _rows(source, files, read))
    elif source.format == "csv":
        yield from _texts(source, _rows(source, files, lambda p: local_files.csv_rows(p, source.delimiter,
                                                                                       source.text)))
    elif source.format == "text":
        yield from _texts(source, _rows(source, files, lambda p: local_files.text_rows(p, source.sample_by)))
    else:
        yield from _texts(source, _rows(source, files, lambda p: local_files.parquet_rows(p, columns)))


Row = tuple[str, str, dict]  # the file it was read from and where in it (or ''), and its fields


def _rows(source: Source, files: list[str], read: Callable[[str], Iterable[tuple[str, dict]]]) -> Iterator[Row]:
    """The rows of each file in turn, read by `read` with where each is in the file; an error
    names the source and the file."""
    for path in files:
        name = shown_path(path)
        try:
            for where, row in read(path):
                yield name, where, row
        except FibctlError as e:
            raise FibctlError(f"source {source.name!r}: {e}") from None
        except UnicodeDecodeError:
            raise FibctlError(f"source {source.name!r}: {decoding.not_utf8(path)}") from None
        except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as e:
            # a damaged or mislabelled compressed file; a parquet file that is not one (ArrowInvalid)
            raise FibctlError(f"source {source.name!r}: cannot read {shown_path(path)}: {_one_line(e)}") from None


def _check_columns(source: Source, files: list[str]) -> tuple[list[str], list[str]]:
    """Each parquet file has the columns the text fields are read from, holding text (read
    from its footer), else name the file; the files that hold rows, and those columns: a
    field's own, or the nested record (struct column) its dotted name starts with, as the
    first file has them. Each file is read with its own types, the text columns only, so
    shards may differ in any other column, or inside a struct column, beside the fields read."""
    import pyarrow.parquet as pq

    holding, read = [], None
    for path in files:
        try:
            footer = pq.read_metadata(path)
        except Exception as e:
            raise FibctlError(f"source {source.name!r}: cannot read parquet file {shown_path(path)}: "
                              f"{_one_line(e)}") from None
        schema = footer.schema.to_arrow_schema()
        columns = schema.names
        if read is None:
            read = {f: f if f in columns or "." not in f else f.split(".")[0] for f in source.text}
        missing = [f for f, c in read.items() if c not in columns]
        if missing:
            raise FibctlError(f"source {source.name!r}: {shown_path(path)} has no column {', '.join(missing)}; "
                              f"columns: {', '.join(columns)}; set text = [...] in the recipe")
        if not footer.num_rows:  # not read: its types do not matter
            continue
        for field, column in read.items():
            arrow_type = _field_type(schema.field(columns.index(column)).type, field[len(column) + 1:])
            held = _not_text(arrow_type)
            if held:
                inside = (f" (or fields inside it: {field}.{arrow_type[0].name})"
                          if held == "dict" and arrow_type.num_fields else "")
                raise FibctlError(f"source {source.name!r}: field {field!r} holds {held} values, not text, in "
                                  f"{shown_path(path)}; text = [...] must name string fields{inside}")
        holding.append(path)
    return holding, list(dict.fromkeys((read or {}).values())) or list(source.text)


def _field_type(arrow_type, inner: str):
    """The arrow type of the field `inner` (dotted) inside a column of `arrow_type` (through
    an array's items for an index or `*`); None where a record on the way lacks it (a null
    field, as _lookup reads it)."""
    import pyarrow.types as types

    for part in inner.split(".") if inner else ():
        if types.is_struct(arrow_type) and arrow_type.get_field_index(part) >= 0:
            arrow_type = arrow_type[arrow_type.get_field_index(part)].type
        elif _is_array(arrow_type) and (part == "*" or json_files.index(part) is not None):
            arrow_type = arrow_type.value_type
        else:
            return None
    return arrow_type


def _is_array(arrow_type) -> bool:
    import pyarrow.types as types

    return types.is_list(arrow_type) or types.is_large_list(arrow_type) or types.is_fixed_size_list(arrow_type)


# arrow types whose values are text: strings, bytes (decoded as UTF-8) and nulls (by name:
# the view types are newer than some pyarrow versions datasets allows)
_TEXT_TYPES = {"string", "large_string", "string_view", "binary", "large_binary", "binary_view", "null"}


def _not_text(arrow_type) -> str | None:
    """None if a parquet field of `arrow_type` holds text; else what its values are, named as
    _field_text names a row's value (int, float, list...)."""
    import pyarrow.types as types

    if arrow_type is None:
        return None
    if types.is_dictionary(arrow_type):  # a categorical column: its values' type
        arrow_type = arrow_type.value_type
    if str(arrow_type) in _TEXT_TYPES:
        return None
    for test, name in ((types.is_boolean, "bool"), (types.is_integer, "int"), (types.is_floating, "float"),
                       (types.is_decimal, "Decimal"), (types.is_timestamp, "datetime"), (types.is_date, "date"),
                       (types.is_time, "time"), (types.is_duration, "timedelta"), (types.is_struct, "dict"),
                       (types.is_map, "list"), (types.is_nested, "list")):
        if test(arrow_type):
            return name
    return str(arrow_type)


def _quiet(datasets) -> None:
    """Silence the datasets library's own log lines (it logs a JSON parse error, at ERROR,
    before raising it): fibctl reports each failure in one line of its own."""
    import logging

    datasets.utils.logging.set_verbosity(logging.CRITICAL + 1)


HUB_PROBE_TIMEOUT_S = 5.0  # one request before any hub download; HF_HUB_ETAG_TIMEOUT overrides
_hub_reached: dict[str, str | None] = {}  # endpoint -> None when reachable, else why not


ETAG_ENV = "HF_HUB_ETAG_TIMEOUT"
DOWNLOAD_ENV = "HF_HUB_DOWNLOAD_TIMEOUT"  # huggingface_hub's alone, read as ETAG_ENV is


def _hub_timeout(name: str) -> float | None:
    """The environment variable `name` (None when unset), checked as huggingface_hub reads it
    when imported, with int() (set to '' or 'abc', it failed that import with a traceback),
    and positive (-1 was taken, then said as "waited at most -1 s")."""
    given = os.environ.get(name)
    if given is None:
        return None
    try:
        value = int(given)
    except ValueError:
        value = 0
    if value <= 0:
        raise FibctlError(f"{name}={given!r} must be a positive whole number of seconds")
    return float(value)


def _probe_timeout() -> float:
    """HF_HUB_ETAG_TIMEOUT, else the probe's own; HF_HUB_DOWNLOAD_TIMEOUT is checked with it."""
    _hub_timeout(DOWNLOAD_ENV)
    etag = _hub_timeout(ETAG_ENV)
    return HUB_PROBE_TIMEOUT_S if etag is None else etag


def check_hub(dataset: str) -> None:
    """One request to the Hugging Face hub, with a short timeout, before any download: an
    unreachable hub is one line at once, not minutes of retries and a page of warnings.
    Skipped in offline mode (HF_HUB_OFFLINE=1: the local cache is used); an HTTP error
    status (other than a gateway's 502-504) means the hub answered, and the download reports
    what it lacks."""
    import urllib.error
    import urllib.request

    timeout = _probe_timeout()  # before huggingface_hub reads them: 'abc' was its traceback
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return
    endpoint = constants.ENDPOINT.rstrip("/")
    if endpoint not in _hub_reached:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint + "/api/datasets", method="HEAD"),
                                   timeout=timeout).close()
            _hub_reached[endpoint] = None
        except urllib.error.HTTPError as e:  # an answer; a gateway's 5xx means the hub is not behind it
            _hub_reached[endpoint] = f"HTTP {e.code} {e.reason}" if e.code in (502, 503, 504) else None
        except (OSError, ValueError) as e:  # refused, no route, DNS, timeout, a malformed HF_ENDPOINT
            reason = getattr(e, "reason", None) or e
            _hub_reached[endpoint] = (f"{type(reason).__name__}: {str(reason).strip() or 'no answer'}; "
                                      f"waited at most {timeout:g} s")
    why = _hub_reached[endpoint]
    if why is not None:
        raise FibctlError(
            f"cannot reach the Hugging Face hub at {endpoint} for dataset {dataset!r} ({why}); "
            f"offline, download its files elsewhere and point the recipe at them: "
            f'kind = "local", format = "parquet" (or json, csv, text), files = ["path/*.parquet"]')


def _hub_documents(source: Source) -> Iterator[Document]:
    check_hub(source.dataset)
    import datasets

    _quiet(datasets)
    try:
        streams = [iter(_texts(source, (("", "", row) for row in datasets.load_dataset(
            source.dataset, config, split=source.split, streaming=True, revision=source.revision))))
            for config in source.configs or (None,)]
        yield from _round_robin(streams)
    except FibctlError:
        raise
    except Exception as e:
        raise FibctlError(
            f"cannot stream Hugging Face dataset {source.dataset!r} for source {source.name!r} "
            f"({_one_line(e)}); offline, download its files elsewhere and point the recipe at them: "
            f'kind = "local", format = "parquet" (or json, csv, text), files = ["path/*.parquet"]'
        ) from None


def _round_robin(streams: list[Iterator[Document]]) -> Iterator[Document]:
    """One document from each stream in turn, dropping streams as they run out."""
    while streams:
        alive = []
        for stream in streams:
            doc = next(stream, None)
            if doc is not None:
                alive.append(stream)
                yield doc
        streams = alive


LOOKAHEAD_ROWS = 10_000  # rows read ahead for a text field that none of the first rows has


def _texts(source: Source, rows: Iterable[Row],
           again: Callable[[], Iterable[Row]] | None = None) -> Iterator[Document]:
    """Join the source's text fields of each row, and its heldout_by fields (alike) into the
    document's key; skip rows with no text. A field a row lacks is null there, as in a table
    (JSON files whose rows, or whole files, leave out an optional title), once some row has had
    it. A field none of the first LOOKAHEAD_ROWS rows has is looked for in the rest of them when
    `again` can read the rows afresh (JSON files, whose records may each have other fields), and
    the rows are read from the start once it is found; a field no row has (or, in a table, none
    of the first rows) is taken for a typo and refused. A field that is not text is refused
    naming the file and the place its row was read from."""
    rows = iter(rows)
    ahead: list[Row] = []
    unseen = set(source.text)
    for row in rows:
        ahead.append(row)
        unseen = {f for f in unseen if _lookup(row[2], f) is _ABSENT}
        if not unseen or len(ahead) == LOOKAHEAD_ROWS:
            break
    read, whole, first = len(ahead), len(ahead) < LOOKAHEAD_ROWS, ahead[0][2] if ahead else {}
    if unseen and again is not None and not whole:
        ahead = []  # held no longer: the rows are read again from the start if the field turns up
        for _, _, row in rows:
            read += 1
            unseen = {f for f in unseen if _lookup(row, f) is _ABSENT}
            if not unseen:
                break
        else:
            whole = True
        if not unseen:
            rows = iter(again())
    if read and unseen:
        missing = [f for f in source.text if f in unseen]
        which = "no row" if whole else f"none of the first {read:,} rows"
        raise FibctlError(f"source {source.name!r}: {which} has field {', '.join(missing)}; fields: "
                          f"{', '.join(first)}; set text = [...] in the recipe")
    for file, where, row in itertools.chain(ahead, rows):
        if isinstance(row.get("text"), local_files.LongText):  # a text file's document, too long to hold
            if row["text"]:  # its one field, stripped, its own key (heldout_by can name only it)
                yield row["text"]
            continue
        values = {f: _lookup(row, f) for f in source.text}
        texts = {f: _field_text(source, f, None if v is _ABSENT else v, file, where) for f, v in values.items()}
        text = "\n\n".join(t for t in texts.values() if t)
        if text:
            # a row whose heldout_by fields are all empty (no problem given) is keyed by its
            # whole text, as without heldout_by
            key = "\n\n".join(texts[f] for f in source.heldout_by if texts[f]) if source.heldout_by else ""
            yield Document(text, key or None)


_ABSENT = object()  # a field a row lacks: null there


class _Gathered(list):
    """The values a `*` in a dotted name found, one per item of an array: their texts are
    joined as a document's fields are."""


def _lookup(row: dict, field: str) -> object:
    """A row's value of `field`. A dotted name reaches into nested records (`meta.title`) and
    arrays (`paragraphs.0.context`; `paragraphs.*.context`, every item's, _Gathered) when the
    row has no field of that whole name; a field the row lacks (or whose parent is null, or an
    array too short) is _ABSENT, as is a `*` that finds it in no item."""
    if field in row:
        return row[field]
    return _reach(row, field.split("."))


def _reach(value: object, parts: list[str]) -> object:
    for n, part in enumerate(parts):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part == "*":
            found = [_reach(item, parts[n + 1:]) for item in value]
            found = [v for f in found for v in (f if isinstance(f, _Gathered) else [f]) if v is not _ABSENT]
            return _Gathered(found) if found else _ABSENT
        elif isinstance(value, list) and (i := json_files.index(part)) is not None and i < len(value):
            value = value[i]
        else:
            return _ABSENT
    return value


def _field_text(source: Source, field: str, value: object, file: str, where: str) -> str:
    """A field's text, stripped; a null (a row without it, in a table) is empty. Numbers,
    lists and mappings are refused, naming the file and where the row is in it (`file`, `where`:
    '' for a hub row): their Python repr is not a document to train on."""
    if value is None:
        return ""
    if isinstance(value, _Gathered):
        return "\n\n".join(filter(None, (_field_text(source, field, v, file, where) for v in value)))
    if isinstance(value, bytes):  # a binary parquet column
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise FibctlError(f"source {source.name!r}: field {field!r} holds bytes that are not "
                              f"UTF-8 text{_in(file, where)}") from None
    if isinstance(value, json_files.Unpaired):  # refused here, in a field read: not in a record's other fields
        raise FibctlError(f"source {source.name!r}: field {field!r} holds a lone surrogate escape (half of a "
                          f"character, e.g. \\ud800), not text{_in(file, where)}")
    if not isinstance(value, str):
        inside = (f" (or fields inside it: {field}.{next(iter(value))})" if isinstance(value, dict) and value else
                  f" (or an item's: {field}.0{_first_key(value[0])}, or every item's: {field}.*{_first_key(value[0])})"
                  if isinstance(value, list) and value else "")
        held = "int" if isinstance(value, json_files.LongInt) else type(value).__name__
        raise FibctlError(f"source {source.name!r}: field {field!r} holds {held} "
                          f"values, not text{_in(file, where)}; text = [...] must name string fields{inside}") from None
    if source.format == "text":  # a file's byte-order mark (the json and csv readers drop it)
        value = value.lstrip("\ufeff")
    return value.strip()


def _first_key(item: object) -> str:
    """`.KEY` for an array's first item that is a record (paragraphs.*.context), else ''."""
    return f".{next(iter(item))}" if isinstance(item, dict) and item else ""


def _in(file: str, where: str) -> str:
    """', in FILE, WHERE': where a row was read, for a message ('' for a hub row)."""
    return f", in {', '.join(filter(None, (file, where)))}" if file else ""


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
