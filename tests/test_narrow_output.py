"""Long names at a narrow terminal: `fibctl status`, `queue ls` and `matrix show` show every
run's whole name (folded within its column, never cut with '…'), so it can be read and copied
into `fibctl queue retry NAME`; every line fits the terminal, also when stdout is no terminal."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from fibctl import queue
from fibctl.config import RunConfig
from fibctl.db.engine import connect
from fibctl.db.store import RunRecorder

# names may be 100 characters; each differs from the others at its start and its end
RUNS = [(f"r{i}_" + "a_very-long.run_name_" * 5)[:99] + str(i) for i in range(3)] + ["short"]
MATRIX = ("m_" + "a_long_matrix_name_" * 6)[:100]


def fibctl(*args, columns: int | None, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(TERM="dumb", NO_COLOR="1", **({"COLUMNS": str(columns)} if columns else {}))
    # stdin too is no terminal: rich would take a terminal's width from it
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, cwd=cwd, timeout=120)


def column(text: str, index: int) -> str:
    """Table column `index` read top to bottom, its folded cells joined up."""
    return "".join(line.split("│")[index + 1].strip() for line in text.splitlines() if line.startswith("│"))


def assert_fits(done: subprocess.CompletedProcess, width: int) -> None:
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "…" not in done.stdout, done.stdout
    assert all(len(line) <= width for line in done.stdout.splitlines()), done.stdout


@pytest.fixture
def db(tmp_path) -> str:
    """Two runs running, one failed with a long error, one queued; all of a long-named matrix."""
    path = str(tmp_path / "q.db")
    engine = connect(path)
    queue.add_runs(engine, [RunConfig.resolve(name, MATRIX, "micro", schedule="fixed", seed=i, steps=13_000)
                            for i, name in enumerate(RUNS)])
    for i in range(2):
        run = queue.claim_next(engine, f"gpu-node-004{i}.cluster.example.org:123456:gpu{i}",
                               host=f"gpu-node-004{i}.cluster.example.org", device=f"cuda:{i} (NVIDIA H200)")
        RunRecorder(engine, run.id).log_step(12_345, 3.5, 1e-3, 0.5, tokens_per_s=123_456.0, elapsed_s=40.0)
    run = queue.claim_next(engine, "w")
    queue.fail(engine, run.id, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79 GiB)")
    engine.dispose()
    return path


@pytest.mark.parametrize("columns", [80, None, 40])
def test_queue_ls_and_status_show_whole_long_names(db, columns):
    width = columns or 80  # no terminal and no COLUMNS: 80
    done = fibctl("queue", "ls", "--db", db, columns=columns)
    assert_fits(done, width)
    names = column(done.stdout, 1)
    assert names == "".join(RUNS), done.stdout  # in queue order, each whole
    assert "failed" in done.stdout and "queued" in done.stdout
    assert MATRIX in "".join(done.stdout.split())  # the matrix every run shares, under the table

    done = fibctl("status", "--db", db, columns=columns)
    assert_fits(done, width)
    assert "2 running; 1 queued, 0 done, 1 failed" in " ".join(done.stdout.split())
    if width == 80:  # a table whose other columns keep their numbers whole
        assert column(done.stdout, 0) == "".join(RUNS[:2]), done.stdout
        assert "12,345/13,000" in done.stdout and "123,456" in done.stdout


@pytest.mark.parametrize("columns", [40, 20])
def test_status_too_narrow_for_its_columns_shows_a_field_a_line(db, columns):
    """At 40 columns the step 12,345/13,000 folded over three lines, at 20 every cell but ETA
    was blank: each running run's name, then its fields a line each, numbers whole."""
    done = fibctl("status", "--db", db, columns=columns)
    assert_fits(done, columns)
    out = done.stdout
    assert "│" not in out and all(name in "".join(out.split()) for name in RUNS[:2]), out
    for field in ("step:", "12,345/13,000", "loss:", "3.500", "tok/s:", "123,456", "heartbeat:"):
        assert any(field in line.split() for line in out.splitlines()), (field, out)
    assert "2 running; 1 queued, 0 done, 1 failed" in " ".join(out.split())


@pytest.mark.parametrize("columns", [20, 24])
def test_queue_ls_and_matrix_show_too_narrow_for_their_columns_show_a_field_a_line(db, tmp_path, columns):
    """At 20 columns `queue ls` folded every cell, `done` down a column letter by letter."""
    out = fibctl("queue", "ls", "--db", db, columns=columns)
    assert_fits(out, columns)
    text = out.stdout
    assert "│" not in text and all(name in "".join(text.split()) for name in RUNS), text
    for field in ("status:", "failed", "queued", "attempts:"):
        assert any(field in line.split() for line in text.splitlines()), (field, text)
    assert "4 run(s) listed" in " ".join(text.split())
    toml = tmp_path / "m.toml"
    toml.write_text('[matrix]\ndescription = "narrow"\npreset = "micro"\n'
                    '[[runs]]\nname = "fib_fixed_w8"\nschedule = "fixed"\nwindow = 8\n')
    out = fibctl("matrix", "show", str(toml), columns=columns)
    assert_fits(out, columns)
    lines = out.stdout.splitlines()
    assert lines[0] == "m: narrow" and lines[1] == "fib_fixed_w8" and "  schedule: fixed" in lines, out.stdout


@pytest.mark.parametrize("columns", [80, 40])
def test_matrix_show_with_long_names(tmp_path, columns):
    toml = tmp_path / f"{MATRIX}.toml"
    toml.write_text('[matrix]\ndescription = "runs with long names"\npreset = "micro"\n'
                    + "".join(f'[[runs]]\nname = "{name}"\nschedule = "fixed"\nwindow = 8\n' for name in RUNS))
    done = fibctl("matrix", "show", str(toml), columns=columns)
    assert_fits(done, columns)
    assert column(done.stdout, 0) == "".join(RUNS), done.stdout
    title = done.stdout.partition("┏")[0]
    assert "".join(title.split()).startswith(f"{MATRIX}:"), title


@pytest.mark.parametrize("columns", [80, 40])
def test_matrix_list_and_db_current_fit(tmp_path, columns):
    assert_fits(fibctl("matrix", "list", columns=columns), columns)
    path = tmp_path / f"{MATRIX}.db"
    connect(str(path)).dispose()
    done = fibctl("db", "current", "--db", str(path), columns=columns)
    assert_fits(done, columns)
    assert str(path) in "".join(done.stdout.split())


@pytest.mark.parametrize("columns", [80, 60, 40])
def test_data_show_keeps_every_source_kind_and_path_whole(tmp_path, columns):
    """A source's kind (`installed-docs`) was cut to `installe…` at 80 columns; then folded
    ('inst' / 'alle' / 'd-do' / 'cs') at 60 and 40, with every other cell; and a split's path
    folded inside its cell, where it could not be copied. Each is whole now: the document
    counts go first, then a field a line, the path on a line of its own where it is long."""
    import dataclasses

    from fibctl.data.streams import load_manifest
    from train_helpers import write_data

    folder = write_data(tmp_path / ("data_" + "deep_folder_name_" * 4))
    source = {"kind": "installed-docs", "target_tokens": 40_000, "train_tokens": 40_000, "train_documents": 11_509,
              "exhausted": False, "heldout": "docs_val", "heldout_tokens": 8_192, "heldout_documents": 735}
    manifest = dataclasses.replace(load_manifest(folder), sources={"docs": source})
    manifest.write()
    done = fibctl("data", "show", str(folder), columns=columns)
    assert done.returncode == 0 and "…" not in done.stdout, done.stderr
    paths = [str(manifest.split_path(split)) for split in manifest.splits]
    whole_or_fits(done.stdout, columns, paths)
    lines = done.stdout.splitlines()
    assert all(path in lines for path in paths), done.stdout  # each wider than the terminal: a line alone
    words = done.stdout.replace("│", " ").replace(";", " ").split()
    assert "installed-docs" in words and "11,509" in words and "735" in words, done.stdout


@pytest.mark.parametrize("width", [80, 100])
def test_data_prepares_progress_lines_fit_the_terminal(monkeypatch, width):
    """At 80 columns the bar (20), a 12-digit count and a rate of '123,456,789 tokens/s' took
    about 90: rich wrapped the rate's unit onto a line of its own."""
    import io

    from rich.console import Console

    from fibctl.cli import data

    monkeypatch.setattr(data, "err_console", Console(file=io.StringIO(), width=width, force_terminal=True,
                                                     color_system=None))
    progress = data.token_progress()
    for name, unit, done, speed in (("fineweb_edu_val tokens", "tokens", 987_654_321, 123_456_789.0),
                                    ("tokenizer sample", "chars", 200_000_000, 2.5e9),
                                    ("installed docs", "packages", 7, 0.5)):
        task = progress.add_task(name, total=10**9, unit=unit)
        progress.update(task, completed=done)
        progress.tasks[-1].finished_speed = speed
    data.err_console.print(progress.make_tasks_table(progress.tasks))
    lines = data.err_console.file.getvalue().splitlines()
    assert len(lines) == 3 and max(map(len, lines)) <= width, lines
    assert "123M tokens/s" in lines[0] and "2.5G chars/s" in lines[1] and "0.5 packages/s" in lines[2]


@pytest.mark.parametrize("columns", [80, 60, 40])
def test_eval_results_cut_no_name_or_number(columns):
    """`fibctl eval` drew a plain table: at 60 columns it showed `fib_s…` for the run and `164.…`
    for its perplexity. Every run name and number is whole now, and every line fits."""
    import io

    import pandas as pd
    from rich.console import Console

    from fibctl.cli.train import _results_tables

    df = pd.DataFrame({"run": ["fib_stagger_w8_lr1e-3", RUNS[0]], "step": [200, 13_000],
                       "dataset": ["docs_val", "fineweb_edu_val"], "eval_length": [64, 4096],
                       "tokens": [4096, 1_048_576], "loss": [5.105, 3.25], "ppl": [164.848, 25.79],
                       "speed_batch": [8, 8], "tokens_per_s": [95_470.0, 123_456.0],
                       "tokens_per_s_min": [90_001.0, 120_000.0], "tokens_per_s_max": [99_999.0, 1_234_567.0]})
    out = io.StringIO()
    console = Console(file=out, width=columns, color_system=None)
    for part in _results_tables(df, True, columns):
        console.print(part)
    text = out.getvalue()
    assert "…" not in text and all(len(line) <= columns for line in text.splitlines()), text
    results, speeds = text.split("inference speed")
    for part in (results, speeds):
        if columns >= 60 or "│" in part:  # a table, its names folded within their column
            assert column(part, 0) == "fib_stagger_w8_lr1e-3" + RUNS[0]
        else:  # names would fold under 8 columns: a field a line, as status and queue ls do
            assert all(name in "".join(part.split()) for name in ("fib_stagger_w8_lr1e-3", RUNS[0])), part
    for number in ("164.85", "25.79", "5.1050", "4096", "123,456", "120,000-1,234,567"):
        assert number in text, (number, text)


@pytest.mark.parametrize("columns", [80, 60, 40])
def test_data_recipes_cut_no_held_out_set_name(columns):
    """`data recipes` drew a plain table: at 60 columns the paper's held-out sets, the names
    `--dataset` takes, read `fineweb_e…`, `wikipedia…`. Whole now (folded at worst), one a line."""
    done = fibctl("data", "recipes", columns=columns)
    assert_fits(done, columns)
    sets = column(done.stdout, 3)
    assert "fineweb_edu_valwikipedia_valtinystories_valmath_val" in sets and "docs_val" in sets, done.stdout


def whole_or_fits(text: str, width: int, paths: list[str]) -> None:
    """Every line fits `width`, but for one that is a path of `paths`, whole on its own line:
    folded across lines, a path cannot be copied; wider than the terminal, it wraps there."""
    for line in text.splitlines():
        assert len(line) <= width or line in paths, (line, text)


@pytest.mark.parametrize("columns", [80, 40])
def test_queue_show_keeps_every_path_whole_on_a_line(tmp_path, columns):
    """`queue show` folded an event's checkpoint path inside its table cell ('step_0000' /
    '0010.pt') at 80 columns, and at 40 its message column was one letter wide; its own
    checkpoint line split the file from its folder ('(in' / folder). Each path is whole now,
    on a line of its own where it does not fit beside its label, and at 40 columns the
    perplexities, which folded ('237.' / '16'), are a field a line."""
    runs_dir = tmp_path / ("runs_" + "deep_folder_" * 4)
    file = str(runs_dir / "fib_stagger_w8" / "step_00000010.pt")
    path = str(tmp_path / "q.db")
    engine = connect(path)
    queue.add_runs(engine, [RunConfig.resolve("fib_stagger_w8", "demo", "micro", schedule="stagger")])
    run = queue.claim_next(engine, "vm:4313")
    recorder = RunRecorder(engine, run.id)
    for length in (64, 128, 256, 512):
        recorder.log_eval(10, "docs_val", length, 4096, math.log(237.16))
    recorder.event("checkpoint", f"step 10: {file}")
    recorder.update_run(checkpoint_path="fib_stagger_w8/step_00000010.pt", runs_dir=str(runs_dir), final_step=10)
    engine.dispose()
    done = fibctl("queue", "show", "fib_stagger_w8", "--db", path, columns=columns)
    assert done.returncode == 0 and "Traceback" not in done.stderr and "…" not in done.stdout, done.stderr
    whole_or_fits(done.stdout, columns, [file])
    lines = done.stdout.splitlines()
    assert sum(file in line for line in lines) == 2, done.stdout  # the run's checkpoint and the event's
    assert "checkpoint:" in lines[lines.index(file) - 1], done.stdout  # the run's, under its label
    assert done.stdout.count("237.16") == 4, done.stdout  # every perplexity whole


@pytest.mark.parametrize("columns", [80, 40, 24])
def test_model_and_coverage_headers_and_numbers_whole(columns):
    """Plain tables: at 40 columns `fibctl model` cut its header to 'distanc…', at 24
    `fibctl coverage` its own ('dista…'). Every header word and number is whole now, the
    attended distances wrapped between numbers, never inside one."""
    done = fibctl("model", columns=columns)
    assert_fits(done, columns)
    words = set(done.stdout.replace("│", " ").replace(",", " ").replace(":", " ").split())
    assert {"distances", "window", "rungs", "60", "850", "688", "610", "987"} <= words, done.stdout
    assert "0..8" in words and "13" in words, done.stdout
    done = fibctl("coverage", "--schedule", "stagger", columns=columns)
    assert_fits(done, columns)
    words = set(done.stdout.replace("│", " ").replace(":", " ").split())
    assert {"distinct", "distances", "union", "layers", "133"} <= words, done.stdout


def test_the_line_for_columns_left_out_gives_what_they_share_or_their_names():
    from fibctl.cli.common import left_out

    headers, rows = ["name", "p", "q", "r"], [("a", 1, 2, "x"), ("b", 3, 4, "x")]
    assert left_out(headers, [], rows) is None
    assert left_out(headers, ["p"], rows) == "not shown at this width: p (a wider terminal shows it)"
    assert left_out(headers, ["p", "q", "r"], rows) == "r x; not shown at this width: p, q (a wider terminal shows them)"


@pytest.fixture
def long_named_results(tmp_path) -> tuple[str, list[str]]:
    """results.db.example with each run's name made 60 characters long."""
    import json
    import shutil
    import sqlite3

    path = str(tmp_path / "r.db")
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results.db.example"), path)
    with sqlite3.connect(path) as conn:
        for rid, name, config in conn.execute("SELECT id, name, config_json FROM runs").fetchall():
            long = (name + "_sweep-lr3e-4_warmup2000_batch64_ctx1024_" + "x" * 60)[:60]
            conn.execute("UPDATE runs SET name = ?, config_json = ? WHERE id = ?",
                         (long, json.dumps({**json.loads(config), "name": long}), rid))
    conn.close()
    return path, [n for (n,) in sqlite3.connect(path).execute("SELECT name FROM runs ORDER BY id")]


def test_report_and_compare_fold_a_long_name_rather_than_split_the_table(long_named_results):
    """A 60-character run name took 62 of 80 columns: Table 3 came in seven parts, one or two
    numbers each, and `compare` (a run's name heading a column) cut its first column's
    `model.schedule` into `model.schedul`/`e`. A name past 32 characters folds within its
    column now, where the table would not fit with it whole."""
    db, names = long_named_results
    done = fibctl("report", "table3", "--db", db, columns=80)
    assert_fits(done, 80)
    assert done.stdout.count("(continued)") == 1, done.stdout  # two parts
    assert column(done.stdout, 0).count(names[0]) == 2  # folded, whole in each part
    done = fibctl("compare", names[0], names[1], "--db", db, columns=80)
    assert_fits(done, 80)
    assert "│ model.schedule │" in done.stdout, done.stdout
    assert column(done.stdout, 0).count(names[0]) >= 2  # the Training and perplexity tables' rows
    # a name that fits stays whole on its line
    done = fibctl("report", "table3", "--db", db, columns=200)
    assert_fits(done, 200)
    assert all(f"│ {name} " in done.stdout for name in names) and "(continued)" not in done.stdout
