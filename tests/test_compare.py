"""`fibctl compare`: runs side by side, from the database alone (it writes nothing)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from sqlalchemy import insert, update
from typer.testing import CliRunner

from cli_helpers import refused
from fibctl.cli import app
from fibctl.db import schema
from fibctl.db.engine import connect
from test_reports import DEMO_LENGTHS, add_eval, add_run


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> str:
    """A dense run, fixed at two lrs (the second stopped early, evaluated at step 400 only)."""
    db = str(tmp_path_factory.mktemp("compare") / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        for name, schedule, lr, ppls in (("dense", "dense", 3e-3, [20.0, 30.0, 60.0, 120.0]),
                                         ("fixed", "fixed", 3e-3, [24.0, 23.8, 23.7, 23.9]),
                                         ("fixed_lr1e-3", "fixed", 1e-3, [22.0, 22.5, 22.9, 23.1])):
            rid = add_run(conn, name, schedule, lr=lr)
            step = 400 if name == "fixed_lr1e-3" else 600
            for length, ppl in zip(DEMO_LENGTHS, ppls):
                add_eval(conn, rid, length, ppl, step=step)
            conn.execute(insert(schema.TrainStep).values(run_id=rid, step=step, loss=3.25, lr=lr, grad_norm=0.5,
                                                         tokens_per_s=4321.0, elapsed_s=60.0))
        conn.execute(update(schema.Run).where(schema.Run.name == "fixed_lr1e-3").values(
            status="running", final_step=None))
        conn.execute(update(schema.Run).values(tokens_trained=1_228_800, wall_seconds=125.0))
    engine.dispose()
    return db


def compared(*args: str, width: int = 80) -> str:
    result = CliRunner().invoke(app, ["compare", *args], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output


def test_compare_shows_the_settings_that_differ_how_each_trained_and_its_perplexities(sweep):
    out = compared("fixed", "fixed_lr1e-3", "dense", "--db", sweep)
    settings, training, perplexity = out.split("Training")[0], *out.split("Training")[1].split("Perplexity")
    assert "model.schedule" in settings and "train.lr" in settings and "0.001" in settings
    assert "model.d_model" not in settings and "seed" not in settings  # the same in every run
    assert [line.split()[1:4] for line in training.splitlines() if line.startswith("│ fixed")] == [
        ["fixed", "│", "done"], ["fixed_lr1e-3", "│", "running"]]
    assert "2m05s" in training and "4,321" in training
    # a step's loss to 3 decimals, as `status`, `queue show` and the progress line show it
    assert re.search(r"│ 3\.250 +│", training) and "3.2500" not in training, training
    assert "23.10" in perplexity and "120.00" in perplexity
    # one held-out set: said once in the title, each length a header of its own on one line
    # ("docs_val 1,024" in each header wrapped some and pushed lengths into a second table);
    # a length as the report tables write it, 1024 (it was 1,024 here alone)
    assert " ".join(perplexity.split()).startswith("on docs_val by evaluation length (the lowest in bold)")
    assert re.search(r"┃ run +┃ +128 ┃ +256 ┃ +512 ┃ +1024 ┃", perplexity), perplexity
    assert "fixed_lr1e-3's perplexities are of step 400 (it has not finished)" in " ".join(perplexity.split())
    assert max(len(line) for line in out.splitlines()) <= 80
    every = compared("fixed", "dense", "--db", sweep, "--all")
    assert "model.d_model" in every and "Settings that differ" not in every


def test_compare_says_when_other_samplers_drew_the_runs_windows(tmp_path):
    """Runs of one seed whose windows torch's generator drew (a run resumed from a checkpoint of
    an earlier fibctl) and numpy's (as the study) read other windows: no setting shows it, so
    compare says it under the training table and in --json, and records each run's sampler."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        for name, sampler in (("fixed", "torch"), ("stagger", "numpy")):
            rid = add_run(conn, name, name)
            conn.execute(update(schema.Run).where(schema.Run.id == rid).values(sampler=sampler))
            add_eval(conn, rid, 128, 20.0)
    engine.dispose()
    said = ("Windows drawn by different samplers, so that runs of one seed read other windows: numpy's "
            "generator, as the study drew them (stagger); torch's generator, as fibctl drew them before "
            "2026-12-06 (fixed).")
    out = compared("fixed", "stagger", "--db", db)
    assert said in " ".join(out.split("Perplexity")[0].split()), out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert json.loads(compared("fixed", "stagger", "--db", db, "--json"))["notes"] == [said]
    assert json.loads(compared("fixed", "stagger", "--db", db, "--json"))["trained"]["sampler"] == ["torch", "numpy"]
    with connect(db).begin() as conn:
        conn.execute(update(schema.Run).values(sampler="numpy"))
    assert "Windows drawn" not in compared("fixed", "stagger", "--db", db)
    with connect(db).begin() as conn:  # edited by hand into a BLOB: shown as it is (it was a traceback)
        conn.execute(update(schema.Run).where(schema.Run.name == "fixed").values(sampler=b"\x00\xff"))
    said = " ".join(compared("fixed", "stagger", "--db", db).split())
    assert "read other windows: b'\\x00\\xff' (fixed); numpy's" in said, said
    assert json.loads(compared("fixed", "stagger", "--db", db, "--json"))["trained"]["sampler"][0] == "b'\\x00\\xff'"


def test_compare_json_holds_every_number(sweep):
    out = json.loads(compared("fixed_lr1e-3", "fixed", "--db", sweep, "--json"))
    assert out["runs"] == ["fixed_lr1e-3", "fixed"]
    assert out["settings"] == {"train.lr": [0.001, 0.003]}
    assert out["trained"]["step"] == [None, 600] and out["trained"]["eval step"] == [400, 600]
    assert out["trained"]["seconds"] == [125.0, 125.0] and out["trained"]["tokens/s"] == [4321.0, 4321.0]
    assert {"dataset": "docs_val", "length": 1024, "values": [23.1, 23.9]} in out["perplexity"]


def test_compare_shows_what_a_dense_run_does_not_use_as_not_applicable():
    """A dense run's config carries window 0 (and base fib, K 15), which compare showed as its
    window; the tables show `-`, and `queue show` none."""
    example = os.path.join(os.path.dirname(__file__), os.pardir, "results.db.example")
    settings = compared("dense", "fib_fixed_w8", "--db", example).split("Training")[0]
    rows = [line.split()[1::2] for line in settings.splitlines() if line.startswith("│ model.")]
    assert rows == [["model.schedule", "dense", "fixed"], ["model.window", "-", "8"]], settings
    every = compared("dense", "fib_fixed_w8", "--db", example, "--all").split("Training")[0]
    assert re.search(r"│ model\.base +│ - +│ fib +│", every), every
    assert re.search(r"│ model\.n_rungs +│ - +│ 15 +│", every), every
    out = json.loads(compared("dense", "fib_fixed_w8", "--db", example, "--json"))
    assert out["settings"] == {"model.schedule": ["dense", "fixed"], "model.window": [None, 8]}


def test_compare_of_two_runs_of_one_recipe_says_no_setting_differs(tmp_path):
    out = compared("a", "b", "--db", _two_runs(tmp_path))
    assert out.startswith("no setting differs between these runs\n") and "Perplexity" not in out
    # no training step logged (as for the study's imported runs): no columns of '-' for loss
    # and tokens/s (the second went on in a table of its own at 80 columns); said under it
    table, note = out.split("Training")[1].split("no training step logged")
    assert "loss" not in table and "tokens/s" not in table, out
    assert note.startswith(": no loss or tokens/s"), out


@pytest.mark.parametrize("names, words", [
    (["a"], "compare takes 2 to 12 different run names, got 1"),
    (["a", "a"], "compare takes 2 to 12 different run names, got 1"),
    (["a", "bb"], "no run named 'bb'; did you mean 'b'?"),
    ([f"r{i}" for i in range(13)], "compare takes 2 to 12 different run names, got 13"),
])
def test_compare_bad_input_is_one_line_exit_2_and_it_writes_nothing(tmp_path, names, words, monkeypatch, capsys):
    db = _two_runs(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert words in refused(monkeypatch, capsys, "compare", *names, "--db", db)
    assert sorted(os.listdir(tmp_path)) == before
    done = subprocess.run([sys.executable, "-m", "fibctl", "compare", "a", "b", "--db", db], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "no setting differs" in done.stdout, done.stderr
    assert sorted(os.listdir(tmp_path)) == before  # read-only: not even SQLite's -wal and -shm


def test_a_wall_time_of_inf_is_shown_as_inf(tmp_path):
    """A wall time edited to inf (9e999 in the sqlite3 shell) was an OverflowError traceback in
    `compare` and `queue show`, which count its whole seconds."""
    db = _two_runs(tmp_path)
    engine = connect(db)
    with engine.begin() as conn:
        conn.execute(update(schema.Run).where(schema.Run.name == "a").values(wall_seconds=float("inf")))
    engine.dispose()
    shown = compared("a", "b", "--db", db)
    assert re.search(r"│ a +│ done +│ +600 │ +- +│ +inf │", shown), shown


def _two_runs(folder) -> str:
    db = str(folder / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        add_run(conn, "a", "fixed")
        add_run(conn, "b", "fixed")
    engine.dispose()
    return db
