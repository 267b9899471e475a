"""Text fibctl did not write (names, paths, errors, a database's values) is shown, never obeyed:
one function, `fibctl.errors.printable`, escapes one decided set of characters, and every
place that prints such text goes through it. Three escapers had three sets: the reports'
kept U+2028 (a line break to some terminals), paths' let a bidi override through, and a
matrix description's refused neither."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pandas as pd
import pytest

from fibctl.errors import printable, shown_path

PACKAGE = Path(__file__).resolve().parent.parent / "fibctl"
# the decided set (fibctl/errors.py says why): C0, DEL, C1, the line and paragraph
# separators, the bidi embedding, override and isolate controls, lone surrogates
ESCAPED = {*range(0x00, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A),
           *range(0xD800, 0xE000)}
# one of each kind, the line break among them
SAMPLE = [chr(c) for c in (0x00, 0x07, 0x09, 0x0A, 0x0D, 0x1B, 0x7F, 0x85, 0x9B, 0x2028, 0x2029, 0x202A, 0x202E,
                           0x2066, 0x2069, 0xDCFF)]


def escaped(ch: str) -> str:
    return ascii(ch)[1:-1]


def test_printable_escapes_the_decided_set_and_nothing_else():
    every = "".join(map(chr, range(0x110000)))
    assert printable(every) == "".join(escaped(chr(c)) if c in ESCAPED else chr(c) for c in range(0x110000))
    # `lines`: line breaks kept, and only they
    assert printable("a\nb\u202e\rc\n", lines=True) == "a\nb\\u202e\\rc\n"


def test_no_module_keeps_a_set_of_its_own():
    """Each escaper had its own character class; one more would drift from the set again.
    No string in fibctl's source but errors.py's names a C0 or C1 control, DEL or a bidi or
    separator character, as the character or as its escape in a raw string."""
    marks = ("\x1f", "\x7f", "\x9f", "\u2028", "\u202a", "\u2066", r"\x1f", r"\x7f", r"\x9f", r"\u2028", r"\u202a",
             r"\u2066")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(m in node.value for m in marks):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found


@pytest.mark.parametrize("ch", SAMPLE, ids=escaped)
def test_a_path_in_a_message_is_printable(ch):
    assert shown_path(Path(f"runs/a{ch}b.db")) == f"runs/a{escaped(ch)}b.db"


@pytest.mark.parametrize("ch", [c for c in SAMPLE if not 0xD800 <= ord(c) < 0xE000], ids=escaped)  # not in TOML
def test_a_matrix_description_with_any_of_them_is_refused(tmp_path, ch):
    from fibctl.errors import FibctlError
    from fibctl.matrix import load_matrix

    path = tmp_path / "m.toml"
    path.write_text(f'[matrix]\npreset = "micro"\ndescription = "a\\u{ord(ch):04x}b"\n\n'
                    '[[runs]]\nname = "a"\nschedule = "fixed"\nwindow = 4\n')
    with pytest.raises(FibctlError, match=f"holds the control character {escaped(escaped(ch))};"):
        load_matrix(str(path))


@pytest.mark.parametrize("ch", SAMPLE, ids=escaped)
def test_an_error_line_shows_them_escaped(ch, capsys):
    from fibctl.cli import _fail

    with pytest.raises(SystemExit):
        _fail(f"no run named a{ch}b")
    err = capsys.readouterr().err
    assert err == f"error: no run named a{escaped(ch)}b\n"


@pytest.mark.parametrize("ch", [c for c in SAMPLE if c != "\n"], ids=escaped)
def test_tables_and_logs_show_them_escaped(ch, capsys):
    """A report's table (terminal, Markdown, LaTeX), a table cell of any command (`plain`) and
    a SLURM task's log; each keeps a line break as one."""
    from fibctl.cli.common import plain
    from fibctl.flows.slurm import JobDisplay
    from fibctl.reports import render, tables

    value = f"x{ch}y"
    if not 0xD800 <= ord(ch) < 0xE000:  # a frame's strings (pyarrow's) cannot hold a lone surrogate
        t = tables.Table("t", f"title {value}", pd.DataFrame({f"col {value}": [value]}), "SELECT 1", notes=[value])
        for fmt in ("rich", "md", "latex"):
            text = render.render(t, fmt)
            shown = f"x{escaped(ch)}y".replace("\\", "\\textbackslash{}" if fmt == "latex" else "\\")
            assert ch not in text and shown in text, fmt
    assert plain(f"{value}\n").plain == f"x{escaped(ch)}y\n"
    JobDisplay(None, "1", 0, 0).warn(f"{value}\nz")
    assert capsys.readouterr().out == f"task 0: warning: x{escaped(ch)}y\nz\n"


# the names fibctl gives a path it puts in a message: `path`, `runs_dir`, `data_dir`, `folder`,
# `t.checkpoint`, `e.filename`, ... and the few short ones (`out`, `own`, `left`, `hidden`)
PATH_NAMES = re.compile(r"(^|_)(path|dir|folder|checkpoint|filename)$|^(out|own|left|hidden|db|source|above|existing|blocked)$")
# names of that form that are no path: the words of a command, an attention path (dense,
# flex), where a run came from (fibctl, study)
NOT_PATHS = {("cli/__init__.py", "ctx.command_path"), ("flows/bench.py", "path"), ("queue.py", "row.source")}


def _named(e: ast.expr) -> str | None:
    """The name an interpolated expression is known by: `path` for path, path.parent,
    str(path), folder[0]; None for a call of anything else (shown_path(path), len(path))."""
    while True:
        if isinstance(e, ast.Subscript):
            e = e.value
        elif isinstance(e, ast.Attribute) and e.attr == "parent":
            e = e.value
        elif isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("absolute", "resolve"):
            e = e.func.value
        elif isinstance(e, ast.Call) and ast.unparse(e.func) in ("str", "Path", "os.fspath") and e.args:
            e = e.args[0]
        else:
            break
    return e.id if isinstance(e, ast.Name) else e.attr if isinstance(e, ast.Attribute) else None


def test_no_message_shows_a_path_raw():
    """A message names a path through `shown_path` (or `!r`): printed raw, one whose name begins
    or ends with a blank (`data `) read as another, and one with a control character was
    escaped only where the CLI printed it, not where a worker recorded it in an event. Errors
    were checked (those raised as `FibctlError(...)`, not `ckpt.DamagedCheckpoint(...)`); the
    lines fibctl prints or records were not (`report all`'s "wrote N files to OUT/", `queue
    rm`'s "deleted FOLDER", the worker's "resumed from step N (PATH)"). Every f-string with a
    blank in its text is a message: a path built by one (`f"{name}.toml"`) has none."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.JoinedStr)
                    and any(isinstance(v, ast.Constant) and " " in v.value for v in node.values)):
                continue
            for value in node.values:
                if isinstance(value, ast.FormattedValue) and value.conversion != ord("r"):
                    name = _named(value.value)
                    if name and PATH_NAMES.search(name) and (where, ast.unparse(value.value)) not in NOT_PATHS:
                        found.append(f"{where}:{value.value.lineno}: {ast.unparse(value.value)}")
    assert not found


def test_an_error_quotes_a_path_a_blank_ends(tmp_path, monkeypatch, capsys):
    """`--runs-dir 'runs '` (a blank pasted with it) was said as `--runs-dir runs is not a
    folder`, though runs was one."""
    import sys

    from fibctl.cli import main

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "retry", "r", "--from-start", "--runs-dir", "runs ",
                                      "--db", str(tmp_path / "r.db")])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2
    assert capsys.readouterr().err == "error: --runs-dir 'runs ' is not a folder; nothing was changed\n"
