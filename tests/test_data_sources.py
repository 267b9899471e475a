"""Local sources on corpora nobody tuned for: odd encodings, links, folders, pipes, field types."""

from __future__ import annotations

import json
import re
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fibctl.data import sources
from fibctl.data.recipe import Recipe, load_recipe, parse_recipe
from fibctl.errors import FibctlError

RECIPE = """# a recipe over local text files
name = "odd"
vocab_size = 512
train_tokens = 1000

[[sources]]
name = "notes"
kind = "local"
format = "text"
files = ["notes/*.txt"]
share = 1.0
"""


def _local(files: str, fmt: str = "text", **extra) -> tuple[Recipe, object]:
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "notes", "kind": "local", "format": fmt, "files": [files], "share": 1, **extra}]})
    return recipe, recipe.sources[0]


def _docs(recipe: Recipe, source, tmp_path: Path) -> list[str]:
    return list(sources.documents(recipe, source, tmp_path))


def _notes(root: Path, n: int = 3) -> Path:
    (root / "notes").mkdir()
    for i in range(n):
        (root / "notes" / f"{i}.txt").write_text(f"note {i} river stone lantern\n")
    return root / "notes"


def test_recipe_with_a_byte_order_mark_loads(tmp_path):
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + RECIPE.encode())
    assert load_recipe(tmp_path / "bom.toml").name == "odd"


def test_a_tilde_in_a_recipes_files_is_the_home_folder(tmp_path, monkeypatch):
    """`~/corpus/*.txt` was taken relative to the recipe's folder (`RECIPE_DIR/~/corpus`), so
    a recipe written as a shell path matched no file."""
    home = tmp_path / "home"
    home.mkdir()
    _notes(home)
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "r.toml").write_text(RECIPE.replace("notes/*.txt", "~/notes/*.txt"))
    recipe = load_recipe(tmp_path / "r.toml")
    assert recipe.sources[0].files == (str(home / "notes" / "*.txt"),)
    assert _docs(recipe, recipe.sources[0], tmp_path)[0] == "note 0 river stone lantern"


@pytest.mark.parametrize("files", ["~a\0b/*.txt", "notes\0/*.txt", "/notes/\0.txt"])
def test_a_nul_in_a_recipes_files_is_refused_in_one_line(files):
    """TOML's "\u0000" puts one in a string: expanduser (a `~user`) and resolve raised a
    ValueError, a traceback from data prepare."""
    with pytest.raises(FibctlError, match=re.escape(f"source 'notes': files {files!r} holds a NUL character")):
        _local(files)


def test_a_glob_skips_hidden_names_as_a_shell_does_unless_it_names_the_dot(tmp_path):
    """As docs/data.md says: `*` and `**` do not reach `.git` or `.notes.txt`; a glob naming
    the dot does."""
    notes = _notes(tmp_path, 1)
    (notes / ".hidden.txt").write_text("hidden note\n")
    (notes / ".git").mkdir()
    (notes / ".git" / "x.txt").write_text("git note\n")
    recipe, source = _local(str(notes / "**" / "*.txt"), "text")
    assert _docs(recipe, source, tmp_path) == ["note 0 river stone lantern"]
    recipe, source = _local(str(notes / ".*.txt"), "text")
    assert _docs(recipe, source, tmp_path) == ["hidden note"]


def test_files_are_read_in_path_order_whatever_order_the_disk_lists_them(tmp_path, monkeypatch):
    """Same corpus, same stream: the order a folder lists its files in (creation order, a
    filesystem's hash order) and the order of the recipe's globs decide nothing."""
    import glob

    from fibctl.data import recipe as recipe_module

    for folder, name in [("b", "2"), ("a", "1"), ("b", "0"), ("a", "3")]:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{name}.txt").write_text(f"{folder}/{name}\n")
    real = glob.glob
    monkeypatch.setattr(recipe_module.glob, "glob", lambda *a, **k: real(*a, **k)[::-1])
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "notes", "kind": "local", "format": "text", "share": 1,
         "files": [str(tmp_path / "b" / "*.txt"), str(tmp_path / "a" / "*.txt")]}]})
    assert _docs(recipe, recipe.sources[0], tmp_path) == ["a/1", "a/3", "b/0", "b/2"]


def test_recipe_not_utf8_is_one_line_exit_2(tmp_path):
    (tmp_path / "latin.toml").write_bytes(RECIPE.replace("a recipe", "caf\xe9").encode("latin-1"))
    with pytest.raises(FibctlError, match=r"latin\.toml: byte 0xe9 .* not UTF-8"):
        load_recipe(tmp_path / "latin.toml")
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "latin.toml", "--out", "out",
                           "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "latin.toml" in done.stderr and "Traceback" not in done.stderr


def test_symlink_loop_and_file_link_read_each_file_once(tmp_path):
    notes = _notes(tmp_path)
    (notes / "sub").mkdir()
    (notes / "sub" / "deep.txt").write_text("deep note\n")
    (notes / "sub" / "up").symlink_to("..")  # a loop under **
    (notes / "zz-link.txt").symlink_to("0.txt")  # a second name for one document
    recipe, source = _local(str(notes / "**" / "*.txt"))
    files = recipe.local_files(source)
    assert len({os.path.realpath(p) for p in files}) == len(files) == 4
    assert str(notes / "0.txt") in files  # the first name in sorted order is kept
    docs = _docs(recipe, source, tmp_path)
    assert sorted(docs) == sorted(["note 0 river stone lantern", "note 1 river stone lantern",
                                   "note 2 river stone lantern", "deep note"])
    assert set(sources.fingerprint(recipe, source)) == set(files)


def test_a_glob_matching_folders_reads_the_files_in_them(tmp_path):
    notes = _notes(tmp_path)
    (notes / "a" / "b").mkdir(parents=True)
    (notes / "a" / "b" / "nested.txt").write_text("nested note\n")
    recipe, source = _local(str(notes / "**"))
    assert "nested note" in _docs(recipe, source, tmp_path)
    assert all(Path(p).is_file() for p in recipe.local_files(source))


def test_a_pipe_is_refused_by_name(tmp_path):
    notes = _notes(tmp_path)
    os.mkfifo(notes / "pipe.txt")
    recipe, source = _local(str(notes / "*.txt"))
    with pytest.raises(FibctlError, match=r"source 'notes': .*pipe\.txt is not a regular file"):
        sources.fingerprint(recipe, source)  # reading the pipe would wait for a writer forever


def test_a_broken_link_is_named(tmp_path):
    notes = _notes(tmp_path)
    (notes / "gone.txt").symlink_to("nonexistent.txt")
    recipe, source = _local(str(notes / "*.txt"))
    with pytest.raises(FibctlError, match=r"source 'notes': .*gone\.txt is a broken link"):
        sources.fingerprint(recipe, source)


def test_a_latin1_text_file_is_named(tmp_path):
    notes = _notes(tmp_path)
    (notes / "1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    recipe, source = _local(str(notes / "*.txt"))
    with pytest.raises(FibctlError, match=r"notes/1\.txt is not UTF-8 text: line 1 \(byte 0xe9 at offset 3\); if the "
                                          r"whole file is in another encoding, convert it to UTF-8 \(e\.g\. iconv -f "
                                          r"latin1 -t utf-8\), else fix that line$"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("scan", [1, 2, 3, 5, 1 << 20])
def test_a_stray_byte_in_a_utf8_file_is_named_by_its_line(tmp_path, monkeypatch, scan):
    """One byte that is not UTF-8 in a UTF-8 file was "not UTF-8 text; convert it (iconv -f
    latin1)", with no line: converting it garbles every other letter that is not ASCII. Its
    line and offset are found whatever the chunks the file is read in."""
    from fibctl.data import decoding

    monkeypatch.setattr(decoding, "UTF8_SCAN_BYTES", scan)
    (tmp_path / "rows.jsonl").write_bytes('{"text": "café"}\n{"text": "naïve"}\n'.encode() + b'{"text": "a\xff"}\n')
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json")
    with pytest.raises(FibctlError, match=r"^source 'notes': .*rows\.jsonl: line 3 \(byte 0xff at offset 48\) is not "
                                          r"UTF-8, though the text around it is: fix that line \(converting the whole "
                                          r"file from another encoding would garble the rest\)$"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "rows.jsonl").write_bytes('{"text": "a"}\n{"text": "é'.encode()[:-1])  # cut inside its last letter
    with pytest.raises(FibctlError, match=r"rows\.jsonl is not UTF-8 text: line 2 \(byte 0xc3 at offset 24\);"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("value, kind", [(123, "int"), (["a", "b"], "list"), ({"x": 1}, "dict")])
def test_a_field_that_is_not_text_is_refused_naming_its_file_and_line(tmp_path, value, kind):
    """The refusal named neither the file nor the record: one `"text": 5` among millions."""
    rows = [{"text": "first"}, {"text": "second"}, {"text": value}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    for name, where in (("rows.jsonl", "line 4"), ("rows.json", "item 2")):
        if name == "rows.jsonl":
            (tmp_path / name).write_text("\n" + (tmp_path / name).read_text())  # a blank line first
        recipe, source = _local(str(tmp_path / name), "json")
        with pytest.raises(FibctlError, match=rf"^source 'notes': field 'text' holds {kind} values, not text, in "
                                              rf".*{re.escape(name)}, {where}; text = \[\.\.\.\] must name"):
            _docs(recipe, source, tmp_path)


def test_a_null_field_is_empty(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"text": "first"}\n{"text": null}\n{"text": "third"}\n')
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json")
    assert _docs(recipe, source, tmp_path) == ["first", "third"]


def test_a_binary_parquet_column_is_decoded(tmp_path):
    pq.write_table(pa.table({"text": pa.array([b"first doc", "caf\xe9".encode()], pa.binary())}),
                   tmp_path / "a.parquet")
    recipe, source = _local(str(tmp_path / "a.parquet"), "parquet")
    assert _docs(recipe, source, tmp_path) == ["first doc", "caf\xe9"]
    pq.write_table(pa.table({"text": pa.array([b"first doc", b"caf\xe9"], pa.binary())}), tmp_path / "a.parquet")
    with pytest.raises(FibctlError, match=r"field 'text' holds bytes that are not UTF-8 text, in .*a\.parquet, row 2$"):
        _docs(recipe, source, tmp_path)


@pytest.fixture
def datasets_logging_default():
    """The datasets library's own default, whatever an earlier test set."""
    import datasets

    before = datasets.utils.logging.get_verbosity()
    datasets.utils.logging.set_verbosity(logging.WARNING)
    yield
    datasets.utils.logging.set_verbosity(before)


def test_a_json_parse_error_is_fibctls_line_alone(tmp_path, capfd, datasets_logging_default):
    (tmp_path / "rows.jsonl").write_text('{"text": "a lone \\ud800 surrogate"}\n{"text": "fine"}\n')
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json")
    with pytest.raises(FibctlError, match=r"field 'text' holds a lone surrogate escape .*rows\.jsonl, line 1"):
        _docs(recipe, source, tmp_path)
    assert "Failed to load JSON" not in capfd.readouterr().err


@pytest.mark.parametrize("layout", ["lines", "array", "object"])
def test_a_lone_surrogate_is_refused_in_a_field_read_only(tmp_path, layout):
    """A lone surrogate escape in a field the recipe does not read (a title, with text =
    ["text"]) refused the whole corpus."""
    records = [{"text": "a", "title": "\ud800", "meta": {"notes": ["x", "\udc00"], "note": "\udc00"}},
               {"text": "b \ud83d\ude00", "title": "paired"}]  # an escaped pair is one character
    if layout == "object":
        records = records[:1]
    content = {"lines": "".join(json.dumps(r) + "\n" for r in records), "array": json.dumps(records),
               "object": json.dumps(records[0], indent=2)}[layout]
    (tmp_path / "rows.json").write_text(content)
    recipe, source = _local(str(tmp_path / "rows.json"), "json")
    assert _docs(recipe, source, tmp_path) == ["a", "b \U0001f600"][:len(records)]
    where = {"lines": ", line 1", "array": ", item 0", "object": ""}[layout]
    for field in ("title", "meta.note"):
        recipe, source = _local(str(tmp_path / "rows.json"), "json", text=["text", field])
        with pytest.raises(FibctlError, match=rf"^source 'notes': field '{field}' holds a lone surrogate escape "
                                              rf"\(half of a character, e\.g\. \\ud800\), not text, in "
                                              rf".*rows\.json{where}$"):
            _docs(recipe, source, tmp_path)


def test_csv_cells_are_text_as_written(tmp_path):
    # pandas would read 1984 as a number and "NA", "null" or an empty cell as missing
    (tmp_path / "rows.csv").write_text('title,text\n1984,"a novel, in two lines\nof text"\n'
                                       'Notes,NA\nNull,null\n2001,""\n')
    recipe, source = _local(str(tmp_path / "rows.csv"), "csv", text=["title", "text"])
    assert _docs(recipe, source, tmp_path) == ["1984\n\na novel, in two lines\nof text", "Notes\n\nNA",
                                               "Null\n\nnull", "2001"]


def test_csv_with_another_delimiter(tmp_path):
    (tmp_path / "rows.csv").write_text("id;text\n1;first; with a semicolon\n2;second\n")
    recipe, source = _local(str(tmp_path / "rows.csv"), "csv")
    with pytest.raises(FibctlError, match=r"rows.csv has no column text; columns: id;text; .* or delimiter = \";\" \(the header is one column"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "rows.csv").write_text('id;text\n1;"first; with a semicolon"\n2;second\n')
    recipe, source = _local(str(tmp_path / "rows.csv"), "csv", delimiter=";")
    assert _docs(recipe, source, tmp_path) == ["first; with a semicolon", "second"]
    (tmp_path / "rows.tsv").write_text("id\ttext\n1\tfirst, with a comma\n")
    recipe, source = _local(str(tmp_path / "rows.tsv"), "csv", delimiter="\t")
    assert _docs(recipe, source, tmp_path) == ["first, with a comma"]


def test_a_field_a_whole_file_leaves_out_is_null_there(tmp_path):
    """A file whose rows have no title (an optional field) failed the whole source when it
    sorted first, and read as null when it sorted second; a field no row has is still refused."""
    (tmp_path / "0.jsonl").write_text('{"body": "untitled"}\n')
    (tmp_path / "1.jsonl").write_text('{"title": "T", "body": "titled"}\n')
    recipe, source = _local(str(tmp_path / "*.jsonl"), "json", text=["title", "body"])
    assert _docs(recipe, source, tmp_path) == ["untitled", "T\n\ntitled"]
    recipe, source = _local(str(tmp_path / "*.jsonl"), "json", text=["titel", "body"])
    with pytest.raises(FibctlError, match="source 'notes': no row has field titel; fields: body; set text"):
        _docs(recipe, source, tmp_path)


def test_a_json_field_first_seen_after_the_lookahead_is_read(tmp_path, monkeypatch):
    """A title first given by record 10,001 (a corpus whose early records are untitled) was
    refused as a typo; the rest of the records are searched for it, and a field none has is
    still refused, naming how many were read."""
    monkeypatch.setattr(sources, "LOOKAHEAD_ROWS", 50)
    rows = [{"body": f"untitled {i}"} for i in range(60)] + [{"title": "T", "body": "titled"}]
    (tmp_path / "0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    (tmp_path / "1.jsonl.gz").write_bytes(__import__("gzip").compress(
        "".join(json.dumps(r) + "\n" for r in rows[40:]).encode()))
    recipe, source = _local(str(tmp_path / "*.json*"), "json", text=["title", "body"])
    assert _docs(recipe, source, tmp_path) == [f"untitled {i}" for i in range(60)] + ["T\n\ntitled"]
    recipe, source = _local(str(tmp_path / "*.json*"), "json", text=["titel", "body"])
    with pytest.raises(FibctlError, match="source 'notes': no row has field titel; fields: body; set text"):
        _docs(recipe, source, tmp_path)
    # a table's rows all have its columns: its header decides
    (tmp_path / "t.csv").write_text("body\n" + "".join(f"row {i}\n" for i in range(60)))
    recipe, source = _local(str(tmp_path / "t.csv"), "csv", text=["title", "body"])
    with pytest.raises(FibctlError, match="source 'notes': .*t.csv has no column title; columns: body; set text"):
        _docs(recipe, source, tmp_path)


def test_a_dotted_field_reads_inside_nested_records(tmp_path):
    """{"meta": {"title": ...}} could not be read at all: a mapping is refused, and no name
    reached inside it. A dotted name does (a field of that whole name first), in JSON records
    and parquet struct columns alike; a null parent is a null field."""
    rows = [{"meta": {"title": f"T{i}", "n": i}, "content": {"body": f"body {i}"}} for i in range(3)]
    rows.append({"meta": None, "content": {"body": "untitled"}})
    expected = ["T0\n\nbody 0", "T1\n\nbody 1", "T2\n\nbody 2", "untitled"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    for name, fmt in (("a.jsonl", "json"), ("a.parquet", "parquet")):
        recipe, source = _local(str(tmp_path / name), fmt, text=["meta.title", "content.body"])
        assert _docs(recipe, source, tmp_path) == expected, fmt
        recipe, source = _local(str(tmp_path / name), fmt, text=["meta.titel"])
        with pytest.raises(FibctlError, match="no row has field meta.titel"):
            _docs(recipe, source, tmp_path)
    (tmp_path / "b.jsonl").write_text('{"a.b": "a dotted name of its own", "a": {"b": "inside"}}\n')
    recipe, source = _local(str(tmp_path / "b.jsonl"), "json", text=["a.b"])
    assert _docs(recipe, source, tmp_path) == ["a dotted name of its own"]
    recipe, source = _local(str(tmp_path / "a.jsonl"), "json", text=["meta"])
    with pytest.raises(FibctlError, match=r"field 'meta' holds dict values, not text, in .*a\.jsonl, line 1; text = "
                                          r"\[\.\.\.\] must name string fields \(or fields inside it: meta\.title\)"):
        _docs(recipe, source, tmp_path)
    recipe, source = _local(str(tmp_path / "a.parquet"), "parquet", text=["x.y"])
    with pytest.raises(FibctlError, match="a.parquet has no column x.y; columns: meta, content"):
        _docs(recipe, source, tmp_path)


def test_json_files_may_differ_in_their_fields(tmp_path):
    """The datasets builder fixed the columns from the first file: a later file with one more
    field (an optional url) failed the whole source with a CastError."""
    (tmp_path / "0.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "1.jsonl").write_text('{"text": "b", "url": "u"}\n\n{"url": "v", "text": "c", "n": 1}\n')
    recipe, source = _local(str(tmp_path / "*.jsonl"), "json")
    assert _docs(recipe, source, tmp_path) == ["a", "b", "c"]


@pytest.mark.parametrize("content, docs", [
    ('[{"text": "a"}, {"text": "b"}]', ["a", "b"]),  # one array of records
    ('\n  [{"text": "a"},\n   {"text": "b"}]', ["a", "b"]),  # indented
    ('{\n  "text": "one record"\n}\n', ["one record"]),  # one object over lines
    ('\ufeff\r\n{"text": "a"}\r\n{"text": "b"}\r\n', ["a", "b"]),  # BOM, CRLF, a blank line first
])
def test_json_files_in_each_layout_are_read(content, docs, tmp_path):
    (tmp_path / "rows.json").write_text(content, encoding="utf-8")
    recipe, source = _local(str(tmp_path / "rows.json"), "json")
    assert _docs(recipe, source, tmp_path) == docs


def test_a_file_of_one_array_is_read_item_by_item(tmp_path, monkeypatch):
    """A file of one array was read and parsed whole (250 MB took 660 MB): its items are parsed
    from chunks, as json.loads (the reference) reads them, whatever the chunks' size."""
    import io
    import random

    from fibctl.data import decoding, json_files

    rng = random.Random(0)
    pieces = ["漢字", "😀", "\\u00e9", "\\ud83d\\ude00", "\\n", '\\"', "]", ",", "[", "{", " "]
    items = [{"text": "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))), "n": rng.random(),
              "meta": {"k": [1, 2.5e10, None, True]}} for _ in range(40)]
    commas = [",", " ,", ",\n  "]
    spaced = ["[", "\n", *(json.dumps(item, ensure_ascii=False) + rng.choice(commas) for item in items[:-1]),
              json.dumps(items[-1]), " \n] \n"]
    path = tmp_path / "rows.json"
    path.write_text("".join(spaced), encoding="utf-8")
    expected = json.loads(path.read_text(encoding="utf-8"))
    for chunk in (1, 2, 3, 7, 64, 1 << 20):
        monkeypatch.setattr(json_files, "ARRAY_CHUNK", chunk)
        assert [record for _, record in json_files.records(str(path))] == expected, chunk
    for text, words in [("[]", None), ("[ ]\n", None), ("[{}, {}]", None),
                        ('[{"text": "a"},]', "item 1 is not JSON (Expecting value at line 1, column 16)"),
                        ('[\n {"text": "a"},\n  {"text": tru}\n]',
                         "item 1 is not JSON (Expecting value at line 3, column 12)"),
                        ('[{"text": "a"}', "the array is not closed"),
                        ('[{"text": "a"} {"text": "b"}]', "after item 0, '{' is not JSON"),
                        ('[{"text": "a"}] x', "the file is not JSON (text after the array's ']')"),
                        ("[1, 23]", "item 0 is a number, not a JSON object"), ('[{"text": "\\ud800"}]', None)]:
        path.write_text(text)
        for chunk in (1, 3, 1 << 20):
            monkeypatch.setattr(json_files, "ARRAY_CHUNK", chunk)
            if words is None:
                assert [record for _, record in json_files.records(str(path))] == json.loads(text)
            else:
                with pytest.raises(FibctlError, match=re.escape(f"rows.json: {words}")):
                    list(json_files.records(str(path)))
    # the first item comes before the rest of the file is read
    path.write_text(json.dumps([{"text": "x" * 1000}] * 2000))
    monkeypatch.setattr(json_files, "ARRAY_CHUNK", 4096)
    opened = []
    real_open = decoding.open_binary
    monkeypatch.setattr(decoding, "open_binary", lambda p: opened.append(real_open(p)) or opened[-1])
    rows = json_files.records(str(path))
    assert next(rows) == ("item 0", {"text": "x" * 1000})
    assert opened[-1].tell() < path.stat().st_size // 50  # the file as read (its first bytes were looked at first)
    assert sum(1 for _ in rows) == 1999
    assert isinstance(opened[-1], io.BufferedReader)


def test_an_integer_longer_than_python_converts_is_read_as_a_number(tmp_path):
    """Python refuses to convert an integer of more than 4,300 digits: a record holding one in
    a field beside its text was refused as "not JSON" (on line 1, blaming the whole file)."""
    big = "9" * 5000
    for content in (f'{{"text": "a", "id": {big}}}\n{{"text": "b"}}\n',  # lines
                    f'[{{"text": "a", "id": {big}}}, {{"text": "b"}}]',  # one array
                    f'{{\n  "text": "a",\n  "id": -{big}\n}}\n'):  # one object over lines
        (tmp_path / "rows.json").write_text(content)
        recipe, source = _local(str(tmp_path / "rows.json"), "json")
        assert _docs(recipe, source, tmp_path) == ["a", "b"][:content.count('"text"')], content
    (tmp_path / "rows.json").write_text(f'{{"text": {big}}}\n')  # a number is still not text
    with pytest.raises(FibctlError, match="field 'text' holds int values, not text"):  # was "float values"
        _docs(recipe, source, tmp_path)


def test_an_integer_past_a_lowered_digit_limit_is_read_as_a_number(tmp_path):
    """The limit is Python's setting (PYTHONINTMAXSTRDIGITS), not always 4,300: under a lower
    one, a 1,000-digit integer beside the text made its line "not JSON"."""
    (tmp_path / "rows.json").write_text(f'{{"text": "a", "id": {"9" * 1000}}}\n')
    recipe, source = _local(str(tmp_path / "rows.json"), "json")
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)
    try:
        assert _docs(recipe, source, tmp_path) == ["a"]
    finally:
        sys.set_int_max_str_digits(before)


@pytest.mark.parametrize("content, words", [
    ('{"text": "a"}\n{"text": "b"\n', "rows.json: line 2 is not JSON"),
    ('\n\n{"text": "a"}\n["x"]\n', "rows.json: line 4 is an array, not a JSON object of fields"),
    ('{"text": "a"}\nnull\n', "rows.json: line 2 is null, not a JSON object of fields"),  # was "a JSON NoneType"
    ('{"text": "a"}\n"b"\n', "rows.json: line 2 is a string, not a JSON object of fields"),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "rows.json: line 1 nests its values too deeply to read"),
])
def test_a_bad_json_file_names_the_file_and_line(content, words, tmp_path):
    (tmp_path / "rows.json").write_text(content)
    recipe, source = _local(str(tmp_path / "rows.json"), "json")
    with pytest.raises(FibctlError, match=re.escape(words)):
        _docs(recipe, source, tmp_path)


def test_a_byte_order_mark_opening_a_json_lines_line_is_dropped(tmp_path):
    """JSON Lines files each with a byte-order mark, joined (`cat a.jsonl b.jsonl`): the first
    file's mark was dropped, the second's refused as "line 2 is not JSON (Expecting value at
    column 1)", a column that looks fine."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "rows.jsonl").write_bytes(bom + b'{"text": "a"}\r\n' + bom + b'{"text": "b"}\r\n' + bom + b"\r\n")
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json")
    assert _docs(recipe, source, tmp_path) == ["a", "b"]


@pytest.mark.parametrize("damage", ["cut", "flipped"])
def test_a_damaged_compressed_json_file_is_named(damage, tmp_path):
    import gzip

    data = bytearray(gzip.compress(b'{"text": "hello"}\n' * 10_000))
    if damage == "cut":
        data = data[:100]
    else:
        data[len(data) // 2] ^= 0xFF  # zlib's own error, or a CRC that fails
    (tmp_path / "rows.jsonl.gz").write_bytes(bytes(data))
    recipe, source = _local(str(tmp_path / "rows.jsonl.gz"), "json")
    with pytest.raises(FibctlError, match=r"source 'notes': (cannot read .*rows\.jsonl\.gz|.*rows\.jsonl\.gz: line)"):
        _docs(recipe, source, tmp_path)


def test_a_tsv_is_read_without_quoting(tmp_path):
    """Read with CSV quoting, a cell opening with a quote mark swallowed the rows up to the next
    one and the marks vanished: 3 documents of 5."""
    (tmp_path / "q.tsv").write_text('title\ttext\nA\t"Hello," she said.\nB\t"Unbalanced quote\nC\tthird row\n'
                                    'D\tfourth "row\n')
    recipe, source = _local(str(tmp_path / "q.tsv"), "csv", delimiter="\t", text=["title", "text"])
    assert _docs(recipe, source, tmp_path) == ['A\n\n"Hello," she said.', 'B\n\n"Unbalanced quote', "C\n\nthird row",
                                               'D\n\nfourth "row']


def test_a_text_files_byte_order_mark_is_not_text(tmp_path):
    notes = _notes(tmp_path, 1)
    (notes / "0.txt").write_text("\ufeffOnce upon a time\n", encoding="utf-8")
    recipe, source = _local(str(notes / "*.txt"))
    assert _docs(recipe, source, tmp_path) == ["Once upon a time"]


def test_the_file_that_is_not_utf8_is_named_beside_a_compressed_one(tmp_path):
    """A .gz file's own bytes are not text: it was named, and iconv on it suggested."""
    import gzip

    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write('{"text": "fine"}\n')
    (tmp_path / "b.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    recipe, source = _local(str(tmp_path / "*.jsonl*"), "json")
    with pytest.raises(FibctlError, match=r"b\.jsonl is not UTF-8 text"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("fmt, write", [
    ("csv", lambda p: p.write_text("")),
    ("parquet", lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p)),
])
def test_an_empty_shard_holds_no_documents(fmt, write, tmp_path):
    """A 0-byte csv failed the source with EmptyDataError, a 0-row parquet file with
    'ArrowInvalid: BatchSize must be greater than 0', neither naming the file."""
    (tmp_path / "shards").mkdir()
    write(tmp_path / "shards" / f"0.{fmt}")
    if fmt == "csv":
        (tmp_path / "shards" / "1.csv").write_text("text\nfirst\n")
    else:
        pq.write_table(pa.table({"text": ["first"]}), tmp_path / "shards" / "1.parquet")
    recipe, source = _local(str(tmp_path / "shards" / f"*.{fmt}"), fmt)
    assert _docs(recipe, source, tmp_path) == ["first"]
    (tmp_path / "shards" / f"1.{fmt}").unlink()
    assert _docs(recipe, source, tmp_path) == []


@pytest.mark.parametrize("extra, message", [
    ({"delimiter": ";;"}, "delimiter ';;' must be one character"),
    ({"delimiter": ";", "format": "json"}, "delimiter applies to format \"csv\" only, not 'json'"),
])
def test_a_bad_delimiter_is_named(tmp_path, extra, message):
    with pytest.raises(FibctlError, match=f"source 'notes': {message}"):
        _local(str(tmp_path / "rows.csv"), **{"fmt": "csv", **extra})


def test_the_delimiter_leaves_older_recipes_hashes_as_they_were():
    # a changed hash would rebuild every data folder, and checkpoints record the data they trained on
    assert load_recipe("demo").recipe_hash == "426f0268adad6222"
    assert _local("x.csv", "csv")[0].recipe_hash != _local("x.csv", "csv", delimiter=";")[0].recipe_hash


def test_heldout_by_leaves_older_recipes_hashes_as_they_were():
    recipe = {"train_tokens": 1000, "vocab_size": 512, "sources": [
        {"name": "a", "kind": "local", "format": "json", "files": ["/data/a.jsonl"], "text": ["problem", "solution"],
         "share": 0.5, "heldout": "a_val", "heldout_fraction": 0.1},
        {"name": "b", "kind": "hub", "dataset": "o/n", "text": ["problem", "solution"], "share": 0.5}]}
    assert parse_recipe(recipe).recipe_hash == "fca33924a35b117d"  # as before heldout_by was a key
    recipe["sources"][1]["heldout_by"] = "problem"
    assert parse_recipe(recipe).recipe_hash != "fca33924a35b117d"


@pytest.mark.parametrize("source, message", [
    ({"kind": "generated", "heldout_by": ["text"]}, "heldout_by applies to kind \"hub\" or \"local\" only, "
                                                    "not 'generated'"),
    ({"kind": "installed-docs", "heldout_by": "text"}, "heldout_by applies to kind \"hub\" or \"local\" only, "
                                                       "not 'installed-docs'"),
    ({"kind": "local", "format": "json", "heldout_by": ["problem"]},
     "heldout_by names 'problem', which is not one of its text fields (text); heldout_by names text fields only"),
    ({"kind": "hub", "dataset": "o/d", "text": ["problem", "solution"], "heldout_by": "answer"},
     "heldout_by names 'answer', which is not one of its text fields (problem, solution); heldout_by names "
     "text fields only"),
    ({"kind": "local", "format": "json", "heldout_by": []}, "heldout_by [] must name one field or more, none empty"),
    ({"kind": "local", "format": "json", "heldout_by": [""]}, "heldout_by [''] must name one field or more, none "
                                                             "empty"),
    ({"kind": "local", "format": "json", "heldout_by": ["text", "text"]},
     "heldout_by names 'text' twice; name each field once"),
    ({"kind": "local", "format": "json", "heldout_by": 3}, "heldout_by must be a string or a list of strings, not 3"),
])
def test_a_bad_heldout_by_is_one_line(source, message):
    with pytest.raises(FibctlError, match=f"^source 'notes': {re.escape(message)}$"):
        parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
            {"name": "notes", "share": 1, "files": ["rows.jsonl"], **source}
            if source["kind"] == "local" else {"name": "notes", "share": 1, **source}]})


def test_a_documents_key_is_its_heldout_by_text(tmp_path):
    """Its whole text without heldout_by, or when its heldout_by fields are all empty."""
    (tmp_path / "rows.jsonl").write_text('{"problem": " 1 + 1? ", "hint": "count", "solution": "2"}\n'
                                         '{"problem": "", "solution": "3"}\n')
    text = ["problem", "hint", "solution"]
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json", text=text, heldout_by=["hint", "problem"])
    docs = _docs(recipe, source, tmp_path)
    assert docs == ["1 + 1?\n\ncount\n\n2", "3"]
    assert [d.key for d in docs] == ["count\n\n1 + 1?", "3"]
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json", text=text)
    assert [d.key for d in _docs(recipe, source, tmp_path)] == docs


def test_parquet_shards_may_differ_in_other_columns(tmp_path):
    pq.write_table(pa.table({"text": ["first"], "id": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"url": ["u"], "text": pa.array(["second"], pa.large_string())}), tmp_path / "b.parquet")
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet")
    assert _docs(recipe, source, tmp_path) == ["first", "second"]
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet", text=["url"])
    with pytest.raises(FibctlError, match=r"a\.parquet has no column url; columns: text, id"):
        _docs(recipe, source, tmp_path)


def test_a_folder_named_in_files_says_so(tmp_path):
    notes = _notes(tmp_path)
    recipe, source = _local(str(notes))
    with pytest.raises(FibctlError, match=rf"source 'notes': {notes} is a folder; name its files, e.g. "
                                          rf"\"{notes}/\*\""):
        recipe.local_files(source)


def test_a_folder_of_folders_or_a_glob_missing_its_subfolders_names_the_glob_that_reaches_them(tmp_path):
    """A corpus in nested folders: naming the folder suggested `corpus/*`, which matches only
    its folders (refused in turn), and `corpus/*.txt` matched nothing without a word of `**`."""
    (tmp_path / "corpus" / "a" / "b").mkdir(parents=True)
    (tmp_path / "corpus" / "a" / "b" / "1.txt").write_text("deep\n")
    corpus = tmp_path / "corpus"
    for files, words in ((corpus, rf"{corpus} is a folder; name its files, e.g. \"{corpus}/\*\*\"$"),
                         (corpus / "*.txt", rf"no files match {corpus}/\*\.txt; files in its subfolders match "
                                            rf"\"{corpus}/\*\*/\*\.txt\"$"),
                         (corpus / "*.md", rf"no files match {corpus}/\*\.md$")):
        recipe, source = _local(str(files))
        with pytest.raises(FibctlError, match=rf"^source 'notes': {words}"):
            recipe.local_files(source)
    recipe, source = _local(str(corpus / "**" / "*.txt"))
    assert _docs(recipe, source, tmp_path) == ["deep"]


def test_a_zstd_file_reads_or_names_the_package_it_needs(tmp_path):
    data = b'{"text": "first"}\n'  # one zstd frame holding one raw block, written without a library
    frame = b"\x28\xb5\x2f\xfd" + bytes([0x20, len(data)]) + ((len(data) << 3) | 1).to_bytes(3, "little") + data
    (tmp_path / "rows.jsonl.zst").write_bytes(frame)
    recipe, source = _local(str(tmp_path / "rows.jsonl.zst"), "json")
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(FibctlError, match=r"rows\.jsonl\.zst is zstd-compressed: reading it needs the zstandard"):
            _docs(recipe, source, tmp_path)
    else:
        assert _docs(recipe, source, tmp_path) == ["first"]


@pytest.mark.parametrize("compress", ["gzip", "bz2", "lzma"])
@pytest.mark.parametrize("name", ["rows.jsonl.GZ", "rows.jsonl.gzip", "rows.tgz", "rows.jsonl", "rows.xz"])
def test_a_compressed_file_is_read_by_its_first_bytes_whatever_its_name(tmp_path, compress, name):
    """A gzip file not named .gz was read as text, and refused as "not UTF-8 ... iconv"; one
    named .xz holding gzip failed in lzma."""
    import importlib

    (tmp_path / name).write_bytes(importlib.import_module(compress).compress(b'{"text": "first"}\n'))
    recipe, source = _local(str(tmp_path / name), "json")
    assert _docs(recipe, source, tmp_path) == ["first"]
    (tmp_path / "BZh91AY.txt").write_text("BZh91AY is text that begins like bzip2\n")  # no block magic after it
    recipe, source = _local(str(tmp_path / "BZh91AY.txt"))
    assert _docs(recipe, source, tmp_path) == ["BZh91AY is text that begins like bzip2"]


@pytest.mark.parametrize("name, mode, packed", [("notes.tar", "w", ""), ("notes.tar.gz", "w:gz", " (gzip-compressed)"),
                                               ("notes.tgz", "w:gz", " (gzip-compressed)"),
                                               ("notes.tar.xz", "w:xz", " (xz-compressed)"), ("notes.zip", "zip", "")])
def test_an_archive_is_refused_naming_it(tmp_path, name, mode, packed):
    """A .tar.gz given to a text source was decompressed and trained on: its tar headers (file
    names, owners, NUL padding) as text."""
    import tarfile
    import zipfile

    notes = _notes(tmp_path, 1)
    if mode == "zip":
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.write(notes / "0.txt", "0.txt")
    else:
        with tarfile.open(tmp_path / name, mode) as t:
            t.add(notes / "0.txt", "0.txt")
    recipe, source = _local(str(tmp_path / name))
    kind = "zip" if mode == "zip" else "tar"
    with pytest.raises(FibctlError, match=rf"^source 'notes': .*{re.escape(name)} is a {kind} archive"
                                          rf"{re.escape(packed)}, not text: unpack it and list its files$"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("column, held", [
    (pa.array([0.5, 1.5]), "float"),
    (pa.array([1, 2]), "int"),
    (pa.array([True, False]), "bool"),
    (pa.array([0, 1], pa.timestamp("s")), "datetime"),
    (pa.array([["a", "b"], ["c"]]), "list"),
])
def test_a_later_parquet_file_whose_text_is_not_text_is_named(tmp_path, column, held):
    """The datasets builder types the columns by the first file and cast a later file's numbers
    to text (`0.5` trained on as a document), or failed on a list with a raw TypeError."""
    pq.write_table(pa.table({"text": ["first doc", "second doc"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": column}), tmp_path / "b.parquet")
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet")
    with pytest.raises(FibctlError, match=rf"source 'notes': field 'text' holds {held} values, not text, in "
                                          rf"{tmp_path}/b\.parquet; text = \[\.\.\.\] must name string fields$"):
        _docs(recipe, source, tmp_path)


def test_a_later_parquet_files_nested_field_is_checked(tmp_path):
    pq.write_table(pa.table({"meta": [{"title": "first", "n": "1"}]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"meta": [{"title": "second", "n": 2}]}), tmp_path / "b.parquet")
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet", text=["meta.title"])
    assert _docs(recipe, source, tmp_path) == ["first", "second"]
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet", text=["meta.n"])
    with pytest.raises(FibctlError, match=r"field 'meta\.n' holds int values, not text, in .*b\.parquet"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("column", [
    pa.array(["dict doc", "dict doc"]).dictionary_encode(),
    pa.array([b"bytes doc"], pa.binary()),
    pa.array(["large doc"], pa.large_string()),
    pa.array([None], pa.null()),
])
def test_parquet_files_may_hold_text_in_any_text_type(tmp_path, column):
    """Strings, bytes, categoricals and nulls are text, in any file; a first file of nulls
    alone types the column null, which the builder could not cast the next file's text to."""
    pq.write_table(pa.table({"text": column}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["plain doc"]}), tmp_path / "b.parquet")
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet")
    expected = [str(v.as_py() if not isinstance(v.as_py(), bytes) else v.as_py().decode()) for v in column
                if v.as_py() is not None]
    assert _docs(recipe, source, tmp_path) == [*expected, "plain doc"]
    (tmp_path / "a.parquet").rename(tmp_path / "c.parquet")  # as the later file
    assert _docs(recipe, source, tmp_path) == ["plain doc", *expected]


def test_each_glob_must_match_a_file(tmp_path):
    """A typo beside a glob that matched was ignored: its files left out without a word."""
    notes = _notes(tmp_path)
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "notes", "kind": "local", "format": "text", "share": 1,
         "files": [str(notes / "0.txt"), str(notes / "nots*.txt")]}]})
    with pytest.raises(FibctlError, match=rf"^source 'notes': no files match {notes}/nots\*\.txt$"):
        recipe.local_files(recipe.sources[0])
    (notes / "sub").mkdir()
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "notes", "kind": "local", "format": "text", "share": 1,
         "files": [str(notes / "*.txt"), str(notes / "sub")]}]})
    with pytest.raises(FibctlError, match=rf"source 'notes': {notes}/sub is a folder; name its files"):
        recipe.local_files(recipe.sources[0])


def test_a_file_name_with_a_line_break_is_shown_on_one_line(tmp_path):
    (tmp_path / "new\nline.jsonl").write_text("not json\n")
    recipe, source = _local(str(tmp_path / "new*.jsonl"), "json")
    with pytest.raises(FibctlError) as e:
        _docs(recipe, source, tmp_path)
    assert "\n" not in str(e.value) and r"new\nline.jsonl: line 1 is not JSON" in str(e.value)
    recipe, source = _local(str(tmp_path / "gone\x1b[2J*.jsonl"), "json")
    with pytest.raises(FibctlError, match=r"no files match .*gone\\x1b\[2J\*\.jsonl$"):
        recipe.local_files(source)
    (tmp_path / "new\nline.jsonl").unlink()
    (tmp_path / "tab\tname.parquet").write_text("not parquet")
    recipe, source = _local(str(tmp_path / "tab*.parquet"), "parquet")
    with pytest.raises(FibctlError, match=r"cannot read parquet file .*tab\\tname\.parquet: "):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("source, message", [
    ({"kind": "local", "format": "json", "dataset": "o/d"}, "dataset applies to kind \"hub\" only, not 'local'"),
    ({"kind": "local", "format": "json", "revision": "main"}, "revision applies to kind \"hub\" only, not 'local'"),
    ({"kind": "local", "format": "json", "configs": ["a"]}, "configs applies to kind \"hub\" only"),
    ({"kind": "local", "format": "json", "seed": 3}, "seed applies to kind \"generated\" only, not 'local'"),
    ({"kind": "local", "format": "json", "packages": ["stdlib"]}, "packages applies to kind \"installed-docs\" only"),
    ({"kind": "local", "format": "json", "sample_by": "line"}, "sample_by applies to format \"text\" only, not 'json'"),
    ({"kind": "local", "format": "csv", "sample_by": "document"}, "sample_by applies to format \"text\" only"),
    ({"kind": "local", "format": "json", "delimiter": ","}, "delimiter applies to format \"csv\" only, not 'json'"),
    ({"kind": "hub", "dataset": "o/d", "files": ["x"]}, "files applies to kind \"local\" only, not 'hub'"),
    ({"kind": "hub", "dataset": "o/d", "format": "json"}, "format applies to kind \"local\" only, not 'hub'"),
    ({"kind": "installed-docs", "sample_by": "line"}, "sample_by applies to kind \"local\" only, not 'installed-docs'"),
    ({"kind": "installed-docs", "text": ["body"]}, "text applies to kind \"hub\" or \"local\" only"),
    ({"kind": "generated", "dataset": "o/d"}, "dataset applies to kind \"hub\" only, not 'generated'"),
    ({"kind": "generated", "heldout_fraction": 0.1}, "heldout_fraction applies to a source with a held-out set "
                                                     "only; set heldout = \"NAME\" too"),
    ({"kind": "local", "format": "json", "text": ["text", "text"]}, "text names 'text' twice; name each field once"),
])
def test_a_key_that_does_not_apply_is_refused(tmp_path, source, message):
    """Such keys were accepted and ignored: the source read otherwise than the recipe says."""
    (tmp_path / "rows.jsonl").write_text('{"text": "first"}\n')
    with pytest.raises(FibctlError, match=f"^source 'notes': {re.escape(message)}"):
        parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
            {"name": "notes", "share": 1, "files": [str(tmp_path / "rows.jsonl")], **source}
            if source["kind"] == "local" else {"name": "notes", "share": 1, **source}]})


def test_the_keys_that_apply_are_accepted(tmp_path):
    for source in ({"kind": "local", "format": "text", "files": ["x.txt"], "sample_by": "line"},
                   {"kind": "local", "format": "csv", "files": ["x.csv"], "delimiter": ";", "text": ["body"]},
                   {"kind": "hub", "dataset": "o/d", "configs": ["c"], "split": "test", "revision": "main"},
                   {"kind": "hub", "dataset": "o/d", "text": ["problem", "solution"], "heldout_by": "problem"},
                   {"kind": "local", "format": "json", "files": ["x.jsonl"], "heldout_by": ["text"], "heldout": "v"},
                   {"kind": "installed-docs", "packages": ["stdlib"], "heldout": "v", "heldout_fraction": 0.1},
                   {"kind": "generated", "seed": 1, "documents": 10}):
        parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [{"name": "s", "share": 1, **source}]})


@pytest.mark.parametrize("key, value", [("name", 3), ("description", [1]), ("name", True)])
def test_a_recipe_name_or_description_that_is_not_a_string_is_refused(key, value):
    """They were str()-converted: a recipe named '3' or described as '[1]'."""
    with pytest.raises(FibctlError, match=rf"^recipe: {key}={re.escape(repr(value))} must be a string$"):
        parse_recipe({key: value, "vocab_size": 512, "train_tokens": 1000,
                      "sources": [{"name": "g", "kind": "generated", "share": 1}]})


@pytest.mark.parametrize("name", ["HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"])
@pytest.mark.parametrize("value", ["abc", "-1", "0", "2.5", ""])
def test_a_bad_hf_hub_timeout_is_one_line_naming_it(name, value, monkeypatch):
    """'abc' or '' (set, empty) was huggingface_hub's ValueError traceback as it was imported;
    -1 was taken and said as 'waited at most -1 s'."""
    from fibctl.data.sources import check_hub
    from fibctl.errors import FibctlError

    monkeypatch.setenv(name, value)
    with pytest.raises(FibctlError, match=rf"^{name}='{re.escape(value)}' must be a positive whole"):
        check_hub("some/dataset")


@pytest.mark.parametrize("content, line", [
    ("id,text,lang\n0,first row,en,\n", 2),               # a trailing delimiter: every column moved
    ("id,text\n1,Hello, world.\n2,second\n", 2),           # an unquoted comma in a cell
    ("id,title,text\n1,T,body\n\n5,only two\n", 4),        # a cell lost (the blank line is skipped)
])
def test_a_csv_row_of_other_cells_than_its_header_is_refused_naming_its_line(tmp_path, content, line):
    """pandas read a row of more cells than the header with its first cells as an index:
    every column shifted, `lang` trained on as the text; a row of fewer cells moved its text to
    another column. Either is refused, naming the file and the row's line."""
    (tmp_path / "rows.csv").write_text(content)
    recipe, source = _local(str(tmp_path / "rows.csv"), "csv", text=["text"])
    with pytest.raises(FibctlError, match=rf"source 'notes': .*rows.csv: line {line} has \d cells, the header"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("content, line, error", [
    ('id,text\n1,"a cell left open\n2,swallowed\n3,to the end\n', 2, "unexpected end of data, reading line 4"),
    ('id,text\n1,first\n2,"x" y\n', 3, "',' expected after '\"', reading line 3"),  # read as `x y`
    ('id,text\n1,"open\n2,and\n3,"closed" late\n', 2, "',' expected after '\"', reading line 4"),
    ('"id,text\n1,x\n', 1, "unexpected end of data, reading line 2"),
])
def test_a_csv_row_whose_quoting_is_broken_is_refused_naming_its_line(tmp_path, content, line, error):
    """A quoted cell left open swallowed the rest of the file into one document (the count of
    cells could not see it), and `2,"x" y` was read as `x y`."""
    (tmp_path / "rows.csv").write_text(content)
    recipe, source = _local(str(tmp_path / "rows.csv"), "csv", text=["text"])
    with pytest.raises(FibctlError, match=rf"^source 'notes': .*rows\.csv: line {line}: its quoting is broken "
                                          rf"\({re.escape(error)}\); a cell holding ',', a quote mark or a line break "
                                          rf"is quoted whole, its own quote marks doubled$"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "rows.csv").write_text('id,text\n1,"two\nlines, ""quoted"""\n2,a "mark" inside\n')
    assert _docs(recipe, source, tmp_path) == ['two\nlines, "quoted"', 'a "mark" inside']


def test_a_csv_file_without_the_text_column_is_refused_naming_it(tmp_path):
    """A shard whose header lacks the column was skipped in silence; now as a parquet one."""
    (tmp_path / "a.csv").write_text("id,text\n1,kept\n")
    (tmp_path / "b.csv").write_text("id,body\n1,lost\n")
    recipe, source = _local(str(tmp_path / "*.csv"), "csv")
    with pytest.raises(FibctlError, match=r"source 'notes': .*b\.csv has no column text; columns: id, body"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "b.csv").write_text("text,id,text\nx,1,y\n")
    with pytest.raises(FibctlError, match=r"b\.csv: its header names column text more than once"):
        _docs(recipe, source, tmp_path)


def test_csv_cells_longer_than_the_csv_modules_cap_and_files_without_a_header(tmp_path):
    """A document of 200,000 characters is one cell; a file of whitespace, of a byte-order mark
    alone or empty once decompressed holds no rows (it failed the source with EmptyDataError)."""
    import gzip

    long = "word " * 40_000
    (tmp_path / "a.csv").write_text(f'text\n"{long}"\nshort\n')
    (tmp_path / "b.csv").write_text("  \n\n")
    (tmp_path / "c.csv").write_bytes(b"\xef\xbb\xbf")
    (tmp_path / "d.csv.gz").write_bytes(gzip.compress(b""))
    recipe, source = _local(str(tmp_path / "*.csv*"), "csv")
    assert _docs(recipe, source, tmp_path) == [long.strip(), "short"]


@pytest.mark.parametrize("fmt", ["text", "csv", "parquet"])
def test_a_file_named_with_glob_characters_is_read_as_itself(tmp_path, fmt):
    """The datasets builders took each matched path for a glob again: `part[1].txt` read
    `part1.txt` in its place (twice over), `a*b.txt` also read `axxb.txt`, and `a::b.txt` was
    not found."""
    names = ["part[1]", "part1", "a*b", "axxb", "a::b"]
    for name in names:
        path = tmp_path / f"{name}.{'txt' if fmt == 'text' else fmt}"
        if fmt == "parquet":
            pq.write_table(pa.table({"text": [name]}), path)
        elif fmt == "csv":
            path.write_text(f"text\n{name}\n")
        else:
            path.write_text(name)
    recipe, source = _local(str(tmp_path / "*"), fmt)
    assert sorted(_docs(recipe, source, tmp_path)) == sorted(names)


def test_parquet_shards_may_differ_inside_a_struct_beside_the_field_read(tmp_path):
    """Shards whose `meta` gained a field (or held one of another type) beside the `meta.title`
    read failed the source: the builder cast every file to the first one's struct."""
    pq.write_table(pa.Table.from_pylist([{"meta": {"title": "one"}}]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist([{"meta": {"title": "two", "url": "u", "n": 1}}]), tmp_path / "b.parquet")
    pq.write_table(pa.Table.from_pylist([{"meta": {"title": "three", "url": 7}}]), tmp_path / "c.parquet")
    recipe, source = _local(str(tmp_path / "*.parquet"), "parquet", text=["meta.title"])
    assert _docs(recipe, source, tmp_path) == ["one", "two", "three"]


def test_paragraphs_end_at_a_line_of_whitespace_too(tmp_path):
    """A line holding a space or a tab between paragraphs did not part them: a whole file was
    one document. A blank line is one with nothing but whitespace; line breaks are universal."""
    (tmp_path / "a.txt").write_text("first\nstill first\n \nsecond\r\n\t\r\n\r\nthird\rthird's end\n\n")
    recipe, source = _local(str(tmp_path / "a.txt"), "text", sample_by="paragraph")
    assert _docs(recipe, source, tmp_path) == ["first\nstill first", "second", "third\nthird's end"]
    recipe, source = _local(str(tmp_path / "a.txt"), "text", sample_by="line")
    assert _docs(recipe, source, tmp_path) == ["first", "still first", "second", "third", "third's end"]


def test_a_utf16_file_is_named_as_utf16(tmp_path):
    """The hint was `iconv -f latin1`, which turns UTF-16 into valid-looking nonsense."""
    (tmp_path / "a.txt").write_bytes("some text\n".encode("utf-16"))
    recipe, source = _local(str(tmp_path / "a.txt"), "text")
    with pytest.raises(FibctlError, match=r"a\.txt is UTF-16 text, not UTF-8; .*iconv -f utf-16 -t utf-8"):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("encoding, order", [("utf-16-le", "le"), ("utf-16-be", "be")])
def test_utf16_without_a_byte_order_mark_is_named_as_utf16(tmp_path, encoding, order):
    """ASCII in UTF-16 without a byte-order mark is valid UTF-8, a NUL beside each letter: it
    was read, and trained on, as such."""
    (tmp_path / "a.txt").write_bytes("some text\nmore text\n".encode(encoding))
    recipe, source = _local(str(tmp_path / "a.txt"), "text")
    with pytest.raises(FibctlError, match=rf"^source 'notes': .*a\.txt looks like UTF-16 text without a byte-order "
                                          rf"mark .*iconv -f utf-16{order} -t utf-8\)$"):
        _docs(recipe, source, tmp_path)


def test_binary_data_is_refused_and_a_nul_in_a_text_is_read(tmp_path):
    """Bytes of many NULs (numbers written as binary) are valid UTF-8: they were trained on."""
    (tmp_path / "a.txt").write_bytes(b"".join(i.to_bytes(4, "little") for i in range(1, 100)))
    recipe, source = _local(str(tmp_path / "a.txt"), "text")
    with pytest.raises(FibctlError, match=r"a\.txt looks like binary data, not text: 297 of its first 396 bytes "
                                          r"are NUL$"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "a.txt").write_bytes(b"before\0after, a NUL in a text\n")
    assert _docs(recipe, source, tmp_path) == ["before\0after, a NUL in a text"]


def test_an_image_is_refused_as_binary_and_text_in_another_encoding_is_not(tmp_path):
    """A PNG (compressed pixels: few NULs) was taken for UTF-8 text with a bad byte: 'fix that
    line'. Binary data is not UTF-8 and full of control bytes; text in a legacy encoding has
    none, and is still pointed at iconv."""
    import random
    import zlib

    pixels = zlib.compress(random.Random(0).randbytes(12_000))
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + pixels)
    recipe, source = _local(str(tmp_path / "a.png"), "text")
    with pytest.raises(FibctlError, match=r"a\.png looks like binary data, not text: it is not UTF-8, and "
                                          r"[\d,]+ of its first 8,192 bytes are control bytes$"):
        _docs(recipe, source, tmp_path)
    (tmp_path / "a.txt").write_bytes("Привет, мир: текст в другой кодировке.\n".encode("cp1251") * 50)
    recipe, source = _local(str(tmp_path / "a.txt"), "text")
    with pytest.raises(FibctlError, match=r"a\.txt is not UTF-8 text: line 1 .*iconv -f latin1"):
        _docs(recipe, source, tmp_path)


def test_a_hard_link_is_the_same_input_as_its_file(tmp_path):
    """Two sources reading one file through a hard link each were taken for other inputs: one
    held its lines out, the other trained on them inside its whole-file document."""
    from fibctl.data.prepare import _check_documents_alike

    (tmp_path / "f.txt").write_text("a line\nanother\n")
    os.link(tmp_path / "f.txt", tmp_path / "hard.txt")
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "a", "kind": "local", "format": "text", "files": [str(tmp_path / "f.txt")], "share": 0.5,
         "sample_by": "line", "heldout": "a_val"},
        {"name": "b", "kind": "local", "format": "text", "files": [str(tmp_path / "hard.txt")], "share": 0.5}]})
    with pytest.raises(FibctlError, match="sources 'a' and 'b' read the same inputs"):
        _check_documents_alike(recipe)
    recipe, source = _local(str(tmp_path / "*.txt"), "text")
    assert _docs(recipe, source, tmp_path) == ["a line\nanother"]


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"},\n{"text": "b"},\n', r"line 1 is not JSON \(text after a whole record, at column 14"),
    ('{\n  "text": "a"\n}\n{\n  "text": "b"\n}\n', r"line 4 is not JSON \(text after a whole record.*jq -c"),
    ('{"text": "cut\n{"text": "b"}\n', r"line 1 is not JSON \(Invalid control character at column 14\)$"),
    ('  {"text": "a" "b"}\n', r"line 1 is not JSON \(Expecting ',' delimiter at column 16\)$"),
])
def test_a_broken_first_json_line_is_named_by_its_line(tmp_path, content, message):
    """A JSON Lines file whose first line is broken was read as one object over lines, and
    refused as "the file is not JSON" with no line to look at."""
    (tmp_path / "rows.jsonl").write_text(content)
    recipe, source = _local(str(tmp_path / "rows.jsonl"), "json")
    with pytest.raises(FibctlError, match=r"rows\.jsonl: " + message):
        _docs(recipe, source, tmp_path)


@pytest.mark.parametrize("content, rest, message", [
    ('{"text": "cut\n', '{"text": "b"}\n', "line 1 is not JSON (Invalid control character at column 14)"),
    ('{"text": "a"\n', '{"text": "b"}\n', "line 2 is not JSON (Expecting ',' delimiter at column 1)"),
    ('{\n  "text": "a"\n}\n', '{\n  "text": "b"\n}\n', "line 4 is not JSON (text after a whole record, at column 1; "),
    ('[{"text": "a"},\n {"text": tru},\n', '{"text": "b"},\n',
     "item 1 is not JSON (Expecting value at line 2, column 11)"),
])
def test_a_json_error_is_found_before_the_file_is_read_whole(tmp_path, monkeypatch, content, rest, message):
    """A JSON Lines file whose first line was broken, or one of records spread over lines, was
    read whole before its error was found (a file of several GB filled memory), as was a file
    of one array with an early item broken; the error's message was cut ("Invalid control
    character at")."""
    import tracemalloc

    from fibctl.data import json_files

    monkeypatch.setattr(json_files, "ARRAY_CHUNK", 4096)
    (tmp_path / "rows.json").write_text(content + rest * 200_000)  # 3 MB or more
    recipe, source = _local(str(tmp_path / "rows.json"), "json")
    tracemalloc.start()
    try:
        with pytest.raises(FibctlError, match=re.escape(f"rows.json: {message}")):
            _docs(recipe, source, tmp_path)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_a_sources_files_are_read_in_sorted_order_across_its_globs(tmp_path):
    """docs/data.md: the order decides which files a full share leaves out."""
    for name in ("b/2.txt", "a/9.txt", "b/1.txt", "a/10.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    recipe = parse_recipe({"vocab_size": 512, "train_tokens": 1000, "sources": [
        {"name": "notes", "kind": "local", "format": "text", "files": [str(tmp_path / "b/*.txt"),
                                                                       str(tmp_path / "a/*.txt")], "share": 1}]})
    assert _docs(recipe, recipe.sources[0], tmp_path) == ["a/10.txt", "a/9.txt", "b/1.txt", "b/2.txt"]


SQUAD = {"version": "1.1", "data": [
    {"title": "Rivers", "paragraphs": [{"context": "The river bends.", "qas": [{"question": "What bends?"}]},
                                       {"context": "Stones lie in it."}]},
    {"title": "Lanterns", "paragraphs": [{"context": "A lantern glows.", "qas": []}]}]}


@pytest.mark.parametrize("indent", [None, 2])
def test_records_reads_the_array_inside_each_files_object(tmp_path, indent):
    """A dump of one object holding its records in an array ({"version": ..., "data": [...]},
    as SQuAD's) was read as one record: `records` names the array, and its items are the
    records, in each file; a path may go through arrays (an index, or `*` for every item)."""
    (tmp_path / "a.json").write_text(json.dumps(SQUAD, indent=indent))
    (tmp_path / "b.json").write_text(json.dumps({"data": [{"title": "Third", "paragraphs": []}]}, indent=indent))
    recipe, source = _local(str(tmp_path / "*.json"), "json", records="data", text=["title"])
    assert _docs(recipe, source, tmp_path) == ["Rivers", "Lanterns", "Third"]
    recipe, source = _local(str(tmp_path / "a.json"), "json", records="data.*.paragraphs", text=["context"])
    assert _docs(recipe, source, tmp_path) == ["The river bends.", "Stones lie in it.", "A lantern glows."]
    recipe, source = _local(str(tmp_path / "a.json"), "json", records="data.1.paragraphs", text=["context"])
    assert _docs(recipe, source, tmp_path) == ["A lantern glows."]
    recipe, source = _local(str(tmp_path / "a.json"), "json", records="data", text=["title", "version"])
    with pytest.raises(FibctlError, match="no row has field version; fields: title, paragraphs"):
        _docs(recipe, source, tmp_path)  # the object's other keys are not fields of its records


def test_records_in_a_file_of_one_line_are_read_one_at_a_time(tmp_path, monkeypatch):
    """A dump is often one line: read as JSON Lines, that line was held whole (with its parsed
    records), however large; with `records` it is parsed from chunks, one record at a time."""
    import tracemalloc

    from fibctl.data import json_files

    monkeypatch.setattr(json_files, "ARRAY_CHUNK", 4096)
    data = [{"text": f"record {i} " + "x" * 100} for i in range(30_000)]  # 3.5 MB
    (tmp_path / "dump.json").write_text(json.dumps({"version": "1", "meta": {"n": [1, 2]}, "data": data}))
    recipe, source = _local(str(tmp_path / "dump.json"), "json", records="data")
    tracemalloc.start()
    try:
        assert sum(1 for _ in sources.documents(recipe, source, tmp_path)) == 30_000
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("content, records, message", [
    ('{"version": "1.1", "articles": []}', "data",
     "the file has no key 'data' (its keys: version, articles); records names the array"),
    ('{"version": "1.1", "data": {"a": {}}}', "data", "data is an object, not an array of records"),
    ('{"data": "text"}', "data", "data is a string, not an array of records"),
    (json.dumps({f"k{i}": i for i in range(10)}), "data",
     "the file has no key 'data' (its keys: k0, k1, k2, k3, k4, k5, k6, k7, ...)"),
    ('[{"data": []}]', "data", "the file is an array, not an object with key 'data'"),
    ('{"data": [[]]}', "data.0.x", "data.0 is an array, not an object with key 'x'"),
    ('{"data": [[]]}', "data.1", "data has 1 items, no item 1"),
    ('{"data": [{"text": "a"}, 2]}', "data", "item 1 of data is a number, not a JSON object of fields"),
    ('{"data": [{"text": "a"}, {"text": tru}]}', "data",
     "item 1 of data is not JSON (Expecting value at line 1, column 35)"),
    ('{"data": [{"text": "a"}}', "data", "after item 0 of data, '}' is not JSON (expecting ',' or ']')"),
    ('{"data" [{"text": "a"}]}', "data", "line 1 is not JSON (Expecting ':' delimiter at column 9)"),
    ('{"v": 1 "data": []}', "data", "line 1 is not JSON (Expecting ',' delimiter at column 9)"),
    ('{"data": []', "data", "the file is not JSON (it ends inside an object: '}' is missing)"),
    ('{"data": [{"text": "a"}], "data": []}', "data", "the file has key 'data' twice"),
    ('{"data": []}\n{"data": []}\n', "data", "line 2 is not JSON (text after the file's one value, at column 1; "
                                           "with records set, a file holds one object)"),
])
def test_records_not_found_names_the_file_and_what_is_there(tmp_path, monkeypatch, content, records, message):
    from fibctl.data import json_files

    (tmp_path / "d.json").write_text(content)
    recipe, source = _local(str(tmp_path / "d.json"), "json", records=records)
    for chunk in (1, 3, 1 << 20):  # wherever the chunks end
        monkeypatch.setattr(json_files, "ARRAY_CHUNK", chunk)
        with pytest.raises(FibctlError, match=f"^source 'notes': .*d\\.json: {re.escape(message)}"):
            _docs(recipe, source, tmp_path)


def test_records_missing_from_a_file_is_one_line_exit_2(tmp_path):
    (tmp_path / "d.json").write_text('{"version": "1.1", "rows": []}')
    (tmp_path / "r.toml").write_text(RECIPE.replace('format = "text"\nfiles = ["notes/*.txt"]',
                                                    'format = "json"\nfiles = ["d.json"]\nrecords = "data"\nheldout = "v"'))
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "r.toml", "--data", "out", "--plain"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "d.json: the file has no key 'data' (its keys: version, rows)" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    ({"records": "data..rows"}, "records 'data..rows' must be a dotted path of names, none empty"),
    ({"records": ""}, "records '' must be a dotted path of names, none empty"),
    ({"records": ["data"]}, "records=\\['data'\\] must be a string"),
    ({"records": "data", "format": "csv"}, "records applies to format \"json\" only, not 'csv'"),
])
def test_a_bad_records_is_named(tmp_path, extra, message):
    with pytest.raises(FibctlError, match=f"source 'notes': {message}"):
        _local(str(tmp_path / "d.json"), **{"fmt": "json", **extra})


def test_records_left_out_leaves_recipes_hashes_as_they_were():
    # a changed hash would rebuild every data folder, and checkpoints record the data they trained on
    assert _local("/data/x.json", "json")[0].recipe_hash == "ccc99c195b148fc9"  # as before records was a key
    assert _local("/data/x.json", "json", records="data")[0].recipe_hash != "ccc99c195b148fc9"


def test_a_dotted_field_reads_inside_arrays(tmp_path):
    """`c.0.body` was refused as a field no row has: an index reaches an array's item, and `*`
    every item's, their texts joined as a document's fields are, in JSON records and parquet
    list columns alike; an array too short, or items all without it, is a null field."""
    rows = [{"t": "A", "c": [{"body": "a0"}, {"body": "a1"}, {"other": 1}]}, {"t": "B", "c": [{"body": "b0"}]},
            {"t": "C", "c": []}, {"t": "D", "c": None}, {"t": "E", "c": [{"body": None}, {"body": " e1 "}]}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    for name, fmt in (("a.jsonl", "json"), ("a.parquet", "parquet")):
        recipe, source = _local(str(tmp_path / name), fmt, text=["t", "c.0.body"])
        assert _docs(recipe, source, tmp_path) == ["A\n\na0", "B\n\nb0", "C", "D", "E"], fmt
        recipe, source = _local(str(tmp_path / name), fmt, text=["c.1.body"])
        assert _docs(recipe, source, tmp_path) == ["a1", "e1"], fmt
        recipe, source = _local(str(tmp_path / name), fmt, text=["t", "c.*.body"])
        assert _docs(recipe, source, tmp_path) == ["A\n\na0\n\na1", "B\n\nb0", "C", "D", "E\n\ne1"], fmt
        recipe, source = _local(str(tmp_path / name), fmt, text=["c.*.bdy"])
        with pytest.raises(FibctlError, match=r"no row has field c\.\*\.bdy"):
            _docs(recipe, source, tmp_path)
    (tmp_path / "n.jsonl").write_text('{"t": [["x", "y"], ["z"]], "n": [{"k": 1}]}\n')
    recipe, source = _local(str(tmp_path / "n.jsonl"), "json", text=["t.*.*"])
    assert _docs(recipe, source, tmp_path) == ["x\n\ny\n\nz"]
    recipe, source = _local(str(tmp_path / "n.jsonl"), "json", text=["n.*.k"])
    with pytest.raises(FibctlError, match=r"field 'n\.\*\.k' holds int values, not text, in .*n\.jsonl, line 1"):
        _docs(recipe, source, tmp_path)
    recipe, source = _local(str(tmp_path / "a.jsonl"), "json", text=["c"])
    with pytest.raises(FibctlError, match=r"field 'c' holds list values, not text, in .*a\.jsonl, line 1; text = "
                                          r"\[\.\.\.\] must name string fields \(or an item's: c\.0\.body, or every "
                                          r"item's: c\.\*\.body\)"):
        _docs(recipe, source, tmp_path)
    recipe, source = _local(str(tmp_path / "a.parquet"), "parquet", text=["c.0.other"])
    with pytest.raises(FibctlError, match=r"field 'c\.0\.other' holds int values, not text, in .*a\.parquet; text"):
        _docs(recipe, source, tmp_path)  # checked from the footer, through the list column's item type
