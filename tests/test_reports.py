"""`fibctl report`: the study's tables computed by SQL, rendered five ways, on small databases."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import insert, text, update
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.config import RunConfig
from fibctl.db import schema
from fibctl.db.engine import connect, connect_readonly
from fibctl.errors import FibctlError
from fibctl.reports import render, tables
from fibctl.reports.sql import run_query
from conftest import fresh_database, reader_url
from test_import import N_POS, imported, position_losses


@pytest.fixture(scope="module")
def study(module_backend, tmp_path_factory):
    """The small published study, imported (a SQLite file, and on the FIBCTL_TEST_PG server)."""
    folder = tmp_path_factory.mktemp("study")
    with fresh_database(module_backend, folder) as db:
        engine, _ = imported(folder, db)
        engine.dispose()
        yield db


def ro(db: str):
    return connect_readonly(db)


def add_run(conn, name: str, schedule: str, *, base="fib", window=8, seed=42, T=128, preset="tiny",
            matrix="demo", **train) -> int:
    config = RunConfig.resolve(name, matrix, preset, schedule=schedule, base=base, window=window, seed=seed,
                               **train)
    dense = schedule == "dense"
    return conn.execute(insert(schema.Run).values(
        name=name, matrix=matrix, preset=preset, base=None if dense else base, schedule=schedule,
        window=None if dense else window, seed=seed, train_length=T, config_json=config.to_json(),
        config_hash=config.config_hash, status="done", attempts=1, created_at=datetime(2026, 1, 1),
        final_step=600)).inserted_primary_key[0]


def add_eval(conn, run_id: int, length: int, ppl: float, dataset="docs_val", step=600) -> None:
    conn.execute(insert(schema.Evaluation).values(run_id=run_id, step=step, dataset=dataset, eval_length=length,
                                                   tokens=1000, loss=float(np.log(ppl)), ppl=ppl))


DEMO_PPL = {  # the demo's shape: tiny preset, T 128, evaluated at 1x..8x on its own held-out set
    "dense": [20.0, 30.0, 60.0, 120.0], "fixed": [24.0, 23.8, 23.7, 23.9],
    "stagger": [23.0, 22.7, 22.6, 22.6], "learned": [23.5, 23.3, 23.2, 23.4],
}
DEMO_LENGTHS = [128, 256, 512, 1024]


@pytest.fixture(scope="module")
def demo(module_backend, tmp_path_factory):
    with fresh_database(module_backend, tmp_path_factory.mktemp("demo")) as db:
        yield _fill_demo(db)


def _fill_demo(db: str) -> str:
    engine = connect(db)
    with engine.begin() as conn:
        for schedule, ppls in DEMO_PPL.items():
            rid = add_run(conn, f"demo_{schedule}", schedule)
            for length, ppl in zip(DEMO_LENGTHS, ppls):
                add_eval(conn, rid, length, ppl)
            add_eval(conn, rid, 128, ppls[0] + 5, step=200)  # an earlier evaluation: not the final one
            # per-position losses in 512-token windows (4x): position p has loss p / 1000
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="docs_val", eval_length=512, position=p,
                     mean_loss=p / 1000 + (1 if schedule == "dense" else 0), windows=4) for p in range(511)])
    engine.dispose()
    return db


def test_table1_reads_each_runs_final_step_at_the_training_length(study):
    t = tables.table1(ro(study))
    assert list(t.frame.columns) == ["Run", "Base", "Schedule", "W", "TinyStories", "FineWeb-Edu"]
    by_run = t.frame.set_index("Run")
    assert by_run.loc["f13__fib_stagger_w12", "FineWeb-Edu"] == 42.0
    assert by_run.loc["f11__fib_stagger_w8", "FineWeb-Edu"] == 42.5  # the done attempt, final step
    # the paper's order: fib fixed, learned, stagger, coprime, then pow2 fixed, pow2 stagger
    assert list(t.frame["Run"]) == ["f06__fib_fixed_w8", "f02__fib_learned_w8", "f11__fib_stagger_w8",
                                    "f13__fib_stagger_w12", "f17__fib_hdc_w12", "f09__logsparse_w8",
                                    "f21__logsparse_stagger_w12"]
    assert "ref_e0000" not in set(t.frame["Run"])  # sparse runs only, seed 42 only
    left_out = "the dense baseline is left out, as in the paper; --dense adds it"
    assert left_out in t.notes  # said under the table: the reader would look for it in vain
    assert left_out not in tables.table1(ro(study), dense=True).notes
    assert tables.table1(ro(study), seed=43).frame["Run"].tolist() == ["g03__fib_stagger_w12_s43"]
    assert left_out not in tables.table1(ro(study), seed=43).notes  # no dense run of that seed


def test_table1_compare_puts_the_other_database_beside(study, demo, tmp_path):
    other = str(tmp_path / "other.db")
    engine = connect(other)
    with engine.begin() as conn:
        rid = add_run(conn, "mine_stagger_w12", "stagger", window=12, T=1024, preset="paper", matrix="paper")
        add_eval(conn, rid, 1024, 41.0, dataset="fineweb_edu_val")
    t = tables.table1(ro(study), compare=ro(other), compare_label="mine")
    by_config = t.frame.set_index(["Base", "Schedule", "W"])
    row = by_config.loc[("fib", "stagger", 12)]
    assert (row["FineWeb-Edu"], row["FineWeb-Edu (mine)"], row["Δ FineWeb-Edu"]) == (42.0, 41.0, 1.0)
    assert pd.isna(by_config.loc[("fib", "fixed", 8), "FineWeb-Edu (mine)"])
    assert "Run" not in t.frame.columns  # run names differ between databases
    with engine.begin() as conn:  # a second run of that kind: matched twice, the row came out twice
        rid = add_run(conn, "other_stagger_w12", "stagger", window=12, T=1024, preset="paper", matrix="other")
        add_eval(conn, rid, 1024, 40.0, dataset="fineweb_edu_val")
    engine.dispose()
    with pytest.raises(FibctlError, match=r"^table1 --compare matches runs by base, schedule and W: mine has 2 "
                                          r"runs of fib stagger W=12 \(mine_stagger_w12, other_stagger_w12\)"):
        tables.table1(ro(study), compare=ro(other), compare_label="mine")
    t = tables.table1(ro(study), compare=ro(other), compare_label="mine", matrix="paper")
    assert len(t.frame) == len(tables.table1(ro(study), matrix="paper").frame)
    # --only's names are this database's: the other's runs are still matched by what they are
    t = tables.table1(ro(study), compare=ro(other), compare_label="mine", matrix="paper", only="*fib_stagger_w12")
    assert t.frame[["Base", "Schedule", "W", "FineWeb-Edu (mine)"]].values.tolist() == [["fib", "stagger", 12, 41.0]]


def test_table2_probe_alpha_range_and_mean_accuracy(study):
    f = tables.table2(ro(study)).frame.set_index("Init")
    assert f.loc["uniform", "α min"] == 0.928 and f.loc["uniform", "α max"] == 1.035
    assert f.loc["staggered", "acc d=200"] == pytest.approx(0.99)
    assert f.loc["staggered", "acc d=350"] == pytest.approx(0.1)
    assert f.loc["uniform", "Seeds"] == 2 and f.loc["uniform", "Depth"] == 2


def test_table2_of_a_half_trained_probe_matrix_shows_the_cells_it_has(tmp_path):
    """Depth 8 with both inits and depth 4 with uniform only, as while a matrix trains: three
    rows, not a fourth (depth 4, staggered) made of nothing."""
    db = str(tmp_path / "half.db")
    engine = connect(db)
    with engine.begin() as conn:
        for depth, staggered in ((8, 0), (8, 1), (4, 0)):
            run_id = add_run(conn, f"probe_d{depth}_{staggered}", "learned", matrix="probe")
            metrics = {"depth": depth, "staggered_init": staggered, "acc_d200": 0.5, "acc_d350": 0.25,
                       "eval_sequences": 16}
            conn.execute(insert(schema.AuxMetric), [dict(run_id=run_id, name="marked_retrieval", metric=m, value=v)
                                                   for m, v in metrics.items()])
            conn.execute(insert(schema.Alpha), [dict(run_id=run_id, step=2500, layer=layer, alpha=1.0 + layer / 100)
                                               for layer in range(depth)])
    engine.dispose()
    f = tables.table2(ro(db)).frame
    assert sorted(zip(f["Depth"], f["Init"])) == [(4, "uniform"), (8, "staggered"), (8, "uniform")]
    assert list(f["Seeds"]) == [1, 1, 1] and list(f["acc d=200"]) == [0.5, 0.5, 0.5]
    done = CliRunner().invoke(app, ["report", "table2", "--db", db])
    assert done.exit_code == 0, done.output


def test_table2_only_reads_the_probe_runs_whose_names_match_as_the_other_tables_do(tmp_path):
    """`report table2` took no --only (and `report all --only` showed every probe run in it)."""
    db = str(tmp_path / "two.db")
    engine = connect(db)
    with engine.begin() as conn:
        for name, depth in (("probe_d8", 8), ("probe_d4", 4), ("dense", None)):
            run_id = add_run(conn, name, "dense" if depth is None else "learned", matrix="probe")
            if depth is None:
                continue
            metrics = {"depth": depth, "staggered_init": 0, "acc_d200": 0.5, "eval_sequences": 16}
            conn.execute(insert(schema.AuxMetric), [dict(run_id=run_id, name="marked_retrieval", metric=m, value=v)
                                                   for m, v in metrics.items()])
            conn.execute(insert(schema.Alpha), [dict(run_id=run_id, step=2500, layer=0, alpha=1.0)])
    engine.dispose()
    assert list(tables.table2(ro(db), only="probe_d8*").frame["Depth"]) == [8]
    done = CliRunner().invoke(app, ["report", "table2", "--db", db, "--only", "probe_d4", "--show-sql"])
    assert done.exit_code == 0 and "r.name IN ('probe_d4')" in done.output, done.output
    with pytest.raises(FibctlError, match=r"table2: no probe results \(.*\) named 'dense'"):
        tables.table2(ro(db), only="dense")


def test_table2_says_an_accuracy_averaged_over_fewer_seeds_than_its_row_counts(tmp_path):
    """A model whose held-out sequences held no position at a distance records no accuracy
    there (NULL): the mean is over the other seeds, while Seeds counts every model."""
    db = str(tmp_path / "fewer.db")
    engine = connect(db)
    with engine.begin() as conn:
        for seed, acc_350 in ((0, 0.25), (1, None)):
            run_id = add_run(conn, f"probe_s{seed}", "learned", matrix="probe", seed=seed)
            metrics = {"depth": 2, "staggered_init": 0, "acc_d200": 0.5, "acc_d350": acc_350, "eval_sequences": 2}
            conn.execute(insert(schema.AuxMetric), [dict(run_id=run_id, name="marked_retrieval", metric=m, value=v)
                                                   for m, v in metrics.items()])
            conn.execute(insert(schema.Alpha), [dict(run_id=run_id, step=200, layer=0, alpha=1.0)])
    engine.dispose()
    t = tables.table2(ro(db))
    assert t.frame["Seeds"].tolist() == [2] and t.frame["acc d=350"].tolist() == [0.25]
    assert [n for n in t.notes if n.startswith("Fewer seeds")] == [
        "Fewer seeds: depth 2 uniform's acc d=350 is the mean over 1 of its 2 models (the others scored no "
        "position at that distance)."]


def test_table2_keeps_the_scores_of_different_tasks_apart(tmp_path):
    """Depth 2, uniform, two seeds on the study's task and one on a shorter task with other
    distances: two rows, each averaging only its own task's models, named by letter."""
    db = str(tmp_path / "tasks.db")
    engine = connect(db)
    study_task, short_task = ("length 512, vocab 512, distances 200/350", "length 64, vocab 512, distances 20/35")
    models = ((study_task, {"acc_d200": 0.9, "acc_d350": 0.3}), (study_task, {"acc_d200": 0.7, "acc_d350": 0.1}),
              (short_task, {"acc_d20": 0.2, "acc_d35": 0.4}))
    with engine.begin() as conn:
        for i, (task, accs) in enumerate(models):
            run_id = add_run(conn, f"probe_{i}", "learned", matrix="probe")
            metrics = {"depth": 2, "staggered_init": 0, "eval_sequences": 16, **accs}
            conn.execute(insert(schema.AuxMetric), [dict(run_id=run_id, name="marked_retrieval", metric=m, value=v,
                                                        text=None) for m, v in metrics.items()]
                         + [dict(run_id=run_id, name="marked_retrieval", metric="task", value=None, text=task)])
            conn.execute(insert(schema.Alpha), [dict(run_id=run_id, step=200, layer=0, alpha=1.0 + i / 10)])
    engine.dispose()
    t = tables.table2(ro(db))
    f = t.frame.set_index("Task")
    assert sorted(f.index) == ["A", "B"] and f["Seeds"].to_dict() == {"A": 2, "B": 1}
    assert f.loc["A", "acc d=200"] == pytest.approx(0.8) and pd.isna(f.loc["A", "acc d=20"])
    assert f.loc["B", "acc d=20"] == 0.2 and pd.isna(f.loc["B", "acc d=200"]) and f.loc["B", "α max"] == 1.2
    assert f"Task A: marked copy at {study_task}." in t.notes and f"Task B: marked copy at {short_task}." in t.notes
    shown = CliRunner().invoke(app, ["report", "table2", "--db", db], env={"COLUMNS": "80"})
    assert shown.exit_code == 0 and max(map(len, shown.output.splitlines())) <= 80, shown.output


def test_table3_paper_rows_and_change_at_4x(study):
    t = tables.table3(ro(study))
    assert list(t.frame["Run"]) == ["ref_e0000", "f13__fib_stagger_w12", "f11__fib_stagger_w8", "f06__fib_fixed_w8"]
    dense = t.frame.iloc[0]
    assert (dense["1024"], dense["2048"], dense["4096"], dense["Δ at 4x"]) == (30.0, 45.0, 90.0, 200.0)
    assert pd.isna(t.frame.set_index("Run").loc["f06__fib_fixed_w8", "2048"])
    assert render.cell(t, "Δ at 4x", 200.76) == "+201 %" and render.cell(t, "Δ at 4x", -1.34) == "-1.3 %"
    assert "Loss past T at 4x" not in t.frame.columns  # no per-position losses at 4096


def test_table3_demo_shows_every_run_and_the_loss_past_the_training_length(demo):
    t = tables.table3(ro(demo))
    assert t.title.startswith("Table 3: docs_val")
    f = t.frame.set_index("Schedule")
    assert list(f.index) == ["dense", "stagger", "fixed", "learned"]  # the paper's row order
    assert [c for c in t.frame.columns if c.isdigit()] == ["128", "256", "512", "1024"]
    assert f.loc["dense", "Δ at 4x"] == pytest.approx(200.0)  # 60 vs 20 at 512 = 4 x 128
    assert f.loc["stagger", "Δ at 4x"] == pytest.approx((22.6 / 23.0 - 1) * 100)
    # mean loss over positions 128..510 of the 512 windows
    assert f.loc["fixed", "Loss past T at 4x"] == pytest.approx(np.mean(np.arange(128, 511) / 1000))
    assert f.loc["dense", "Loss past T at 4x"] == pytest.approx(1 + np.mean(np.arange(128, 511) / 1000))


runner = CliRunner()


def _windowed_study(db: str, window: int = 4, seeds=(42,)) -> str:
    """dense and fib fixed / stagger at `window`, evaluated at 128 and 512 with per-position
    losses at 128: a study of the user's own windows, none the paper's."""
    engine = connect(db)
    with engine.begin() as conn:
        for seed in seeds:
            for schedule in ("dense", "fixed", "stagger"):
                if schedule == "dense" and seed != 42:
                    continue
                rid = add_run(conn, f"{schedule}_w{window}_s{seed}", schedule, window=window, seed=seed)
                for length, ppl in ((128, 20.0), (512, 40.0 if schedule == "dense" else 21.0)):
                    add_eval(conn, rid, length, ppl + seed / 100)
                conn.execute(insert(schema.PositionLoss), [
                    dict(run_id=rid, step=600, dataset="docs_val", eval_length=128, position=p,
                         mean_loss=3.0 + p / 1000, windows=4) for p in range(127)])
    engine.dispose()
    return db


def test_table3_of_a_study_at_its_own_windows_shows_every_run(tmp_path):
    """The dense baseline is a paper row whatever the windows: Table 3 showed it alone, leaving
    out every sparse run evaluated at 4x, with no note."""
    db = _windowed_study(str(tmp_path / "r.db"))
    t = tables.table3(ro(db))
    assert set(t.frame["Run"]) == {"dense_w4_s42", "fixed_w4_s42", "stagger_w4_s42"}
    engine = connect(db)
    with engine.begin() as conn:  # a paper row now: the table keeps to the paper's rows, and says so
        rid = add_run(conn, "fixed_w8", "fixed", window=8)
        for length in (128, 512):
            add_eval(conn, rid, length, 22.0)
    engine.dispose()
    t = tables.table3(ro(db))
    assert list(t.frame["Run"]) == ["dense_w4_s42", "fixed_w8"]
    assert ("The paper's rows only; also evaluated at several lengths (2): fixed_w4_s42, stagger_w4_s42 "
            "(--all-runs shows every run).") in t.notes


def test_tables_4_and_5_name_the_windows_that_have_their_data(tmp_path):
    db = _windowed_study(str(tmp_path / "r.db"), seeds=(42, 43))
    with pytest.raises(FibctlError, match="fib fixed and stagger at W=8; fixed and stagger have them at --window 4$"):
        tables.table4(ro(db))
    with pytest.raises(FibctlError, match="for two or more seeds; some have at --window 4$"):
        tables.table5(ro(db))
    assert list(tables.table4(ro(db), window=4).frame["Row"]) == ["fixed W4", "stagger W4", "gap"]


def test_tables_4_and_5_refuse_two_runs_for_one_cell(tmp_path, monkeypatch, capsys):
    """Another matrix's runs of the same kind and seed (or one configuration under two names):
    Table 5 averaged them into one seed's value and Table 4 ended in a pandas traceback."""
    db = _windowed_study(str(tmp_path / "r.db"), seeds=(42, 43))
    engine = connect(db)
    with engine.begin() as conn:
        for schedule in ("fixed", "stagger"):
            rid = add_run(conn, f"other_{schedule}", schedule, window=4, matrix="other")
            add_eval(conn, rid, 128, 30.0)
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="docs_val", eval_length=128, position=p,
                     mean_loss=4.0, windows=4) for p in range(127)])
    engine.dispose()
    fails_in_one_line(["figure", "posloss", "--db", db, "--window", "4", "--out", str(tmp_path / "p.png")],
                      tmp_path, "choose one with --matrix (demo, other)", monkeypatch, capsys)
    with pytest.raises(FibctlError, match=r"^table4: fib fixed W=4 seed 42: 2 runs \(fixed_w4_s42, other_fixed\) "
                                          r"for one cell; choose one with --matrix \(demo, other\)$"):
        tables.table4(ro(db), window=4)
    with pytest.raises(FibctlError, match=r"^table5: fib fixed W=4 seed 42: 2 runs \(fixed_w4_s42, other_fixed\) "
                                          r"for one cell; choose one with --matrix \(demo, other\)$"):
        tables.table5(ro(db), window=4)
    assert tables.table5(ro(db), window=4, matrix="demo").frame["seed 42"].tolist() == [20.42, 20.42]
    assert list(tables.table4(ro(db), window=4, matrix="demo").frame["Run"])[:2] == ["fixed_w4_s42",
                                                                                    "stagger_w4_s42"]
    engine = connect(db)
    with engine.begin() as conn:  # one matrix, one configuration under two names: --matrix cannot help
        add_eval(conn, add_run(conn, "fixed_again", "fixed", window=4), 128, 25.0)
    engine.dispose()
    # ways to read them that keep both: `queue rm` alone was the advice, deleting results
    with pytest.raises(FibctlError, match=r"2 runs \(fixed_again, fixed_w4_s42\) for one cell; pick one per cell "
                                          r"by name with --only GLOB, or see them side by side with "
                                          r"`fibctl compare fixed_again fixed_w4_s42`$"):
        tables.table5(ro(db), window=4, matrix="demo")


def test_a_continued_table_repeats_the_columns_that_name_its_rows(tmp_path):
    """Table 5 too wide for the terminal went on below under its Base column alone (`fib`,
    `fib`, `pow2`, ...: which row is which?). Each continued part repeats the columns that name
    a row (base, schedule and W; Table 2's depth and init), as many of them as fit beside the
    next column: at 20 columns Base alone, as before."""
    t5 = tables.table5(ro(_windowed_study(str(tmp_path / "r.db"), seeds=(42, 43))), window=4)
    assert t5.key == 3

    def heads(width: int) -> list[list[str]]:  # each part's headers, as drawn (a header may wrap)
        parts = []
        for line in render.to_text(t5, width).splitlines():
            if line.startswith("┏"):
                parts.append([])
            elif line.startswith("┃"):
                parts[-1].append(line.strip("┃").split("┃"))
        return [[" ".join(" ".join(words).split()) for words in zip(*part)] for part in parts]

    wide, *continued = heads(50)
    assert wide[:3] == ["Base", "Schedule", "W"] and continued, (wide, continued)
    assert all(part[:3] == ["Base", "Schedule", "W"] for part in continued), continued
    assert all(part[:2] != ["Base", "Schedule"] for part in heads(20)[1:]), heads(20)


def test_only_picks_a_sweeps_runs_for_every_table_and_figure(tmp_path, monkeypatch, capsys):
    """A sweep (`queue add --suffix _lr1e-3`) shares its matrix with the runs it varies: Tables 4
    and 5 refused both, and --matrix could not pick either. --only picks runs by name."""
    db = _windowed_study(str(tmp_path / "r.db"), seeds=(42, 43))
    engine = connect(db)
    with engine.begin() as conn:
        for seed in (42, 43):
            for schedule in ("fixed", "stagger"):
                rid = add_run(conn, f"{schedule}_w4_s{seed}_lr1e-3", schedule, window=4, seed=seed, lr=1e-3)
                for length, ppl in ((128, 30.0), (512, 31.0)):
                    add_eval(conn, rid, length, ppl + seed / 100 + (schedule == "fixed"))
                conn.execute(insert(schema.PositionLoss), [
                    dict(run_id=rid, step=600, dataset="docs_val", eval_length=128, position=p,
                         mean_loss=5.0 + p / 1000 + (schedule == "fixed"), windows=4) for p in range(127)])
    engine.dispose()
    with pytest.raises(FibctlError, match=r"^table4: fib fixed W=4 seed 42: 2 runs \(fixed_w4_s42, "
                                          r"fixed_w4_s42_lr1e-3\) for one cell; pick one per cell by name with "
                                          r"--only GLOB \(--only '\*_lr1e-3' reads the runs so named\)"):
        tables.table4(ro(db), window=4)
    t4 = tables.table4(ro(db), window=4, only="*_lr1e-3")
    assert list(t4.frame["Run"])[:2] == ["fixed_w4_s42_lr1e-3", "stagger_w4_s42_lr1e-3"]
    assert t4.frame.set_index("Row").loc["gap"].iloc[1:].astype(float).round(6).eq(1.0).all()
    assert tables.table4(ro(db), window=4, only="*_s42").frame["Run"].tolist()[:2] == ["fixed_w4_s42",
                                                                                      "stagger_w4_s42"]
    t5 = tables.table5(ro(db), window=4, only="*_lr1e-3")
    assert t5.frame["Schedule"].tolist() == ["stagger", "fixed"] and t5.frame["Mean"].tolist() == [30.425, 31.425]
    assert "'fixed_w4_s42_lr1e-3'" in t5.sql and run_query(reader_url(db), t5.sql)["ppl"].count() == 4  # runnable as shown
    assert tables.table1(ro(db), only="stagger_*").frame["Run"].tolist() == ["stagger_w4_s42",
                                                                             "stagger_w4_s42_lr1e-3"]
    t3 = tables.table3(ro(db), only="*_lr1e-3", all_runs=True)
    assert sorted(t3.frame["Run"]) == ["fixed_w4_s42_lr1e-3", "stagger_w4_s42_lr1e-3"]
    with pytest.raises(FibctlError, match=r"^table5: no configuration at W=4 on docs_val named 'dense\*' has"):
        tables.table5(ro(db), window=4, only="dense*")
    # the CLI: the tables, a figure, and a glob that matches no run (one line, exit 2, nothing written)
    r = runner.invoke(app, ["report", "table4", "--db", db, "--window", "4", "--only", "*_lr1e-3", "-f", "csv"])
    assert r.exit_code == 0 and "fixed_w4_s42_lr1e-3" in r.output and "fixed_w4_s42," not in r.output
    png = tmp_path / "p.png"
    r = runner.invoke(app, ["figure", "posloss", "--db", db, "--window", "4", "--only", "*_lr1e-3", "-o", str(png)])
    assert r.exit_code == 0 and png.is_file()
    fails_in_one_line(["report", "table5", "--db", db, "--window", "4", "--only", "*_lr1e3"], tmp_path,
                      "--only '*_lr1e3': no run whose name matches that glob in", monkeypatch, capsys)
    fails_in_one_line(["report", "all", "--db", db, "--only", "*_LR1e-3", "--out", str(tmp_path / "rep")],
                      tmp_path, "--only '*_LR1e-3': no run whose name matches that glob", monkeypatch, capsys)
    r = runner.invoke(app, ["report", "all", "--db", db, "--window", "4", "--only", "*_lr1e-3",
                            "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "fixed_w4_s42," not in (tmp_path / "rep" / "table4.csv").read_text()
    page = (tmp_path / "rep" / "index.html").read_text()  # the page lists the report's runs alone
    assert "Runs (4)" in page and "<td>fixed_w4_s42_lr1e-3</td>" in page and "<td>fixed_w4_s42</td>" not in page


def test_report_all_takes_the_window_and_removes_an_earlier_reports_files(tmp_path, monkeypatch, capsys):
    db = _windowed_study(str(tmp_path / "r.db"), seeds=(42, 43))
    out = tmp_path / "report"
    out.mkdir()
    (out / "table4.tex").write_text("mine")  # a user's file named like a report's: never removed
    (out / "table1.txt").write_text("mine too")  # nor replaced (it was, table1 having data)
    fails_in_one_line(["report", "all", "--db", db, "--out", str(out)], tmp_path,
                      "holds table1.txt, table4.tex, not written by a fibctl report (it has no .fibctl-report)",
                      monkeypatch, capsys)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"table4.tex": "mine", "table1.txt": "mine too"}
    (out / "table4.tex").unlink()
    (out / "table1.txt").unlink()
    r = runner.invoke(app, ["report", "all", "--db", db, "--out", str(out)])
    assert r.exit_code == 0 and "skipped table4:" in r.output and "skipped table4: table4" not in r.output
    assert not (out / "table4.csv").exists()
    r = runner.invoke(app, ["report", "all", "--db", db, "--out", str(out), "--window", "4"])
    assert r.exit_code == 0, r.output
    assert {"table4.csv", "table5.csv", "posloss.png"} <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine")
    r = runner.invoke(app, ["report", "all", "--db", db, "--out", str(out), "--seed", "43"])
    assert r.exit_code == 0, r.output
    names = {p.name for p in out.iterdir()}
    assert "table1.csv" in names and not {"table4.csv", "table4.sql", "posloss.png"} & names  # seed 43's
    (out / "table4.csv").write_text("mine")  # beside a report whose list does not name it
    fails_in_one_line(["report", "all", "--db", db, "--out", str(out)], tmp_path,
                      "holds table4.csv, not written by a fibctl report (its .fibctl-report does not list them)",
                      monkeypatch, capsys)
    assert (out / "notes.txt").read_text() == "mine"  # not a report's: left alone


def test_report_all_deletes_no_file_but_its_own_whatever_its_list_names(tmp_path):
    """The folder's .fibctl-report (anyone's to edit: --out / as root, say) decides only among
    the names a report writes: a name it lists beyond them, a path out of the folder, a link
    listed, are never deleted or written through."""
    db = _windowed_study(str(tmp_path / "r.db"), seeds=(42,))
    out, outside = tmp_path / "report", tmp_path / "outside.txt"
    out.mkdir()
    outside.write_text("mine")
    (out / "notes.txt").write_text("mine")
    (out / "table4.csv").symlink_to(outside)  # listed, and a name a report writes: the link goes, not its target
    (out / ".fibctl-report").write_text(f"notes.txt\n../outside.txt\n{outside}\ntable4.csv\n.fibctl-report\n")
    r = runner.invoke(app, ["report", "all", "--db", db, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert outside.read_text() == "mine" and (out / "notes.txt").read_text() == "mine"
    assert not (out / "table4.csv").is_symlink()


def test_table4_bins_positions_by_sql_like_the_paper(study):
    t = tables.table4(ro(study))
    fixed, stagger = np.array(position_losses(0.05)), np.array(position_losses(0.0))
    edges = np.linspace(0, N_POS, 9).astype(int)
    expected = [stagger[a:b].mean() for a, b in zip(edges[:-1], edges[1:])]
    f = t.frame.set_index("Row")
    bins = [c for c in t.frame.columns if c not in ("Row", "Run")]
    assert bins[0] == "0-126" and bins[-1] == "895-1022"
    assert f.loc["stagger W8", bins].astype(float).tolist() == pytest.approx(expected)
    assert f.loc["gap", bins].astype(float).tolist() == pytest.approx(
        [(fixed[a:b] - stagger[a:b]).mean() for a, b in zip(edges[:-1], edges[1:])])


def test_no_table_prints_a_negative_zero():
    """Table 4's gap (fixed less stagger) read -0.000 where the two agreed to 3 places; a
    signed change read -0.00 or -0.0 %. Every text format shows the formatter's own zero."""
    frame = pd.DataFrame({"Row": ["gap", "other"], "0-126": [-0.0004, -0.0125], "Δ": [-0.001, 0.5],
                          "change": [-0.04, -3.0], "raw": [-0.0, 1.5]})
    t = tables.Table("table4", "t", frame, "SELECT 1", {"0-126": tables.loss, "Δ": lambda x: f"{x:+.2f}",
                                                        "change": tables.percent})
    assert [render.cell(t, c, v) for c, v in zip(frame.columns[1:], frame.iloc[0, 1:])] == \
        ["0.000", "+0.00", "+0.0 %", "0.0"]
    assert [render.cell(t, c, v) for c, v in zip(frame.columns[1:], frame.iloc[1, 1:])] == \
        ["-0.013", "+0.50", "-3.0 %", "1.5"]
    for fmt in ("rich", "md", "latex"):
        text = render.render(t, fmt)
        assert "-0.000" not in text and "-0.00" not in text and "-0.0 %" not in text, (fmt, text)


def test_table5_seeds_mean_and_population_std(study):
    f = tables.table5(ro(study)).frame
    assert f[["Base", "Schedule"]].values.tolist() == [["fib", "stagger"]]  # the only one with 2+ seeds
    values = [42.0, 41.9, 42.3]
    row = f.iloc[0]
    assert [row["seed 42"], row["seed 43"], row["seed 44"]] == values
    assert row["Mean"] == pytest.approx(np.mean(values))
    assert row["Std"] == pytest.approx(np.std(values, ddof=0))


def test_table5_lists_configurations_by_mean_lowest_first_as_the_paper(tmp_path):
    """The paper's seed table reads its margins down the rows: lowest mean first; equal means
    keep Table 1's order (fixed before learned)."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    means = {("fib", "fixed"): 30.0, ("fib", "learned"): 30.0, ("fib", "stagger"): 25.0, ("pow2", "stagger"): 26.0}
    with engine.begin() as conn:
        for (base, schedule), mean in means.items():
            for seed, delta in ((42, -0.5), (43, 0.5)):
                add_eval(conn, add_run(conn, f"{base}_{schedule}_s{seed}", schedule, base=base, seed=seed),
                         128, mean + delta)
    engine.dispose()
    f = tables.table5(ro(db), window=8)
    assert f.frame[["Base", "Schedule"]].values.tolist() == [["fib", "stagger"], ["pow2", "stagger"],
                                                             ["fib", "fixed"], ["fib", "learned"]]
    assert f.frame["Mean"].tolist() == [25.0, 26.0, 30.0, 30.0]


def test_tables_of_full_measurements_have_no_budget_or_seed_notes(study):
    notes = [n for t in (tables.table1(ro(study)), tables.table3(ro(study)), tables.table5(ro(study)))
             for n in t.notes]
    assert not [n for n in notes if n.startswith(("Fewer tokens", "Fewer seeds"))], notes


def test_a_value_measured_on_fewer_tokens_or_seeds_is_said_under_the_table(tmp_path):
    """A final step measured only by the light evaluation (the study's copy lacked its full one)
    reads noisier than the others: Tables 1, 3 and 5 say so; Table 5 says which seeds a mean
    is over when a replicate has no final value."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        for seed in (42, 43, 44):
            rid = add_run(conn, f"s{seed}", "stagger", window=12, seed=seed)
            for step, length, tokens in ((500, 128, 4096), (600, 128, 1024 if seed == 42 else 4096), (600, 512, 1024)):
                if seed == 44 and step == 600:
                    continue  # no final evaluation
                conn.execute(insert(schema.Evaluation).values(run_id=rid, step=step, dataset="docs_val",
                                                               eval_length=length, tokens=tokens, loss=3.0, ppl=20.0))
        fixed = [add_run(conn, f"f{seed}", "fixed", window=12, seed=seed) for seed in (42, 43, 44)]
        for rid in fixed:
            conn.execute(insert(schema.Evaluation).values(run_id=rid, step=600, dataset="docs_val", eval_length=128,
                                                           tokens=None, loss=3.0, ppl=20.0))  # unknown: no note
    engine.dispose()
    said = ("Fewer tokens: s42 on docs_val at length 128 is read from 1,024 tokens at its final step; "
            "it was measured on up to 4,096 at other steps.")
    assert said in tables.table1(ro(db)).notes
    assert said in tables.table3(ro(db), all_runs=True).notes
    t5 = tables.table5(ro(db))
    assert said in t5.notes and not [n for n in t5.notes if "f42" in n or "fib fixed" in n]
    assert ("Fewer seeds: fib stagger's mean and std are over seeds 42, 43 only (no final docs_val perplexity "
            "for seed 44).") in t5.notes


def test_settings_that_differ_between_a_tables_runs_are_said_under_it(tmp_path):
    """A sweep's runs (`queue add --set train.lr=...`) share base, schedule and W: without a note
    their rows read as one recipe. A micro-batch split with the same tokens per step is not said."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        runs = {"dense": add_run(conn, "dense", "dense"), "fixed": add_run(conn, "fixed", "fixed"),
                "stagger": add_run(conn, "stagger", "stagger", batch_size=8, grad_accum=2),
                "fixed_lr1e-3": add_run(conn, "fixed_lr1e-3", "fixed", lr=1e-3)}
        for rid in runs.values():
            for length in DEMO_LENGTHS:
                add_eval(conn, rid, length, 20.0)
    engine.dispose()
    lr = "Differs between these runs: train.lr: 0.001 (fixed_lr1e-3); 0.003 (the other 3 runs)."
    assert tables.table1(ro(db), dense=True).notes == [lr]
    assert lr in tables.table3(ro(db)).notes
    assert [n for n in tables.table1(ro(db)).notes if n.startswith("Differs")] == [
        "Differs between these runs: train.lr: 0.001 (fixed_lr1e-3); 0.003 (fixed, stagger)."]
    with connect(db).begin() as conn:  # one recipe again: no note
        conn.execute(text("DELETE FROM evaluations WHERE run_id = :r"), {"r": runs["fixed_lr1e-3"]})
    assert not [n for n in tables.table1(ro(db), dense=True).notes if n.startswith("Differs")]
    with connect(db).begin() as conn:  # another preset: every setting it changes is named, a few at most
        conn.execute(text("UPDATE runs SET config_json = :c WHERE name = 'fixed'"), {"c": RunConfig.resolve(
            "fixed", "demo", "micro", schedule="fixed").to_json()})
    notes = [n for n in tables.table1(ro(db), dense=True).notes if n.startswith("Differs")]
    assert notes[:2] == ["Differs between these runs: preset: micro (fixed); tiny (dense, stagger).",
                         "Differs between these runs: model.d_model: 64 (fixed); 192 (dense, stagger)."]
    assert len(notes) == tables.MAX_SETTINGS_SAID + 1 and "9 more setting(s) (model.seq_len" in notes[-1] and "queue show" in notes[-1]


def test_runs_whose_windows_other_samplers_drew_are_said_under_every_table_that_compares_them(tmp_path):
    """A matrix half-trained before fibctl drew windows as the study did: a run resumed from a
    checkpoint of torch's generator keeps its order, so same-seed runs read other windows.
    Tables 1, 3, 4 and 5 say so (runs.sampler); a run never claimed has drawn none."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    drawn = {"fixed": "torch", "stagger": "numpy", "dense": None}
    with engine.begin() as conn:
        for name, sampler in drawn.items():
            rid = add_run(conn, name, name)
            conn.execute(update(schema.Run).where(schema.Run.id == rid).values(
                sampler=sampler, started_at=datetime(2026, 1, 1)))
            for length in DEMO_LENGTHS:
                add_eval(conn, rid, length, 20.0)
            conn.execute(insert(schema.PositionLoss), [dict(run_id=rid, step=600, dataset="docs_val", eval_length=128,
                                                            position=p, mean_loss=3.0, windows=4) for p in range(127)])
            for seed in (43, 44):  # Table 5's replicates, at W=12
                rid = add_run(conn, f"{name}_w12_s{seed}", name, window=12, seed=seed)
                conn.execute(update(schema.Run).where(schema.Run.id == rid).values(
                    sampler="numpy" if seed == 43 else sampler, started_at=datetime(2026, 1, 1)))
                add_eval(conn, rid, 128, 20.0)
    engine.dispose()
    mixed = ("Windows drawn by different samplers, so that runs of one seed read other windows: "
             "numpy's generator, as the study drew them (stagger); torch's generator, as fibctl drew them "
             "before 2026-12-06 (fixed).")
    assert mixed in tables.table1(ro(db)).notes
    assert mixed in tables.table4(ro(db)).notes
    assert ("Windows drawn by different samplers, so that runs of one seed read other windows: "
            "not recorded, trained before fibctl kept it (dense); numpy's generator, as the study drew them "
            "(stagger); torch's generator, as fibctl drew them before 2026-12-06 (fixed).") \
        in tables.table3(ro(db)).notes
    assert [n for n in tables.table5(ro(db)).notes if n.startswith("Windows")] == [
        "Windows drawn by different samplers, so that runs of one seed read other windows: torch's generator, "
        "as fibctl drew them before 2026-12-06 (fixed_w12_s44); numpy's generator, as the study drew them "
        "(the other 3 runs)."]
    with connect(db).begin() as conn:  # one sampler, and a run never claimed (no windows drawn): no note
        conn.execute(update(schema.Run).values(sampler="numpy"))
        conn.execute(update(schema.Run).where(schema.Run.name == "dense").values(sampler=None, started_at=None))
    for table in (tables.table1(ro(db)), tables.table3(ro(db)), tables.table4(ro(db)), tables.table5(ro(db))):
        assert not [n for n in table.notes if n.startswith("Windows")], table.notes


def test_the_shown_sql_reproduces_the_numbers(study):
    t = tables.table5(ro(study))
    frame = run_query(reader_url(study), t.sql)
    assert sorted(frame["ppl"]) == sorted([42.0, 41.9, 42.3, 42.7, 42.1])  # every W12 run; pivot keeps 2+ seeds
    assert ":dataset" not in t.sql and "'fineweb_edu_val'" in t.sql


def test_missing_data_says_what_and_which_command(study, demo, tmp_path):
    empty = str(tmp_path / "empty.db")
    connect(empty).dispose()
    with pytest.raises(FibctlError, match="table1: no seed-42 sparse runs.*fibctl eval NAME"):
        tables.table1(ro(empty))
    with pytest.raises(FibctlError, match="table2: no probe results.*fibctl import-study"):
        tables.table2(ro(demo))
    with pytest.raises(FibctlError, match="table4: no per-position losses.*fib fixed and stagger at W=8"):
        tables.table4(ro(demo))
    # how to train replicates: `queue add --set seed=43` is refused, `queue add --seed 43` is not
    with pytest.raises(FibctlError, match=r"table5: .*two or more seeds.*`fibctl queue add MATRIX --seed 43 --seed 44`"):
        tables.table5(ro(demo))
    short = str(tmp_path / "short.db")
    engine = connect(short)
    with engine.begin() as conn:
        add_eval(conn, add_run(conn, "only_train_length", "fixed"), 128, 25.0)
    with pytest.raises(FibctlError, match=r"only_train_length .*`fibctl eval only_train_length --length 512`"):
        tables.table3(ro(short))


def _example_with(tmp_path: Path, *changes: str) -> str:
    """The demo's numbers (results.db.example) changed in the sqlite3 shell."""
    import shutil

    db = tmp_path / "r.db"
    shutil.copy(Path(__file__).parents[1] / "results.db.example", db)
    with sqlite3.connect(db) as con:
        for change in changes:
            con.execute(change)
    con.close()
    return str(db)


def test_a_perplexity_of_inf_is_shown_as_inf(tmp_path, monkeypatch):
    """A diverged evaluation: the text 'inf' (SQLite keeps that spelling as text) was a
    traceback wherever a table, figure or `queue show` formatted or divided it; a real inf (the
    exp of a loss over 709, as import-study records it) made the extrapolation figure's limits
    infinite. Both read as inf: shown so, drawn as an arrow above the panel, and no warning."""
    import warnings

    from fibctl.reports import figures

    monkeypatch.setenv("COLUMNS", "120")
    db = _example_with(tmp_path, "UPDATE evaluations SET ppl = 'inf' WHERE run_id = 2",
                       "UPDATE evaluations SET ppl = 9e999 WHERE run_id = 3 AND eval_length = 1024")
    engine = ro(db)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's inf / inf warned on stderr
        t1, t3 = tables.table1(engine, dense=True), tables.table3(engine)
        assert figures.extrapolation(engine, tmp_path / "e.png").stat().st_size > 0
    assert dict(zip(t1.frame["Run"], t1.frame["docs_val"]))["fib_fixed_w8"] == np.inf
    assert "│ fib_fixed_w8   │ fib  │ fixed    │ 8 │      inf │" in render.render(t1, "rich")
    rows = {r["Run"]: r for r in t3.frame.to_dict("records")}
    assert [rows["fib_fixed_w8"][n] for n in ("128", "1024")] == [np.inf, np.inf]
    assert np.isnan(rows["fib_fixed_w8"]["Δ at 4x"]) and rows["fib_stagger_w8"]["1024"] == np.inf
    shown = CliRunner().invoke(app, ["queue", "show", "fib_fixed_w8", "--db", db])
    assert shown.exit_code == 0 and "│ docs_val │ inf │ inf │ inf │  inf │" in shown.output, shown.output
    (tmp_path / "every").mkdir()
    every = _example_with(tmp_path / "every", "UPDATE evaluations SET ppl = 'inf'")
    with pytest.raises(FibctlError, match=r"^extrapolation: every perplexity on docs_val is infinite \(seed 42\)"):
        figures.extrapolation(ro(every), tmp_path / "every.png")
    assert not (tmp_path / "every.png").exists()


def test_a_perplexity_of_0_or_below_has_no_loss_in_table3(tmp_path):
    """A perplexity edited by hand to 0 or below: Table 3's loss against it (math.log) was a
    ValueError traceback, in `report table3`, `report all` and the extrapolation figure."""
    db = _example_with(tmp_path, "UPDATE evaluations SET ppl = 0 WHERE run_id = 2",
                       "UPDATE evaluations SET ppl = -1 WHERE run_id = 3")
    rows = {r["Run"]: r for r in tables.table3(ro(db)).frame.to_dict("records")}
    assert np.isnan(rows["fib_fixed_w8"]["vs 1x loss"]) and np.isnan(rows["fib_stagger_w8"]["vs 1x loss"])
    assert rows["dense"]["vs 1x loss"] == pytest.approx(0.795, abs=1e-3)  # the README's


def test_renderings_bold_the_best_and_keep_raw_numbers(study):
    t = tables.table1(ro(study))
    md = render.render(t, "md")
    assert "| f13__fib_stagger_w12 | fib | stagger | 12 | **5.30** | **42.00** |" in md
    latex = render.render(t, "latex")
    assert "\\toprule" in latex and "\\midrule" in latex and "\\bottomrule" in latex
    assert "f13\\_\\_fib\\_stagger\\_w12 & fib & stagger & 12 & \\textbf{5.30} & \\textbf{42.00} \\\\" in latex
    back = pd.read_csv(io.StringIO(render.render(t, "csv")))
    assert back.set_index("Run").loc["f11__fib_stagger_w8", "FineWeb-Edu"] == 42.5
    records = json.loads(render.render(t, "json"))
    assert records[0]["Run"] == "f06__fib_fixed_w8" and records[0]["FineWeb-Edu"] == 44.0
    text = render.render(t, "rich")
    assert "Table 1" in text and "42.00" in text
    with pytest.raises(FibctlError, match="unknown format 'html'"):
        render.render(t, "html")


def test_latex_sets_a_negative_number_with_a_minus_sign(tmp_path):
    """A negative number's sign was a hyphen in LaTeX's text mode, half as long as the plus
    beside it (Table 3's -0.7 % under +82.3 %); a cell that is only '-' (no base) stays text."""
    tex = render.render(tables.table3(ro(_example_with(tmp_path))), "latex")
    assert "fib\\_fixed\\_w8 & fib & fixed & 8 & 28.01 & 27.53 & 27.82 & 28.40 & \\textbf{$-$0.7 \\%} & 3.318 & " \
           "$-$0.014 \\\\" in tex, tex
    assert "dense & - & dense & - & 28.73" in tex and "+82.3 \\%" in tex, tex


def test_cli_report_formats_show_sql_and_all(study, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["report", "table3", "--db", study, "--format", "csv", "--show-sql"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("WITH final AS") and "ref_e0000,-,dense,,30.0,45.0,90.0,200.0" in r.output
    # wide: the label is the database's name, longer on PostgreSQL; narrow terminals are
    # test_a_long_compare_label_wraps_headers_and_cuts_no_cell's
    r = runner.invoke(app, ["report", "table1", "--db", study, "--compare", study], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "Δ FineWeb-Edu" in r.output and "+0.00" in r.output
    out = tmp_path / "report"
    r = runner.invoke(app, ["report", "all", "--db", study, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"; all of them on one page: {out / 'index.html'}" in r.stdout  # where to look next
    names = {p.name for p in out.iterdir()}
    for n in range(1, 6):
        assert {f"table{n}.{ext}" for ext in ("txt", "md", "tex", "csv", "json", "sql")} <= names
    # the small study records no alpha trajectories for learned LM runs, only the probe's
    assert {"extrapolation.png", "posloss.png", "curves.png", "coverage.png", "alphas.png"} <= names
    if "://" in study:
        return  # the rest is about files, the same on either backend
    # again into the same folder, where a table and a figure are now links to files outside
    # it: the links are replaced by the report's files, and what they pointed to is untouched
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("table1.md", "extrapolation.png"):
        (outside / name).write_text("precious")
        (out / name).unlink()
        (out / name).symlink_to(outside / name)
    r = runner.invoke(app, ["report", "all", "--db", study, "--out", str(out)])
    assert r.exit_code == 0, r.output
    for name in ("table1.md", "extrapolation.png"):
        assert (outside / name).read_text() == "precious" and not (out / name).is_symlink()
    assert (out / "table1.md").read_text().startswith("**Table 1")
    assert {p.name for p in out.iterdir()} == names  # no part-written file left beside them
    umask = os.umask(0)
    os.umask(umask)
    assert {(out / n).stat().st_mode & 0o777 for n in names} == {0o666 & ~umask}


def test_a_long_compare_label_wraps_headers_and_cuts_no_cell(study):
    engine = ro(study)
    for n in range(14, 34):  # labels of 22-25 characters used to cut the last column at 80
        label = "x" * n
        t = tables.table1(engine, compare=engine, compare_label=label)
        text = render.to_text(t, 80)
        assert max(map(len, text.splitlines())) <= 80
        # every value whole: 7 runs, a +0.00 difference for each of the two datasets
        assert text.count(" +0.00 │") == 2 * len(t.frame) == 14 and label in text, label


@pytest.mark.parametrize("width", [20, 24, 30, 36])
def test_a_value_too_wide_beside_the_run_names_folds_and_the_names_stay_readable(width):
    """At 30 columns a value of 24 characters in a later column drew the run column 0 or 1
    wide (a fuzz found it): the value folds now, sharing the room with the names, and every
    character of both is still there."""
    for length in (12, 20, 24, 40):
        value = "".join(chr(ord("a") + k % 26) for k in range(length))
        names = ["fib_fixed_w8", "f06__fib_stagger_w8"]
        frame = pd.DataFrame({"Run": names, "Note": [value, "-"], "ppl": [28.01, 27.8]})
        text = render.to_text(tables.Table("t", "t", frame, "SELECT 1", formats={"ppl": "{:.2f}".format}), width)
        lines = text.splitlines()
        assert max(map(len, lines)) <= width, text
        top = next(line for line in lines if line.startswith("┏"))
        run_width = len(top.split("┳")[0]) - 3  # less the corner and the cell's two spaces
        assert run_width >= min(max(map(len, names)), (width - 7) // 2), text
        first = lines[:[n for n, line in enumerate(lines) if line.startswith("┏")][1:2][0]] \
            if text.count("┏") > 1 else lines  # the part that holds the Note column
        rows = [line.split("│") for line in first if line.startswith("│")]
        assert "".join(cells[1].strip() for cells in rows) == "".join(names), text
        assert "".join(cells[2].strip() for cells in rows).startswith(value), text


def test_cli_report_on_a_database_without_the_data_exits_2(demo):
    r = subprocess.run([sys.executable, "-m", "fibctl", "report", "table2", "--db", demo],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "table2: no probe results" in r.stderr and "Traceback" not in r.stderr


def test_report_tables_print_markup_in_their_data_as_written():
    """Rich markup in a title, column name, cell or note is text, not styling (audit item 8)."""
    t = tables.Table("t", "[i]t[/i]", pd.DataFrame({"[b]x[/b]": ["[/]", "\\[y]", "[bold red]boom[/bold red]"]}),
                     "SELECT 1", notes=["[/] note"])
    text = render.to_text(t, 80)
    for shown in ("[i]t[/i]", "[b]x[/b]", "[/]", "\\[y]", "[bold red]boom[/bold red]", "[/] note"):
        assert shown in text


def test_terminal_tables_show_control_characters_escaped():
    """A value from the database is shown, not obeyed: ESC would colour or clear the terminal,
    CR overwrite the line, a bidi override reorder it. The .md/.csv/.json files keep it exact."""
    t = tables.Table("t", "title\x1b[2J", pd.DataFrame({"a\x1b": ["x\x1b[31my\rz", "\u202eab"]}), "SELECT 1",
                     notes=["note\x07"])
    text = render.to_text(t, 80)
    for shown in ("title\\x1b[2J", "a\\x1b", "x\\x1b[31my\\rz", "\\u202eab", "note\\x07"):
        assert shown in text, shown
    assert not any(c in text for c in "\x1b\r\x07\u202e")
    assert json.loads(render.render(t, "json")) == [{"a\x1b": "x\x1b[31my\rz"}, {"a\x1b": "\u202eab"}]


# ----------------------------------------------------------------------------- bad input: one line, exit 2


def snapshot(root: Path) -> dict[str, str | bool]:
    """Every path under `root`, folders too, with each file's checksum; but SQLite's shared-memory
    index and an empty write-ahead log, which a reader's connection makes and which hold no data."""
    return {str(p.relative_to(root)): p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if not p.name.endswith("-shm")
            and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


def fails_in_one_line(args: list[str], folder: Path, words: str, monkeypatch, capsys) -> str:
    """`fibctl ARGS` run in `folder` through the real entry point: exit 2, one line on stderr
    holding `words`, no traceback, nothing under `folder` created or changed. The line."""
    from fibctl.cli import main
    before = snapshot(folder)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2, out
    assert "Traceback" not in out.err + out.out
    assert len(out.err.strip().splitlines()) == 1 and words in out.err, out.err
    assert snapshot(folder) == before
    return out.err


@pytest.fixture
def report_folder(tmp_path) -> Path:
    """The demo's runs (with alphas for one) in r.db; d.db without its runs table, c.db without a
    column; afile, a file where a folder would be."""
    _fill_demo(str(tmp_path / "r.db"))
    engine = connect(str(tmp_path / "r.db"))
    with engine.begin() as conn:
        conn.execute(insert(schema.Alpha), [dict(run_id=3, step=600, layer=i, alpha=1.0) for i in range(2)])
    engine.dispose()
    for name, change in (("d.db", "DROP TABLE runs"), ("c.db", "ALTER TABLE evaluations DROP COLUMN tokens")):
        (tmp_path / name).write_bytes((tmp_path / "r.db").read_bytes())
        with sqlite3.connect(tmp_path / name) as con:  # foreign keys off, as in the sqlite3 shell
            con.execute(change)
        con.close()
    (tmp_path / "afile").write_text("a file, not a folder\n")
    return tmp_path


@pytest.mark.parametrize("args, words", [
    # a matrix, held-out set or run the database lacks, or '' (which read as "every run" / the default)
    (["report", "all", "-o", "out", "--matrix", "nope"], "--matrix 'nope': no runs of that matrix in r.db"),
    (["report", "all", "-o", "out", "--dataset", "nope"], "--dataset 'nope': no evaluations on that set"),
    (["report", "table1", "--matrix", ""], "--matrix '': no runs"),
    (["figure", "curves", "--seed", "99", "-o", "c.png"], "curves: no evaluations of seed-99 runs on"),
    (["report", "table3", "--dataset", ""], "--dataset '': no evaluations"),
    (["figure", "alphas", "--run", "", "-o", "a.png"], "--run '': no run of that name"),
    (["figure", "alphas", "--run", "nope", "-o", "a.png"], "--run 'nope': no run of that name"),
    (["report", "table1", "--compare", ""], "--compare is empty"),
    (["report", "table1", "--db", ""], "--db is empty"),
    # a database changed by hand: a table or a column dropped
    (["report", "table1", "--db", "d.db"], "d.db lacks table runs"),
    (["report", "table1", "--compare", "d.db"], "d.db lacks table runs"),
    (["report", "all", "--db", "d.db", "-o", "out"], "d.db lacks table runs"),
    (["figure", "curves", "--db", "d.db", "-o", "c.png"], "d.db lacks table runs"),
    (["report", "table3", "--db", "c.db"], "c.db lacks column evaluations.tokens"),
    # --out: empty (the current folder), or under a file
    (["report", "all", "-o", ""], "--out is empty"),
    (["report", "all", "-o", " "], "--out is empty"),
    (["figure", "coverage", "-o", ""], "--out is empty"),
    (["figure", "coverage", "-o", "afile/x.png"], "cannot write afile/x.png: afile is not a folder"),
    (["figure", "curves", "-o", "afile/sub/x.png"], "afile is not a folder"),
    (["report", "all", "-o", "afile/sub"], "cannot write the report into afile/sub: afile is not a folder"),
])
def test_report_and_figure_bad_input_is_one_line_exit_2_and_writes_nothing(args, words, report_folder,
                                                                           monkeypatch, capsys):
    args = args if "--db" in args else [*args, "--db", "r.db"]
    fails_in_one_line(args, report_folder, words, monkeypatch, capsys)


def test_report_all_without_data_writes_nothing(tmp_path):
    """Only coverage (drawn from the schedule, not the database) would be written: no report."""
    empty = str(tmp_path / "empty.db")
    connect(empty).dispose()
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["report", "all", "--db", empty, "-o", str(out)])
    assert r.exit_code != 0 and "nothing to report" in str(r.exception), r.output
    assert not out.exists()


def test_control_characters_from_a_database_are_shown_in_markdown_and_latex_never_obeyed():
    """A run named with an escape sequence (a database from elsewhere) reached the terminal
    raw through `report --format md` (it sets the window's title; others clear the screen);
    the rich table already showed it escaped. CSV and JSON stay exact, as `fibctl sql`'s do."""
    from fibctl.reports.render import render
    from fibctl.reports.tables import Table

    name = "\x1b]0;pwned\x07\nrun|x"
    table = Table("t", "title \x1b[2J", pd.DataFrame({"Run": [name], "ppl": [1.5]}), "SELECT 1",
                  notes=["note \x1b[31m"])
    for fmt in ("md", "latex", "rich"):
        out = render(table, fmt)
        assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07" in out.replace("\\textbackslash{}",
                                                                                          "\\").replace("{]}", "]"), (fmt, out)
    assert render(table, "md").count("\n") == 7  # title, blank, header, rule, the row, blank, note
    assert name in pd.read_csv(io.StringIO(render(table, "csv")))["Run"].tolist()


def test_markup_from_a_database_is_text_in_markdown_and_latex():
    """A run named '<script>...' (a database from elsewhere) was raw HTML in the Markdown, run
    by a renderer that passes HTML through; in LaTeX a row starting with '[' was read as the
    row end before it's optional argument ('\\\\ [bold]': an error), and a blank line in a name
    ended the cell or the caption with one."""
    from fibctl.reports.render import render
    from fibctl.reports.tables import Table

    names = ["<script>alert(1)</script>", "\\<img src=x onerror=alert(1)>", "[bold]\n\nx", "&lt;b>"]
    table = Table("t", "title <b>", pd.DataFrame({"Run": names, "ppl": [1.5, 2.5, 3.5, 4.5]}), "SELECT 1")
    md = render(table, "md")
    assert "<" not in md and md.count("&lt;") == 4 and "| &amp;lt;b> |" in md, md  # '&lt;' shown as written
    tex = render(table, "latex")
    rows = tex.split("\\midrule\n")[1].split("\\bottomrule")[0].splitlines()
    assert len(rows) == 4 and rows[2] == "{[}bold{]}  x & 3.5 \\\\", tex
    assert "\n\n" not in tex and tex.count("[") == 1 + tex.count("{[}"), tex  # 1: \\begin{table}[t]


@pytest.mark.parametrize("columns", [60, 40])
def test_a_continued_tables_title_and_notes_wrap_at_the_terminals_width(study, columns):
    """Table 2's notes were the caption of its last part, wrapped at that part's width: 19
    columns (Depth and Scored), at 60 columns as at 40; each part's title at its own width."""
    import textwrap

    table = tables.table2(ro(study))
    done = CliRunner().invoke(app, ["report", "table2", "--db", study], env={"COLUMNS": str(columns)})
    assert done.exit_code == 0 and "(continued)" in done.output, done.output
    lines = [line.rstrip() for line in done.output.splitlines()]
    assert max(map(len, lines)) <= columns, done.output
    notes = lines[len(lines) - 1 - lines[::-1].index(next(l for l in lines[::-1] if l.startswith("└"))) + 1:]
    assert len(notes) == sum(len(textwrap.wrap(note, columns)) for note in table.notes), done.output
    assert " ".join(" ".join(notes).split()) == " ".join(table.notes)
    for title in (table.title, f"{table.title} (continued)"):
        shown = textwrap.wrap(title, columns)
        assert any(lines[i:i + len(shown)] == shown for i in range(len(lines))), (shown, done.output)


@pytest.mark.parametrize("columns", [40, 30])
def test_a_header_beside_long_run_names_is_never_cut(study, columns):
    """Where one column did not fit beside the run names, rich cut its header ('Schedul' /
    'e', 'TinyStori' / 'es'): the names fold within their column instead, as in `queue ls`."""
    done = CliRunner().invoke(app, ["report", "table1", "--db", study], env={"COLUMNS": str(columns)})
    assert done.exit_code == 0, done.output
    assert max(map(len, done.output.splitlines())) <= columns and "…" not in done.output, done.output
    headers = {word for line in done.output.splitlines() if line.startswith("┃") for word in line.split("┃")}
    headers = {h.strip() for h in headers}
    for column in tables.table1(ro(study)).frame.columns[1:]:
        assert set(column.split()) <= headers, (column, done.output)


def test_a_run_read_before_it_finished_is_named_in_the_notes(tmp_path):
    """A run queued again after a stop has no final step: the tables read its latest
    evaluation at the training length, which must not pass for a final one."""
    db = str(tmp_path / "r.db")
    engine = connect(db)
    with engine.begin() as conn:
        for schedule, ppls in DEMO_PPL.items():
            rid = add_run(conn, f"demo_{schedule}", schedule)
            for length, value in zip(DEMO_LENGTHS, ppls):
                add_eval(conn, rid, length, value, step=300 if schedule == "stagger" else 600)
        conn.execute(text("UPDATE runs SET status = 'queued', final_step = NULL WHERE name = 'demo_stagger'"))
    note = "Not finished: demo_stagger (queued, step 300): read at the latest evaluation, not a final one."
    assert note in tables.table1(ro(db)).notes and note in tables.table3(ro(db)).notes
    with engine.begin() as conn:  # finished: its final step is recorded, and the note goes
        conn.execute(text("UPDATE runs SET status = 'done', final_step = 300 WHERE name = 'demo_stagger'"))
    assert not [n for n in tables.table1(ro(db)).notes + tables.table3(ro(db)).notes if "finished" in n]
