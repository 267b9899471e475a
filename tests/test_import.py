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
    with pytest.raises(FibctlError, match="lacks columns status.*expected the study's layout.*metrics\\(run_id"):
        import_study(engine, broken)
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


def test_cli_import_study_and_its_bad_input_exit_code(tmp_path, db_url):
    fib_db, extrap, posloss = make_study(tmp_path)
    db = db_url
    ok = subprocess.run([sys.executable, "-m", "fibctl", "import-study", str(fib_db), "--lenextrap", str(extrap),
                         "--posloss", str(posloss), "--db", db], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "imported 10 runs, 4 probe models" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "fibctl", "import-study", str(extrap), "--db", db],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "not an SQLite database" in bad.stderr and "Traceback" not in bad.stderr


def test_the_summary_counts_rows_written_or_changed_not_rows_read(tmp_path, db_url):
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
    again = subprocess.run([sys.executable, "-m", "fibctl", "import-study", str(fib_db), "--lenextrap", str(extrap),
                            "--posloss", str(posloss), "--db", db], capture_output=True, text=True)
    assert again.returncode == 0 and "nothing to import" in again.stdout and "imported" not in again.stdout


def test_the_dense_baseline_has_one_name_queued_or_imported(tmp_path, db_url):
    from fibctl.db.importer import DENSE_BASELINE
    from fibctl.matrix import load_matrix

    queued = [c.name for c in load_matrix("paper").resolve() if c.model.schedule == "dense"]
    engine, _ = imported(tmp_path, db_url)
    assert queued == [DENSE_BASELINE] == [r[0] for r in rows(engine, "SELECT name FROM runs WHERE schedule = 'dense'")]
