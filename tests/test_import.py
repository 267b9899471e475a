"""`fibctl import-study`: the published study's files, in their own layout, into fibctl's schema.

The tests build a small study (SQLite + the two JSON dumps) in the published layout
(docs/method.md, "The published files"); they never read files outside the repository.
"""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from fibctl.db.engine import connect
from fibctl.errors import FibctlError
from fibctl.db.importer import import_study, study_run

STUDY_SCHEMA = """
CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, run_dir TEXT NOT NULL,
    candidate_id TEXT, variant_or_baseline TEXT NOT NULL, phase INTEGER NOT NULL, config_json TEXT NOT NULL,
    seed INTEGER NOT NULL, d_model INTEGER NOT NULL, n_layers INTEGER NOT NULL, params_effective INTEGER,
    tokens_trained INTEGER, status TEXT NOT NULL DEFAULT 'pending', started_at TEXT, ended_at TEXT,
    wall_seconds REAL, failure_reason TEXT, created_at TEXT NOT NULL);
CREATE TABLE metrics (run_id INTEGER NOT NULL, step INTEGER NOT NULL, dataset TEXT NOT NULL, ppl REAL,
    loss REAL, eval_tokens INTEGER, recorded_at TEXT NOT NULL, PRIMARY KEY (run_id, step, dataset));
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, ts TEXT NOT NULL, kind TEXT NOT NULL,
    message TEXT NOT NULL, payload_json TEXT);
CREATE TABLE eval_results (id INTEGER PRIMARY KEY AUTOINCREMENT, run_id INTEGER, step INTEGER NOT NULL,
    model_size INTEGER NOT NULL, eval_name TEXT NOT NULL, metric TEXT NOT NULL, value REAL NOT NULL,
    recorded_at TEXT NOT NULL);
CREATE TABLE retrieval_results (source TEXT NOT NULL, mech TEXT NOT NULL, depth INTEGER NOT NULL,
    seed INTEGER NOT NULL, staggered INTEGER NOT NULL, train_d INTEGER NOT NULL, distance INTEGER NOT NULL,
    kind TEXT NOT NULL, acc REAL NOT NULL, alphas TEXT, peak_gb REAL, src_file TEXT, extra TEXT,
    PRIMARY KEY (source, mech, depth, seed, staggered, train_d, distance, kind));
"""

# (title, status, seed, kind, {dataset: final ppl}); the study's last step here is 1000
STUDY_RUNS = [
    ("f06__fib_fixed_w8", "done", 42, "variant", {"fineweb_edu_val": 44.0, "tinystories_val": 5.5}),
    ("f11__fib_stagger_w8", "failed", 42, "variant", {"fineweb_edu_val": 99.0}),
    ("f11__fib_stagger_w8", "done", 42, "variant", {"fineweb_edu_val": 42.5, "tinystories_val": 5.4}),
    ("f02__fib_learned_w8", "done", 42, "variant", {"fineweb_edu_val": 43.7, "tinystories_val": 5.45}),
    ("f13__fib_stagger_w12", "done", 42, "variant", {"fineweb_edu_val": 42.0, "tinystories_val": 5.3}),
    ("f17__fib_hdc_w12", "done", 42, "variant", {"fineweb_edu_val": 42.1, "tinystories_val": 5.31}),
    ("f09__logsparse_w8", "done", 42, "variant", {"fineweb_edu_val": 44.8, "tinystories_val": 5.67}),
    ("f21__logsparse_stagger_w12", "done", 42, "variant", {"fineweb_edu_val": 42.7, "tinystories_val": 5.38}),
    ("g03__fib_stagger_w12_s43", "done", 43, "variant", {"fineweb_edu_val": 41.9, "tinystories_val": 5.29}),
    ("h02__fib_stagger_w12_s44", "done", 44, "variant", {"fineweb_edu_val": 42.3, "tinystories_val": 5.32}),
    ("ref_e0000", "pending", 42, "reference", {}),
    ("ref_e0030", "pending", 42, "reference", {}),
]
FINAL = 1000
N_POS = 1023  # predicted positions of a 1024 window
F11 = "(SELECT id FROM runs WHERE title = 'f11__fib_stagger_w8' AND status = 'done')"  # its done attempt


def position_losses(offset: float) -> list[float]:
    """A loss curve falling with position (plus an offset per run)."""
    return [round(3.7 + offset + 0.5 / (1 + p / 50), 6) for p in range(N_POS)]


def make_study(folder: Path) -> tuple[Path, Path, Path]:
    """A small copy of the published study: fib.db, lenextrap.json, posloss.json."""
    fib_db = folder / "fib.db"
    conn = sqlite3.connect(fib_db)
    conn.executescript(STUDY_SCHEMA)
    t = "2026-06-15T21:14:09.303911+00:00"
    for title, status, seed, kind, final in STUDY_RUNS:
        cur = conn.execute(
            "INSERT INTO runs (title, run_dir, variant_or_baseline, phase, config_json, seed, d_model, "
            "n_layers, params_effective, tokens_trained, status, started_at, ended_at, wall_seconds, created_at)"
            " VALUES (?, ?, ?, 2, '{}', ?, 512, 16, 60850688, 425984000, ?, ?, ?, 9000.5, ?)",
            (title, f"K:\\x\\{title}", kind, seed, status, t, t, t))
        rid = cur.lastrowid
        for ds, ppl in final.items():
            conn.execute("INSERT INTO metrics VALUES (?, 500, ?, ?, ?, 262144, ?)",
                         (rid, ds, ppl + 3, math.log(ppl + 3), t))
            conn.execute("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, 1048576, ?)",
                         (rid, FINAL, ds, ppl, math.log(ppl), t))
        if status == "done" or title == "ref_e0000":
            for step, value in ((500, 0.01), (FINAL, 0.02), (FINAL, 0.03)):  # the last measurement wins
                conn.execute("INSERT INTO eval_results (run_id, step, model_size, eval_name, metric, value, "
                             "recorded_at) VALUES (?, ?, 512, 'lambada', 'top1_acc', ?, ?)", (rid, step, value, t))
    for depth, seed, staggered, accs, alphas in [
        (2, 0, 0, (0.75, 0.46), [1.035, 0.928]), (2, 1, 0, (0.01, 0.0), [1.014, 0.983]),
        (2, 0, 1, (1.0, 0.0), [0.588, 1.389]), (2, 1, 1, (0.98, 0.2), [0.557, 1.361]),
    ]:
        for distance, acc in zip((200, 350), accs):
            conn.execute("INSERT INTO retrieval_results VALUES ('marked', 'fib_blur', ?, ?, ?, -1, ?, 'target', "
                         "?, ?, 3.1, 'marked_union.json', '{}')",
                         (depth, seed, staggered, distance, acc, json.dumps(alphas)))
    conn.execute("INSERT INTO retrieval_results VALUES ('sweep', 'dense', 2, 0, -1, 55, 55, 'trained', 1.0, "
                 "'[]', 0.4, 'coverage_sweep.json', '{}')")
    conn.commit()
    conn.close()
    extrap = {
        "ref_e0000": {"1024": {"fineweb_edu_val": 30.0}, "2048": {"fineweb_edu_val": 45.0},
                      "4096": {"fineweb_edu_val": 90.0}},
        "f06__fib_fixed_w8": {"1024": {"fineweb_edu_val": 44.0}, "4096": {"fineweb_edu_val": 43.0}},
        "f11__fib_stagger_w8": {"1024": {"fineweb_edu_val": 42.5}, "2048": {"fineweb_edu_val": 42.0},
                                "4096": {"fineweb_edu_val": 41.65}},
        "f13__fib_stagger_w12": {"1024": {"fineweb_edu_val": 42.0}, "4096": {"fineweb_edu_val": 41.4}},
    }
    posloss = {
        "f06__fib_fixed_w8": {"fineweb_edu_val": {"per_position": position_losses(0.05), "binned": [],
                                                  "n_windows": 488, "seq_len": 1024}},
        "f11__fib_stagger_w8": {"fineweb_edu_val": {"per_position": position_losses(0.0), "binned": [],
                                                    "n_windows": 488, "seq_len": 1024}},
    }
    (folder / "lenextrap.json").write_text(json.dumps(extrap))
    (folder / "posloss.json").write_text(json.dumps(posloss))
    return fib_db, folder / "lenextrap.json", folder / "posloss.json"


def imported(folder: Path, db: str | None = None):
    """A fibctl database (`db`, or results.db in `folder`) holding the small study, and the
    study's paths."""
    files = make_study(folder)
    engine = connect(db or str(folder / "results.db"))
    import_study(engine, *files)
    return engine, files


def rows(engine, sql: str, **params) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql), params)]


def test_run_names_map_to_base_schedule_window_seed():
    cases = {
        "f13__fib_stagger_w12": ("fib", "stagger", 12, 42),
        "g03__fib_stagger_w12_s43": ("fib", "stagger", 12, 43),
        "f09__logsparse_w8": ("pow2", "fixed", 8, 42),
        "h04__logsparse_stagger_w12_s44": ("pow2", "stagger", 12, 44),
        "f14__fib_hdc_w6": ("fib", "coprime", 6, 42),
        "f01__fib_learned_w6": ("fib", "learned", 6, 42),
        "f05__fib_fixed_w6": ("fib", "fixed", 6, 42),
        "ref_e0000": (None, "dense", None, 42),
    }
    for title, expected in cases.items():
        r = study_run(title)
        assert (r.base, r.schedule, r.window, r.seed) == expected, title
    assert study_run("ref_e0084") is None


def test_import_maps_runs_and_keeps_the_last_done_attempt(tmp_path, db_url):
    engine, _ = imported(tmp_path, db_url)
    runs = {r[0]: r[1:] for r in rows(engine, "SELECT name, base, schedule, \"window\", seed, matrix, preset, "
                                              "train_length, status, source, attempts, final_step FROM runs "
                                              "WHERE matrix = 'paper'")}
    assert runs["f11__fib_stagger_w8"] == ("fib", "stagger", 8, 42, "paper", "paper", 1024, "done", "fib.db", 2, FINAL)
    assert runs["f09__logsparse_w8"][:4] == ("pow2", "fixed", 8, 42)
    assert runs["f17__fib_hdc_w12"][:4] == ("fib", "coprime", 12, 42)
    assert runs["g03__fib_stagger_w12_s43"][:4] == ("fib", "stagger", 12, 43)
    assert runs["ref_e0000"][:4] == (None, "dense", None, 42)
    assert "ref_e0030" not in runs  # a reference outside the study's matrix
    # the failed attempt's 99.0 is not imported; the done attempt's values are
    assert rows(engine, "SELECT e.step, e.ppl, e.tokens FROM evaluations e JOIN runs r ON r.id = e.run_id "
                        "WHERE r.name = 'f11__fib_stagger_w8' AND e.dataset = 'fineweb_edu_val' "
                        "AND e.eval_length = 1024 ORDER BY e.step") == [(500, 45.5, 262144), (FINAL, 42.5, 1048576)]
    config = json.loads(rows(engine, "SELECT config_json FROM runs WHERE name = 'f11__fib_stagger_w8'")[0][0])
    assert (config["model"]["schedule"], config["model"]["window"], config["model"]["n_layers"]) == ("stagger", 8, 16)
    # the study drew its windows from numpy's generator, as fibctl does (runs.sampler); a probe
    # model draws none
    assert rows(engine, "SELECT DISTINCT matrix, sampler FROM runs ORDER BY matrix") == [
        ("paper", "numpy"), ("probe", None)]


def _without_keys(fib_db: Path, table: str) -> None:
    """The study's `table` as a copy without its primary key (and NOT NULLs) could hold it."""
    with sqlite3.connect(fib_db) as study:
        study.executescript(f"CREATE TABLE copy AS SELECT * FROM {table}; DROP TABLE {table}; "
                            f"ALTER TABLE copy RENAME TO {table};")


def _final_fineweb(engine, run: str) -> list[tuple]:
    return rows(engine, "SELECT e.ppl, e.tokens FROM evaluations e JOIN runs r ON r.id = e.run_id "
                        "WHERE r.name = :run AND e.step = :s AND e.dataset = 'fineweb_edu_val' "
                        "AND e.eval_length = 1024", run=run, s=FINAL)


def test_a_step_measured_twice_keeps_the_measurement_on_most_tokens(tmp_path, db_url):
    """Table 1 is read at 1,048,576 tokens: a copy of metrics without its key that also holds
    the periodic 262,144-token check at the final step (recorded after) does not replace it."""
    fib_db, extrap, posloss = make_study(tmp_path)
    _without_keys(fib_db, "metrics")
    with sqlite3.connect(fib_db) as study:
        study.execute("INSERT INTO metrics SELECT run_id, step, dataset, ppl + 1, loss, 262144, recorded_at "
                      f"FROM metrics WHERE run_id = {F11} AND step = {FINAL}")
    engine = connect(db_url)
    import_study(engine, fib_db, extrap, posloss)
    assert _final_fineweb(engine, "f11__fib_stagger_w8") == [(42.5, 1048576)]


def test_the_columns_read_are_the_ones_docs_name():
    from fibctl.db.importer import EXPECTED
    docs = (Path(__file__).parent.parent / "docs" / "method.md").read_text()
    published = " ".join(docs.split("## The published files")[1].split("\n## ")[0].split())
    for table, columns in EXPECTED.items():
        assert f"`{table}` ({', '.join(columns)})" in published, table


def test_a_name_without_its_seed_takes_the_seed_fib_db_records(tmp_path, db_url):
    """The name's seed (`_s43`) is the study's naming; a copy that drops it still records the
    seed in runs.seed, and Table 5 must not file that run's numbers under seed 42."""
    fib_db, _, _ = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        study.execute("UPDATE runs SET title = 'g03__fib_stagger_w12' WHERE title = 'g03__fib_stagger_w12_s43'")
    engine = connect(db_url)
    import_study(engine, fib_db)
    [(seed, data_seed, config)] = rows(engine, "SELECT seed, data_seed, config_json FROM runs "
                                               "WHERE name = 'g03__fib_stagger_w12'")
    assert (seed, data_seed, json.loads(config)["data_seed"]) == (43, 43, 43)


def test_two_perplexities_on_as_many_tokens_stop_the_import(tmp_path, db_url):
    """A copy of metrics without its key holding each measurement twice imports; a newer
    layout whose metrics tell rows apart by a column the importer does not read (here the
    length) stops it, rather than one of the two standing in Table 1 by row order."""
    fib_db, extrap, posloss = make_study(tmp_path)
    _without_keys(fib_db, "metrics")
    with sqlite3.connect(fib_db) as study:
        study.execute("INSERT INTO metrics SELECT * FROM metrics")
    engine = connect(db_url)
    import_study(engine, fib_db, extrap, posloss)
    assert _final_fineweb(engine, "f11__fib_stagger_w8") == [(42.5, 1048576)]
    before = _dump(engine)
    with sqlite3.connect(fib_db) as study:
        study.executescript("ALTER TABLE metrics ADD COLUMN seq_len INTEGER DEFAULT 1024; "
                            "INSERT INTO metrics SELECT DISTINCT run_id, step, dataset, ppl * 3, loss + 1.1, "
                            f"eval_tokens, recorded_at, 4096 FROM metrics WHERE run_id = {F11} AND step = {FINAL};")
    with pytest.raises(FibctlError, match=r"^study database fib.db: metrics for run 'f11__fib_stagger_w8' step "
                                          r"1000 dataset '\w+': two perplexities on 1,048,576 tokens "
                                          r"\(\d+\.?\d* and \d+\.?\d*\); expected one$"):
        import_study(engine, fib_db, extrap, posloss)
    assert _dump(engine) == before


def _wal_study(folder: Path) -> Path:
    """The small study as the published fib.db is: a WAL database, no connection open."""
    fib_db, _, _ = make_study(folder)
    with sqlite3.connect(fib_db) as study:
        study.execute("PRAGMA journal_mode=WAL")
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("fib.db")) == ["fib.db"]
    return fib_db


def test_the_study_database_is_read_without_a_file_made_beside_it(tmp_path, db_url):
    """A read-only connection to a WAL database makes -wal and -shm files (and fails where
    it cannot: a read-only disk or folder); with nothing in a -wal the study is read immutable."""
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    fib_db = _wal_study(study_dir)
    before = {p.name: p.stat().st_mtime_ns for p in study_dir.iterdir()}
    engine = connect(db_url)
    import_study(engine, fib_db)
    assert {p.name: p.stat().st_mtime_ns for p in study_dir.iterdir()} == before
    assert rows(engine, "SELECT COUNT(*) FROM runs WHERE source = 'fib.db'") == [(10 + 4,)]


def test_rows_still_in_the_studys_wal_file_are_read(tmp_path, db_url):
    fib_db = _wal_study(tmp_path)
    writer = sqlite3.connect(fib_db)  # held open: its last rows stay in fib.db-wal
    try:
        writer.execute("PRAGMA wal_autocheckpoint=0")
        with writer:
            writer.execute(f"UPDATE metrics SET ppl = 40.5 WHERE run_id = {F11} AND step = {FINAL} "
                           "AND dataset = 'fineweb_edu_val'")
        assert (tmp_path / "fib.db-wal").stat().st_size > 0
        engine = connect(db_url)
        import_study(engine, fib_db)
        assert _final_fineweb(engine, "f11__fib_stagger_w8") == [(40.5, 1048576)]
    finally:
        writer.close()


def test_a_metrics_row_with_a_loss_but_no_perplexity_gets_exp_loss(tmp_path, db_url):
    fib_db, _, _ = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        study.execute(f"UPDATE metrics SET ppl = NULL WHERE run_id = {F11} AND step = {FINAL}")
    engine = connect(db_url)
    import_study(engine, fib_db)
    [(ppl, tokens)] = _final_fineweb(engine, "f11__fib_stagger_w8")
    assert ppl == pytest.approx(42.5) and tokens == 1048576


def test_a_later_done_attempt_without_metrics_does_not_hide_the_results(tmp_path, db_url):
    fib_db, _, _ = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        study.execute("INSERT INTO runs (title, run_dir, variant_or_baseline, phase, config_json, seed, d_model, "
                      "n_layers, status, created_at) SELECT title, run_dir, variant_or_baseline, phase, "
                      "config_json, seed, d_model, n_layers, 'done', created_at FROM runs "
                      "WHERE title = 'f11__fib_stagger_w8' AND status = 'done'")
    engine = connect(db_url)
    import_study(engine, fib_db)
    assert _final_fineweb(engine, "f11__fib_stagger_w8") == [(42.5, 1048576)]
    assert rows(engine, "SELECT attempts FROM runs WHERE name = 'f11__fib_stagger_w8'") == [(3,)]


def _second_done_attempt(fib_db: Path, title: str, *metrics: tuple) -> None:
    """`title`'s done attempt registered again, holding only `metrics` (step, dataset, ppl, tokens)."""
    with sqlite3.connect(fib_db) as study:
        cur = study.execute("INSERT INTO runs (title, run_dir, variant_or_baseline, phase, config_json, seed, "
                            "d_model, n_layers, status, created_at) SELECT title, run_dir, variant_or_baseline, "
                            "phase, config_json, seed, d_model, n_layers, 'done', created_at FROM runs "
                            "WHERE title = ? AND status = 'done'", (title,))
        for step, ds, ppl, tokens in metrics:
            study.execute("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, '2026-06-16')",
                          (cur.lastrowid, step, ds, ppl, math.log(ppl), tokens))


def test_a_later_done_attempt_measured_only_lightly_does_not_replace_the_full_measurement(tmp_path, db_url):
    """Table 1 reads the final step on 1,048,576 tokens: a later done attempt whose last step was
    measured on 262,144 only is passed over (it was imported, and its light numbers read)."""
    fib_db, _, _ = make_study(tmp_path)
    _second_done_attempt(fib_db, "f11__fib_stagger_w8", (FINAL, "fineweb_edu_val", 43.1, 262144))
    engine = connect(db_url)
    import_study(engine, fib_db)
    assert _final_fineweb(engine, "f11__fib_stagger_w8") == [(42.5, 1048576)]


def test_a_later_done_attempt_that_went_further_is_the_one_imported(tmp_path, db_url):
    fib_db, _, _ = make_study(tmp_path)
    _second_done_attempt(fib_db, "f11__fib_stagger_w8", (FINAL + 500, "fineweb_edu_val", 41.0, 262144))
    engine = connect(db_url)
    import_study(engine, fib_db)
    assert rows(engine, "SELECT final_step FROM runs WHERE name = 'f11__fib_stagger_w8'") == [(FINAL + 500,)]


@pytest.mark.parametrize("table,row", [
    ("metrics", "(SELECT id FROM runs WHERE title = 'f06__fib_fixed_w8'), 1500, 'fineweb_edu_val', NULL, NULL, "
                "1048576, '2026-06-16'"),
    ("eval_results", "NULL, (SELECT id FROM runs WHERE title = 'f06__fib_fixed_w8'), 1001, 512, 'lambada', "
                     "'top1_acc', 0.3, '2026-06-16'"),
])
def test_the_final_step_is_the_last_with_a_perplexity(table, row, tmp_path, db_url):
    """A metrics row that measures nothing, or an auxiliary result at a later step, does not move
    the final step past the last perplexity (Table 1 read blanks there, and the JSON dumps'
    numbers were filed under it)."""
    fib_db, extrap, posloss = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        if table == "metrics":  # a copy of the table whose ppl and loss may be NULL
            study.executescript("CREATE TABLE copy (run_id, step, dataset, ppl, loss, eval_tokens, recorded_at); "
                                "INSERT INTO copy SELECT * FROM metrics; DROP TABLE metrics; "
                                "ALTER TABLE copy RENAME TO metrics;")
        study.execute(f"INSERT INTO {table} VALUES ({row})")
    engine = connect(db_url)
    import_study(engine, fib_db, extrap, posloss)
    assert rows(engine, "SELECT final_step FROM runs WHERE name = 'f06__fib_fixed_w8'") == [(FINAL,)]
    assert _final_fineweb(engine, "f06__fib_fixed_w8") == [(44.0, 1048576)]


def fibctl(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """`fibctl ARGS` run by its main in this process (not a new Python, which cost seconds of
    imports each), as the CompletedProcess a process would have given."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["fibctl", *args], done.value.code, out.out, out.err)


def test_a_run_with_no_done_attempt_is_named_as_unfinished_not_outside_the_matrix(tmp_path, db_url, monkeypatch,
                                                                                  capsys):
    fib_db, _, _ = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        study.execute("UPDATE runs SET status = 'running' WHERE title = 'f13__fib_stagger_w12'")
    out = fibctl(monkeypatch, capsys, "import-study", str(fib_db), "--db", db_url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("not part of the study's matrix") and "ref_e0030" in line
               and "f13" not in line for line in lines), out.stdout
    assert "no 'done' attempt in fib.db, its metrics skipped: f13__fib_stagger_w12" in lines, out.stdout


def test_a_run_name_s_control_codes_are_shown_escaped_not_obeyed(tmp_path, db_url, monkeypatch, capsys):
    fib_db, _, _ = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:  # a run outside the matrix, named with a screen clear
        study.execute("UPDATE runs SET title = 'mine\x1b[2J' WHERE title = 'ref_e0030'")
    out = fibctl(monkeypatch, capsys, "import-study", str(fib_db), "--db", db_url)
    assert out.returncode == 0 and "\x1b" not in out.stdout, out.stdout
    assert "skipped: mine\\x1b[2J" in out.stdout


def test_a_run_whose_metrics_are_all_empty_is_named(tmp_path, db_url):
    """Table 1 leaves out a run with no final perplexity: the import says which (not the dense
    baseline, whose numbers are in lenextrap.json)."""
    fib_db, extrap, posloss = make_study(tmp_path)
    with sqlite3.connect(fib_db) as study:
        study.executescript("CREATE TABLE copy (run_id, step, dataset, ppl, loss, eval_tokens, recorded_at); "
                            "INSERT INTO copy SELECT * FROM metrics; DROP TABLE metrics; "
                            "ALTER TABLE copy RENAME TO metrics; UPDATE metrics SET ppl = NULL, loss = NULL "
                            "WHERE run_id = (SELECT id FROM runs WHERE title = 'f09__logsparse_w8');")
    out = subprocess.run([sys.executable, "-m", "fibctl", "import-study", str(fib_db), "--lenextrap", str(extrap),
                          "--posloss", str(posloss), "--db", db_url], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "no perplexity in fib.db (every metrics row empty): f09__logsparse_w8" in out.stdout.splitlines(), \
        out.stdout


def test_import_aux_probe_extrapolation_and_position_losses(tmp_path, db_url):
    engine, _ = imported(tmp_path, db_url)
    aux = dict(rows(engine, "SELECT m.name, m.value FROM aux_metrics m JOIN runs r ON r.id = m.run_id "
                            "WHERE r.name = 'f13__fib_stagger_w12' AND m.metric = 'top1_acc'"))
    assert aux == {"lambada": 0.03, "lambada@step500": 0.01}
    assert rows(engine, "SELECT COUNT(*) FROM aux_metrics m JOIN runs r ON r.id = m.run_id "
                        "WHERE r.name = 'ref_e0000'") == [(2,)]
    probe = rows(engine, "SELECT name, schedule, \"window\", seed, train_length FROM runs WHERE matrix = 'probe' "
                         "ORDER BY name")
    assert [p[0] for p in probe] == ["probe_marked_d2_stagger_s0", "probe_marked_d2_stagger_s1",
                                     "probe_marked_d2_uniform_s0", "probe_marked_d2_uniform_s1"]
    assert probe[0][1:] == ("learned", 8, 0, 512)
    # each probe model names the task it was scored on, the distances of its own rows
    assert rows(engine, "SELECT DISTINCT text FROM aux_metrics WHERE name = 'marked_retrieval' AND metric = 'task'") \
        == [("length 512, vocab 512, distances 200/350",)]
    assert rows(engine, "SELECT a.layer, a.alpha FROM alphas a JOIN runs r ON r.id = a.run_id "
                        "WHERE r.name = 'probe_marked_d2_stagger_s0' ORDER BY a.layer") == [(0, 0.588), (1, 1.389)]
    # lenextrap: rows at the longer lengths at the run's final step; the 1024 row from metrics is kept
    assert rows(engine, "SELECT e.eval_length, e.step, e.ppl, e.tokens FROM evaluations e JOIN runs r "
                        "ON r.id = e.run_id WHERE r.name = 'f11__fib_stagger_w8' AND e.dataset = 'fineweb_edu_val' "
                        "AND e.step = :s ORDER BY e.eval_length", s=FINAL) == [
        (1024, FINAL, 42.5, 1048576), (2048, FINAL, 42.0, None), (4096, FINAL, 41.65, None)]
    dense = rows(engine, "SELECT e.eval_length, e.ppl FROM evaluations e JOIN runs r ON r.id = e.run_id "
                         "WHERE r.name = 'ref_e0000' ORDER BY e.eval_length")
    assert dense == [(1024, 30.0), (2048, 45.0), (4096, 90.0)]
    losses = rows(engine, "SELECT p.position, p.mean_loss, p.windows, p.eval_length FROM position_losses p "
                          "JOIN runs r ON r.id = p.run_id WHERE r.name = 'f11__fib_stagger_w8' ORDER BY p.position")
    assert len(losses) == N_POS
    assert losses[10] == (10, position_losses(0.0)[10], 488, 1024)


def _dump(engine) -> dict:
    tables = ("runs", "evaluations", "aux_metrics", "alphas", "position_losses", "events", "train_steps")
    return {t: rows(engine, f"SELECT * FROM {t} ORDER BY id") for t in tables}


def test_columns_the_import_does_not_read_are_never_computed(tmp_path):
    """`SELECT *` computed every column of a crafted fib.db: a generated one that fails when
    read (or allocates a gigabyte a row) stopped the import ('cannot read it (integer
    overflow)'), or took the memory; only the columns the import reads are asked for."""
    plain, crafted = tmp_path / "plain", tmp_path / "crafted"
    for folder in (plain, crafted):
        folder.mkdir()
        make_study(folder)
    with sqlite3.connect(crafted / "fib.db") as conn:
        for table in ("runs", "metrics", "eval_results", "retrieval_results"):
            conn.execute(f"ALTER TABLE {table} ADD COLUMN boom INTEGER AS (abs(-9223372036854775807 - 1))")
    conn.close()
    read = {}
    for folder in (plain, crafted):
        engine = connect(str(folder / "results.db"))
        import_study(engine, folder / "fib.db")
        read[folder] = (rows(engine, "SELECT name, status FROM runs ORDER BY name"),
                        rows(engine, "SELECT step, dataset, ppl FROM evaluations ORDER BY id"),
                        rows(engine, "SELECT name, metric, value FROM aux_metrics ORDER BY id"))
        engine.dispose()
    assert read[crafted] == read[plain] and read[plain][1]


def test_importing_twice_changes_nothing(tmp_path, db_url):
    engine, files = imported(tmp_path, db_url)
    before = _dump(engine)
    assert len(before["runs"]) == 10 + 4  # 9 study runs + the dense baseline, 4 probe models
    import_study(engine, *files)
    assert _dump(engine) == before


def test_wrong_layout_names_what_was_expected(tmp_path, db_url):
    fib_db, extrap, posloss = make_study(tmp_path)
    engine = connect(db_url)
    broken = tmp_path / "broken.db"
    conn = sqlite3.connect(broken)
    conn.execute("CREATE TABLE runs (id INTEGER, title TEXT)")
    conn.close()
    with pytest.raises(FibctlError, match="broken.db: table 'runs' lacks columns status, seed.*not the layout of "
                                          "the study's fib.db \\(docs/method.md, 'The published files'\\)$"):
        import_study(engine, broken)
    ours = tmp_path / "ours.db"  # a fibctl database given where the study's belongs
    connect(str(ours)).dispose()
    with pytest.raises(FibctlError, match="ours.db is a fibctl results database, not the study's fib.db"):
        import_study(engine, ours)
    not_db = tmp_path / "notes.txt"
    not_db.write_text("hello " * 100)
    with pytest.raises(FibctlError, match="not an SQLite database"):
        import_study(engine, not_db)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text(json.dumps({"f11__fib_stagger_w8": {"1024": 42.0}}))
    with pytest.raises(FibctlError, match=r"expected \{length: \{dataset: ppl\}\}"):
        import_study(engine, fib_db, lenextrap=bad_json)
    bad_json.write_text(json.dumps({"f11__fib_stagger_w8": {"fineweb_edu_val": {"binned": [1.0]}}}))
    with pytest.raises(FibctlError, match="expected \\{per_position"):
        import_study(engine, fib_db, posloss=bad_json)
    bad_json.write_text(json.dumps([1, 2]))
    with pytest.raises(FibctlError, match="expected an object"):
        import_study(engine, fib_db, lenextrap=bad_json)
    # a failed import writes nothing
    assert rows(engine, "SELECT COUNT(*) FROM runs") == [(0,)]


def test_a_run_fibctl_trained_is_not_overwritten(tmp_path, db_url):
    fib_db, _, _ = make_study(tmp_path)
    engine = connect(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO runs (name, matrix, preset, schedule, seed, train_length, config_json, "
                          "config_hash, status, attempts, created_at, source) VALUES ('f06__fib_fixed_w8', "
                          "'paper', 'paper', 'fixed', 42, 1024, '{}', 'x', 'queued', 0, '2026-01-01', 'fibctl')"))
    with pytest.raises(FibctlError, match="already exists in this database as a fibctl run.*--compare"):
        import_study(engine, fib_db)
    assert rows(engine, "SELECT name, status FROM runs") == [("f06__fib_fixed_w8", "queued")]


def test_cli_import_study_and_its_bad_input_exit_code(tmp_path, db_url, monkeypatch, capsys):
    fib_db, extrap, posloss = make_study(tmp_path)
    db = db_url
    ok = fibctl(monkeypatch, capsys, "import-study", str(fib_db), "--lenextrap", str(extrap), "--posloss",
                str(posloss), "--db", db)
    assert ok.returncode == 0, ok.stderr
    # counts as every other fibctl count is shown: 2,046, not 2046
    assert "imported 10 runs, 4 probe models, 43 evaluations, 20 auxiliary metrics, 2,046 per-position losses" \
        in " ".join(ok.stdout.split()), ok.stdout
    bad = fibctl(monkeypatch, capsys, "import-study", str(extrap), "--db", db)
    assert bad.returncode == 2
    assert "not an SQLite database" in bad.stderr and "Traceback" not in bad.stderr


def test_a_wrapped_summary_ends_no_line_with_a_space_in_a_pipe(tmp_path, monkeypatch, capsys):
    """rich wraps a long line after a space and keeps that space at the line's end; piped
    (capsys is no terminal), fibctl's console drops it."""
    fib_db, extrap, posloss = make_study(tmp_path)
    ok = fibctl(monkeypatch, capsys, "import-study", str(fib_db), "--lenextrap", str(extrap), "--posloss",
                str(posloss), "--db", str(tmp_path / "results.db"))
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert len(lines[0]) > 60 and lines[1].startswith(("per-position", "2,046")), lines  # it wrapped
    assert [line for line in lines if line.endswith(" ")] == []


def test_the_summary_counts_rows_written_or_changed_not_rows_read(tmp_path, db_url, monkeypatch, capsys):
    fib_db, extrap, posloss = make_study(tmp_path)
    engine = connect(db_url)
    first = import_study(engine, fib_db, lenextrap=extrap, posloss=posloss)
    assert (first.runs, first.probe_runs) == (10, 4) and first.evaluations > 0 and first.position_losses > 0
    again = import_study(engine, fib_db, lenextrap=extrap, posloss=posloss)
    assert (again.runs, again.probe_runs, again.evaluations, again.aux_metrics, again.position_losses) == (0,) * 5
    # one value changed in the study: one evaluation and nothing else counts
    study = sqlite3.connect(fib_db)
    study.execute("UPDATE metrics SET ppl = ppl + 1 WHERE rowid = (SELECT MIN(rowid) FROM metrics WHERE ppl IS NOT NULL)")
    study.commit()
    study.close()
    changed = import_study(engine, fib_db, lenextrap=extrap, posloss=posloss)
    assert (changed.runs, changed.probe_runs, changed.evaluations, changed.aux_metrics,
            changed.position_losses) == (0, 0, 1, 0, 0)
    db = db_url
    again = fibctl(monkeypatch, capsys, "import-study", str(fib_db), "--lenextrap", str(extrap), "--posloss",
                   str(posloss), "--db", db)
    assert again.returncode == 0 and "nothing to import" in again.stdout and "imported" not in again.stdout


def test_the_dense_baseline_has_one_name_queued_or_imported(tmp_path, db_url):
    from fibctl.db.importer import DENSE_BASELINE
    from fibctl.matrix import load_matrix

    queued = [c.name for c in load_matrix("paper").resolve() if c.model.schedule == "dense"]
    engine, _ = imported(tmp_path, db_url)
    assert queued == [DENSE_BASELINE] == [r[0] for r in rows(engine, "SELECT name FROM runs WHERE schedule = 'dense'")]


def test_imported_runs_have_the_paper_matrix_configs_so_queueing_it_adds_only_the_rest(tmp_path, db_url):
    """A learned run's micro-batch split (4 x 8) is the matrix's, not the preset's: queueing
    the matrix beside the imported study finds the imported runs already there."""
    from fibctl.matrix import load_matrix
    from fibctl.queue import add_runs

    engine, _ = imported(tmp_path, db_url)
    hashes = dict(rows(engine, "SELECT name, config_hash FROM runs WHERE matrix = 'paper'"))
    configs = load_matrix("paper").resolve()
    assert any(c.model.schedule == "learned" and c.name in hashes for c in configs)
    assert all(hashes[c.name] == c.config_hash for c in configs if c.name in hashes)
    added, present = add_runs(engine, configs)
    assert sorted(present) == sorted(hashes) and len(added) + len(present) == len(configs)


# --- malformed values in the study's files: one line, exit code 2, nothing written -----------

F13 = "(SELECT id FROM runs WHERE title = 'f13__fib_stagger_w12')"
M500 = f"WHERE run_id = {F13} AND step = 500 AND dataset = 'fineweb_edu_val'"
MODEL = "WHERE source = 'marked' AND depth = 2 AND seed = 1 AND staggered = 1"  # one probe model's rows
MARKED = f"{MODEL} AND distance = 350"
EVAL = f"WHERE run_id = {F13} AND step = 500"
RUN = "WHERE title = 'f13__fib_stagger_w12'"
P11 = ("f11__fib_stagger_w8", "fineweb_edu_val")
HUGE_W = "f05__fib_w99999999999999999999"

# (file, change, words the one line holds): the change is SQL run on fib.db, or for a JSON
# file (keys, value) to set; keys () replace the whole file with the value
BAD_STUDY = [
    ("fib.db", f"UPDATE metrics SET ppl = 0 {M500}", ("fib.db", "metrics.ppl = 0", "'f13__fib_stagger_w12' step 500",
                                                      "finite positive number")),
    ("fib.db", f"UPDATE metrics SET ppl = -3 {M500}", ("metrics.ppl = -3", "f13__fib_stagger_w12", "positive")),
    ("fib.db", f"UPDATE metrics SET ppl = 'abc' {M500}", ("metrics.ppl = 'abc'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE metrics SET loss = 'x' {M500}", ("metrics.loss = 'x'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE metrics SET step = 'x' {M500}", ("metrics.step = 'x'", "f13__fib_stagger_w12", "integer")),
    ("fib.db", f"UPDATE metrics SET recorded_at = 'yesterday' {M500}", ("metrics.recorded_at = 'yesterday'",
                                                                      "timestamp")),
    ("fib.db", f"UPDATE metrics SET eval_tokens = 2.5 {M500}", ("metrics.eval_tokens = 2.5", "integer")),
    ("fib.db", f"UPDATE metrics SET dataset = x'ff' {M500}", ("metrics.dataset = b'\\xff'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE runs SET created_at = 'soon' {RUN}", ("runs.created_at = 'soon'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE runs SET started_at = '2026-13-45' {RUN}", ("runs.started_at = '2026-13-45'", "timestamp")),
    ("fib.db", f"UPDATE runs SET ended_at = '0001-01-01T00:00:00+05:00' {RUN}", ("runs.ended_at", "timestamp")),
    ("fib.db", f"UPDATE runs SET wall_seconds = 'long' {RUN}", ("runs.wall_seconds = 'long'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE runs SET params_effective = 'many' {RUN}", ("runs.params_effective = 'many'", "integer")),
    ("fib.db", f"UPDATE runs SET tokens_trained = -5 {RUN}", ("runs.tokens_trained = -5", "integer from 0")),
    ("fib.db", f"UPDATE runs SET title = '{HUGE_W}' {RUN}", ("fib.db", "window = '9999", "f05__fib_w9999",
                                                              "2**31 - 1")),
    ("fib.db", f"UPDATE runs SET title = 'f05__fib_w5000000000' {RUN}", ("window = 5000000000",
                                                                          "f05__fib_w5000000000")),
    ("fib.db", f"UPDATE runs SET title = 'f13__fib_w12_s99999999999999999999' {RUN}", ("fib.db", "seed = '9999",
                                                                                       "2**32 - 1")),
    ("fib.db", f"UPDATE runs SET title = x'00' {RUN}", ("fib.db", "runs.title = b'\\x00'")),
    ("fib.db", "UPDATE runs SET seed = 45 WHERE title = 'g03__fib_stagger_w12_s43'",
     ("fib.db", "runs.seed = 45 for run 'g03__fib_stagger_w12_s43' disagrees with the seed its name says (43)")),
    ("fib.db", "UPDATE runs SET seed = 'x' WHERE title = 'g03__fib_stagger_w12_s43'", ("runs.seed = 'x'", "g03")),
    ("fib.db", f"UPDATE runs SET status = CAST(x'ff' AS TEXT) {RUN}", ("study database fib.db", "cannot read",
                                                                      "UTF-8")),
    ("fib.db", f"UPDATE eval_results SET value = 'x' {EVAL}", ("eval_results.value = 'x'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE eval_results SET step = 'x' {EVAL}", ("eval_results.step = 'x'", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE eval_results SET metric = x'ff' {EVAL}", ("eval_results.metric", "f13__fib_stagger_w12")),
    ("fib.db", f"UPDATE eval_results SET eval_name = '{'n' * 90}' {EVAL}", ("eval_results.eval_name = 'nnn",
                                                                          "1 to 85 characters")),
    ("fib.db", f"UPDATE retrieval_results SET alphas = '[NaN,1.0]' {MODEL}", ("retrieval_results.alphas[0] = nan",
                                                                             "probe_marked_d2_stagger_s1")),
    ("fib.db", f"UPDATE retrieval_results SET alphas = '[true,1.0]' {MODEL}", ("retrieval_results.alphas[0] = True",)),
    ("fib.db", f"UPDATE retrieval_results SET alphas = '{'[' * 100000}' {MODEL}", ("retrieval_results.alphas",
                                                                                  "a JSON list of 2 numbers")),
    ("fib.db", f"UPDATE retrieval_results SET alphas = '[1.0]' {MODEL}", ("retrieval_results.alphas = '[1.0]'",
                                                                          "probe_marked_d2_stagger_s1",
                                                                          "2 numbers (one per layer)")),
    # a model's rows repeated (here under another mech) must agree
    ("fib.db", f"INSERT INTO retrieval_results SELECT source, 'copy', depth, seed, staggered, train_d, distance, "
               f"kind, 0.5, alphas, peak_gb, src_file, extra FROM retrieval_results {MARKED}",
     ("retrieval_results.acc", "probe_marked_d2_stagger_s1", "two accuracies at distance 350", "0.2", "0.5")),
    ("fib.db", f"INSERT INTO retrieval_results SELECT source, 'copy', depth, seed, staggered, train_d, distance, "
               f"kind, acc, '[0.5, 1.5]', peak_gb, src_file, extra FROM retrieval_results {MARKED}",
     ("retrieval_results.alphas", "probe_marked_d2_stagger_s1", "two different lists", "[0.5, 1.5]")),
    ("fib.db", f"UPDATE retrieval_results SET depth = 'x' {MARKED}", ("retrieval_results.depth = 'x'", "integer")),
    ("fib.db", f"UPDATE retrieval_results SET depth = 0 {MARKED}", ("retrieval_results.depth = 0", "integer from 1")),
    ("fib.db", f"UPDATE retrieval_results SET seed = -1 {MARKED}", ("retrieval_results.seed = -1", "2**32 - 1")),
    ("fib.db", f"UPDATE retrieval_results SET staggered = 2 {MARKED}", ("retrieval_results.staggered = 2", "0 to 1")),
    ("fib.db", f"UPDATE retrieval_results SET distance = 'far' {MARKED}", ("retrieval_results.distance = 'far'",
                                                                         "probe_marked_d2_stagger_s1")),
    ("fib.db", f"UPDATE retrieval_results SET acc = 'high' {MARKED}", ("retrieval_results.acc = 'high'",)),
    ("fib.db", f"UPDATE retrieval_results SET acc = 1.5 {MARKED}", ("retrieval_results.acc = 1.5", "from 0 to 1")),
    ("posloss.json", ((*P11, "per_position", 5), "a"), ("posloss.json", "per_position[5] = 'a'",
                                                        "'f11__fib_stagger_w8' dataset 'fineweb_edu_val'")),
    ("posloss.json", ((*P11, "per_position", 5), None), ("posloss.json", "per_position[5] = None",
                                                         "f11__fib_stagger_w8")),
    ("posloss.json", ((*P11, "per_position", 7), -1.0), ("per_position[7] = -1.0", ">= 0")),
    ("posloss.json", ((*P11, "seq_len"), 10**30), ("posloss.json", "seq_len = 1000000", "2**31 - 1")),
    ("posloss.json", ((*P11, "n_windows"), True), ("posloss.json", "n_windows = True")),
    ("posloss.json", ((*P11, "n_windows"), 0), ("posloss.json", "n_windows = 0", "integer from 1")),
    # every predicted position of the window, or Table 4's bins would span part of it
    ("posloss.json", ((*P11, "per_position"), [3.7] * 500), ("posloss.json", "500 per-position losses",
                                                           "'f11__fib_stagger_w8'", "seq_len - 1 = 1023")),
    ("posloss.json", ((*P11, "per_position"), [3.7] * 1033), ("1033 per-position losses", "seq_len - 1 = 1023")),
    ("posloss.json", ((*P11, "seq_len"), 2048), ("1023 per-position losses", "seq_len - 1 = 2047")),
    ("lenextrap.json", (("f11__fib_stagger_w8", "²"), {"fineweb_edu_val": 40.0}), ("lenextrap.json", "length = '²'")),
    ("lenextrap.json", (("f11__fib_stagger_w8", "9" * 20), {"fineweb_edu_val": 40.0}), ("length = '9999",)),
    ("lenextrap.json", (("f11__fib_stagger_w8", "2048", "fineweb_edu_val"), math.inf), ("lenextrap.json", "ppl = inf",
                                                                                       "length 2048")),
    ("lenextrap.json", (("f11__fib_stagger_w8", "2048", "fineweb_edu_val"), True), ("ppl = True",)),
    ("lenextrap.json", (("f11__fib_stagger_w8", "2048", "fineweb_edu_val"), 10**400), ("ppl = 1000000",)),
    ("lenextrap.json", (("f11__fib_stagger_w8", "2048", "d" * 150), 40.0), ("lenextrap.json", "dataset = 'ddd",
                                                                          "length 2048", "held-out set name")),
    # held-out set names are identifiers, as fibctl's own (they were stored as given)
    ("lenextrap.json", (("f11__fib_stagger_w8", "2048", "../../etc"), 40.0), ("lenextrap.json",
                                                                             "dataset = '../../etc'",
                                                                             "is not a held-out set name")),
    ("fib.db", f"UPDATE metrics SET dataset = '../odd set/<x>' {M500}", ("metrics.dataset = '../odd set/<x>'",
                                                                        "f13__fib_stagger_w12", "held-out set name")),
    ("lenextrap.json", ((HUGE_W,), {"1024": {"fineweb_edu_val": 40.0}}), ("lenextrap.json", "window = '9999",
                                                                         "f05__fib_w9999")),
    ("lenextrap.json", ((), "[" * 100000), ("lenextrap.json", "cannot read JSON")),
]


def _spoil(files: dict[str, Path], file: str, change) -> None:
    if file == "fib.db":
        with sqlite3.connect(files[file]) as study:
            study.execute(change)
        return
    keys, value = change
    if not keys:
        files[file].write_text(value)
        return
    data = json.loads(files[file].read_text())
    inner = data
    for k in keys[:-1]:
        inner = inner[k]
    inner[keys[-1]] = value
    files[file].write_text(json.dumps(data))


@pytest.mark.parametrize("file, change, words", BAD_STUDY,
                         ids=[f"{i}-{w[0][:30]}" for i, (_, _, w) in enumerate(BAD_STUDY)])
def test_a_malformed_study_value_is_one_line_exit_2_nothing_written(file, change, words, tmp_path, monkeypatch,
                                                                   capsys):
    from fibctl.cli import main
    fib_db, extrap, posloss = make_study(tmp_path)
    _spoil({"fib.db": fib_db, "lenextrap.json": extrap, "posloss.json": posloss}, file, change)
    out_db = str(tmp_path / "out.db")
    engine = connect(out_db)
    before = _dump(engine)
    engine.dispose()
    monkeypatch.setattr(sys, "argv", ["fibctl", "import-study", str(fib_db), "--lenextrap", str(extrap),
                                      "--posloss", str(posloss), "--db", out_db])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2, out
    assert "Traceback" not in out.err + out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), out.err
    assert len(lines[0].replace(str(tmp_path), "")) <= 200, out.err  # short, apart from the path given
    engine = connect(out_db)
    assert _dump(engine) == before  # the import is one transaction: the runs written before the bad value are gone
    engine.dispose()


def test_a_failed_import_leaves_no_database_it_made(tmp_path, monkeypatch, capsys):
    from fibctl.cli import main
    fib_db, extrap, posloss = make_study(tmp_path)
    _spoil({"fib.db": fib_db}, "fib.db", f"UPDATE metrics SET ppl = 0 {M500}")
    out_db = tmp_path / "published.db"
    monkeypatch.setattr(sys, "argv", ["fibctl", "import-study", str(fib_db), "--lenextrap", str(extrap),
                                      "--posloss", str(posloss), "--db", str(out_db)])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and "metrics.ppl = 0" in capsys.readouterr().err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("published.db")]
    connect(str(out_db)).dispose()  # a database that was there before the import stays
    with pytest.raises(SystemExit):
        main()
    assert out_db.is_file()
