"""The results database: migrations, schema, upsert writers, refusing bad files."""

from __future__ import annotations

import re
from datetime import datetime

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import InternalError, OperationalError
from sqlalchemy.pool import NullPool

from conftest import NO_PG, PG_SERVER, pg_database
from fibctl.config import RunConfig
from fibctl.db.engine import (alembic_config, connect, connect_readonly, current_revision, head_revision, release,
                              resolve_url, upgrade)
from fibctl.db.schema import Base
from fibctl.db.store import RunRecorder
from fibctl.db.whole import upgraded_or_created
from fibctl.errors import FibctlError
from fibctl.queue import add_runs


def _insert_rev1_run(db: str, name: str, config_json: str) -> None:
    """A run and its metrics written the way revision 0001 stored them (plain SQL)."""
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    with engine.begin() as conn:
        run_id = conn.execute(text(
            'INSERT INTO runs (name, matrix, preset, base, schedule, "window", seed, config_json, config_hash,'
            " status, attempts, created_at, source) VALUES (:n, 'm', 'micro', 'fib', 'stagger', 8, 42, :c, 'h',"
            " 'done', 1, '2026-01-01 00:00:00', 'fibctl') RETURNING id"), {"n": name, "c": config_json}).scalar()
        conn.execute(text("INSERT INTO evaluations (run_id, step, dataset, eval_length, tokens, loss, ppl)"
                          " VALUES (:r, 30, 'wikipedia_val', 64, 4096, 2.0, 7.389)"), {"r": run_id})
        conn.execute(text("INSERT INTO position_losses (run_id, step, dataset, eval_length, position, mean_loss,"
                          " windows) VALUES (:r, 30, 'wikipedia_val', 64, :p, 1.5, 4)"),
                     [{"r": run_id, "p": p} for p in range(63)])


def _inspect(db: str, *sql: str) -> list:
    """Each statement's rows, read through a connection of its own (not fibctl's engine)."""
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    with engine.connect() as conn:
        return [conn.execute(text(q)).all() for q in sql]


def test_upgrade_from_first_revision_keeps_rows(db_url):
    db = db_url
    upgrade(db, "0001")
    cfg = RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=8)
    _insert_rev1_run(db, "r1", cfg.to_json())

    before, after = upgrade(db)
    assert (before, after) == ("0001", head_revision())
    engine = connect(db)
    with engine.connect() as conn:
        run = conn.execute(text("SELECT id, name, status, train_length, final_step FROM runs")).one()
        assert (run.name, run.status, run.train_length, run.final_step) == ("r1", "done", 64, None)
        # the runs table was rebuilt: its children's rows must survive (no cascade delete)
        assert conn.execute(text("SELECT ppl FROM evaluations WHERE run_id = :r"), {"r": run.id}).scalar() == 7.389
        assert conn.execute(text("SELECT count(*) FROM position_losses")).scalar() == 63
        assert conn.execute(text("SELECT count(*) FROM events")).scalar() == 0


def rev6_probe(db: str) -> str:
    """A database at revision 0006 holding a probe model scored then (3 metrics, no task: 0007
    derives it), run 1, and a language model with a metric of its own, run 2. Returns the
    probe model's name."""
    from fibctl.probe.cells import probe_runs

    upgrade(db, "0006")
    [probe] = probe_runs(depths=(2,), inits=("uniform",), seeds=(0,), steps=10, length=64, distances=(35, 20))
    lm = RunConfig.resolve("lm", "m", "micro", schedule="stagger", window=8)
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    with engine.begin() as conn:
        for run in (probe, lm):
            conn.execute(text(
                'INSERT INTO runs (name, matrix, preset, schedule, seed, train_length, config_json, config_hash,'
                " status, attempts, created_at, source) VALUES (:n, 'm', 'micro', 'learned', 0, 64, :c, 'h',"
                " 'done', 1, '2026-01-01 00:00:00', 'fibctl')"), {"n": run.name, "c": run.to_json()})
        conn.execute(text("INSERT INTO aux_metrics (run_id, name, metric, value) VALUES (1, 'marked_retrieval', :m, 0.5)"),
                     [{"m": m} for m in ("depth", "acc_d20", "acc_d35")])
        conn.execute(text("INSERT INTO aux_metrics (run_id, name, metric, value) VALUES (2, 'lambada', 'acc', 0.1)"))
    engine.dispose()
    return probe.name


def test_upgrade_names_the_task_of_probe_models_scored_before(db_url):
    """Revision 0007: a probe model scored before it gets its task (Table 2 groups by it) from
    its config and the distances it was scored at; other runs and metrics are left alone."""
    db = db_url
    rev6_probe(db)
    upgrade(db)
    [tasks, count] = _inspect(db, "SELECT run_id, text FROM aux_metrics WHERE metric = 'task'",
                              "SELECT count(*) FROM aux_metrics")
    assert tasks == [(1, "length 64, vocab 512, distances 20/35")] and count == [(5,)]
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    with engine.begin() as conn:  # and back: the task rows go, the scores stay
        command.downgrade(alembic_config(conn), "0006")
    engine.dispose()
    assert _inspect(db, "SELECT count(*) FROM aux_metrics WHERE metric = 'task'", "SELECT count(*) FROM aux_metrics") \
        == [[(0,)], [(4,)]]


def test_seeds_and_counts_past_32_bits_are_recorded_after_an_upgrade(db_url):
    """Revision 0008: seeds up to 2**32 - 1, parameter and token counts past 2**31 (PostgreSQL's
    INTEGER is 32-bit); a run recorded at 0007 keeps its row through the rebuild."""
    db = db_url
    upgrade(db, "0007")
    add_runs(connect_at(db), [RunConfig.resolve("old", "m", "micro", schedule="stagger", window=8, seed=7)])
    assert upgrade(db) == ("0007", head_revision())
    engine = connect(db)
    wide = RunConfig.resolve("wide", "m", "micro", schedule="stagger", window=8, seed=2**32 - 1)
    add_runs(engine, [wide])
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET tokens_trained = :t, params_total = :p WHERE name = 'wide'"),
                     {"t": 2**40, "p": 3 * 10**9})
    engine.dispose()
    assert _inspect(db, "SELECT name, seed, init_seed, tokens_trained, params_total FROM runs ORDER BY name") == [[
        ("old", 7, 7, None, None), ("wide", 2**32 - 1, 2**32 - 1, 2**40, 3 * 10**9)]]


def test_upgrade_records_the_studys_runs_as_drawn_by_its_sampler(db_url):
    """Revision 0009: runs.sampler, what drew a run's windows. The study's imported runs drew
    from numpy's generator; its probe models draw no windows, and fibctl's runs trained before
    the revision may have drawn from either (NULL: not recorded). Downgrading drops it."""
    db = db_url
    upgrade(db, "0008")
    from fibctl.db.store import run_row
    from fibctl.probe.cells import probe_runs

    [probe] = probe_runs(depths=(2,), inits=("uniform",), seeds=(0,), steps=10, length=64, distances=(35, 20))
    lm = RunConfig.resolve("f11__fib_stagger_w8", "paper", "micro", schedule="stagger", window=8)
    ours = RunConfig.resolve("ours", "m", "micro", schedule="stagger", window=8)
    engine = connect_at(db)
    with engine.begin() as conn:
        for config, source in ((lm, "fib.db"), (probe, "fib.db"), (ours, "fibctl")):
            conn.execute(Base.metadata.tables["runs"].insert().values(
                {k: v for k, v in run_row(config, source=source, status="done").items() if k != "sampler"}))
    engine.dispose()
    assert upgrade(db) == ("0008", head_revision())
    assert _inspect(db, "SELECT name, sampler FROM runs ORDER BY id") == [[
        ("f11__fib_stagger_w8", "numpy"), (probe.name, None), ("ours", None)]]
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "0008")
    engine.dispose()
    assert "sampler" not in {c["name"] for c in inspect(connect_at(db)).get_columns("runs")}


def connect_at(db: str):
    """An engine on `db` as it is, not upgraded (fibctl's `connect` brings it to the head)."""
    return create_engine(resolve_url(db), poolclass=NullPool)


def test_failed_upgrade_changes_nothing(db_url):
    db = db_url
    upgrade(db, "0001")
    _insert_rev1_run(db, "broken", "{}")  # no model.seq_len to fill train_length from
    with pytest.raises(FibctlError, match="nothing changed") as refused:
        upgrade(db)
    assert len(str(refused.value).splitlines()) == 1, str(refused.value)  # not the SQL statement too
    version, losses = _inspect(db, "SELECT version_num FROM alembic_version", "SELECT count(*) FROM position_losses")
    assert version == [("0001",)] and losses == [(63,)]
    columns = inspect(create_engine(resolve_url(db), poolclass=NullPool)).get_columns("runs")
    assert "name" in [c["name"] for c in columns] and "train_length" not in [c["name"] for c in columns]


def _upgrade_after(db: str, barrier, out: str) -> None:
    """Process: upgrade `db` once every process is ready; write the outcome."""
    barrier.wait()
    with open(out, "w") as f:
        f.write(_outcome(upgrade, db))


@pytest.mark.parametrize("start", [None, "0001", "0007"])
def test_processes_upgrading_one_database_at_once_all_succeed(db_url, tmp_path, start):
    """Workers started together on a database at an older revision (or a new one) each
    upgrade it first: on PostgreSQL all but one failed ("column ... already exists", "Online
    migration expected to match one row"), with the SQL statement in the message."""
    import multiprocessing as mp

    if start:
        upgrade(db_url, start)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(4)
    outs = [str(tmp_path / f"{i}.txt") for i in range(4)]
    procs = [ctx.Process(target=_upgrade_after, args=(db_url, barrier, out)) for out in outs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    outcomes = [open(out).read() for out in outs]
    assert all(o.endswith(f", '{head_revision()}')") for o in outcomes), outcomes
    assert _inspect(db_url, "SELECT version_num FROM alembic_version") == [[(head_revision(),)]]


def test_a_new_sqlite_file_another_process_put_in_place_first_is_upgraded_as_it_is(tmp_path, monkeypatch):
    """Commands that write build a new SQLite file under a temporary name (connect, as `db
    upgrade`): where another process's file took the name first (workers started together),
    that one is the database. `db upgrade` said "run this again"; a worker would have failed."""
    import os

    from fibctl.db import whole

    db = str(tmp_path / "new.db")
    other = str(tmp_path / "other.db")
    theirs = connect(other)
    add_runs(theirs, [RunConfig.resolve("theirs", "m", "micro", schedule="fixed")])
    theirs.dispose()  # closed: its rows in the file, none in a -wal beside it

    def first_elsewhere(into, option="--db", **how):
        if into != db:  # this process's temporary: another's file appears meanwhile
            os.rename(other, db)
        return upgrade(into, option=option, **how)

    monkeypatch.setattr(whole, "upgrade", first_elsewhere)
    engine = connect(db)
    assert _inspect(db, "SELECT name FROM runs") == [[("theirs",)]]
    engine.dispose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.db"]  # this process's temporary gone


@pytest.mark.skipif(not PG_SERVER, reason=NO_PG)
def test_an_upgrade_the_server_refuses_is_one_line():
    """A role that may not create tables (here: a search_path with no schema) got the
    driver's message with the SQL statement and SQLAlchemy's link after it."""
    with pg_database() as url:
        with pytest.raises(FibctlError) as refused:
            upgrade(url + "?options=-csearch_path%3Dnosuch")
    assert str(refused.value).endswith("failed, nothing changed: no schema has been selected to create in")


def test_migrated_schema_equals_models(db_url):
    engine = connect(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    assert current_revision(engine) == head_revision()


@pytest.fixture
def recorder(db_url):
    engine = connect(db_url)
    add_runs(engine, [RunConfig.resolve("r1", "m", "micro", schedule="fixed")])
    return RunRecorder(engine, 1, worker="w")


def _rows(recorder, sql):
    with recorder.engine.connect() as conn:
        return conn.execute(text(sql)).all()


def test_writing_a_metric_twice_replaces_it(recorder):
    recorder.log_step(10, 5.0, 1e-3, 1.0, 100.0, 2.0)
    recorder.log_step(10, 4.0, 2e-3)
    recorder.log_eval(30, "math_val", 64, 4096, 2.0)
    recorder.log_eval(30, "math_val", 64, 4096, 1.0)
    recorder.log_eval(30, "math_val", 128, 4096, 3.0)  # another length: another row
    recorder.log_alphas(30, [0.5, 1.5])
    recorder.log_alphas(30, [0.7, 1.2])
    recorder.log_metric("speed", "tokens_per_s", 10.0)
    recorder.log_metric("speed", "tokens_per_s", 20.0, text={"batch": 1})

    assert _rows(recorder, "SELECT step, loss, lr, grad_norm FROM train_steps") == [(10, 4.0, 2e-3, None)]
    evals = _rows(recorder, "SELECT eval_length, loss, ppl FROM evaluations ORDER BY eval_length")
    assert [(e.eval_length, e.loss) for e in evals] == [(64, 1.0), (128, 3.0)]
    assert evals[0].ppl == pytest.approx(2.718281828)
    assert _rows(recorder, "SELECT layer, alpha FROM alphas ORDER BY layer") == [(0, 0.7), (1, 1.2)]
    assert _rows(recorder, "SELECT value, text FROM aux_metrics") == [(20.0, '{"batch": 1}')]


def test_position_losses_bulk_and_replaced(recorder):
    recorder.log_eval(30, "fineweb_edu_val", 1024, 16_384, 2.0, [float(i) for i in range(1023)], windows=16)
    assert _rows(recorder, "SELECT count(*), sum(mean_loss), min(windows) FROM position_losses") == [
        (1023, sum(range(1023)), 16)]
    recorder.log_eval(30, "fineweb_edu_val", 1024, 2048, 3.0, [1.0, 2.0], windows=2)
    assert _rows(recorder, "SELECT position, mean_loss, windows FROM position_losses ORDER BY position") == [
        (0, 1.0, 2), (1, 2.0, 2)]
    recorder.log_eval(30, "fineweb_edu_val", 1024, 4096, 4.0)  # without positions: they stay
    assert _rows(recorder, "SELECT count(*) FROM position_losses") == [(2,)]


def test_recorder_updates_run_and_logs_events(recorder):
    recorder.update_run(params_total=123)  # worker w's recorder, and the run is queued: not its own
    assert _rows(recorder, "SELECT params_total FROM runs") == [(None,)]
    assert recorder.heartbeat() is False  # nothing to keep alive either
    recorder = RunRecorder(recorder.engine, 1)  # no worker: evaluation's
    recorder.update_run(params_total=123, tokens_trained=4096, final_step=30)
    recorder.event("checkpoint", "saved", {"step": 30})
    assert _rows(recorder, "SELECT params_total, tokens_trained, final_step FROM runs") == [(123, 4096, 30)]
    assert _rows(recorder, "SELECT kind, message FROM events") == [("checkpoint", "saved")]
    with pytest.raises(TypeError, match="no column"):
        recorder.update_run(nonsense=1)


def test_garbage_file_is_refused_untouched(tmp_path):  # SQLite only: a file that is no database
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 10)
    before = path.read_bytes()
    for open_ in (connect, connect_readonly, upgrade):
        with pytest.raises(FibctlError, match="not a SQLite database"):
            open_(str(path))
    assert path.read_bytes() == before


def test_newer_schema_is_refused_untouched(db_url):
    """A newer fibctl's revision is a later number, as every migration's is (what tells it
    from a hand edit, which was called a newer fibctl's too)."""
    from fibctl.db.engine import _known_revisions

    assert all(re.fullmatch(r"\d{4}", rev) for rev in _known_revisions())
    db = db_url
    connect(db).dispose()
    for rev, words in (("0099", "it was written by a newer fibctl; upgrade fibctl"),
                       ("f00d", "has schema revision 'f00d', which no fibctl writes (this one's are 0001 to")):
        with create_engine(resolve_url(db), poolclass=NullPool).begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :rev"), {"rev": rev})
        for open_ in (connect, connect_readonly, upgrade):
            with pytest.raises(FibctlError, match=re.escape(words)):
                open_(db)
        assert _inspect(db, "SELECT version_num FROM alembic_version") == [[(rev,)]]


def test_two_schema_revisions_are_refused_untouched(db_url, monkeypatch, capsys):
    """alembic_version edited by hand to hold a second row: Alembic's CommandError ("more than
    one head present") was a traceback from every command, reading or writing."""
    from cli_helpers import refused

    db = db_url
    connect(db).dispose()
    with create_engine(resolve_url(db), poolclass=NullPool).begin() as conn:
        conn.execute(text("INSERT INTO alembic_version VALUES ('0007')"))
    line = f"records 2 schema revisions (0007, {head_revision()}) in alembic_version"
    for open_ in (connect, connect_readonly, upgrade):
        with pytest.raises(FibctlError, match=re.escape(line)):
            open_(db)
    for args in (["db", "current"], ["db", "upgrade"], ["queue", "ls"], ["queue", "add", "demo"],
                 ["report", "table1"]):
        err = refused(monkeypatch, capsys, *args, "--db", db)
        assert line in err and f"version_num <> '{head_revision()}'" in err, err
    assert _inspect(db, "SELECT count(*) FROM alembic_version", "SELECT count(*) FROM runs") == [[(2,)], [(0,)]]


@pytest.mark.parametrize("column, stored, read", [
    ("wall_seconds", "'inf'", float("inf")),  # text that reads as a number: that number
    ("wall_seconds", "'-Infinity'", float("-inf")),
    ("final_step", "30.0", 30),  # SQLite's own conversion, read as ever
    ("heartbeat_at", "'2026-01-01T10:00:00+02:00'", datetime(2026, 1, 1, 8)),  # in UTC, naive as the schema's
    ("final_step", "'x'", "runs.final_step holds 'x', not a whole number"),
    ("window", "8.5", "runs.window holds 8.5, not a whole number"),
    ("wall_seconds", "X'00ff'", "runs.wall_seconds holds X'00ff', not a number"),
    ("heartbeat_at", "'it''s late'", "runs.heartbeat_at holds 'it''s late', not a time (the database was edited "
                                     "by hand?): correct it where heartbeat_at = 'it''s late'"),
    ("heartbeat_at", "1767225600", "runs.heartbeat_at holds 1767225600, not a time"),
])
def test_a_value_edited_by_hand_reads_as_its_columns_type_or_is_named(tmp_path, column, stored, read):
    """SQLite keeps any value in any column: a value of another type read as one of the column's
    where it is one, and named with its column otherwise, where SQLAlchemy raised a ValueError
    (a time) or handed the text on to arithmetic and formatting (a number)."""
    from sqlalchemy import select

    from fibctl.db.schema import Run

    db = str(tmp_path / "r.db")
    add_runs(connect(db), [RunConfig.resolve("r1", "m", "micro", schedule="fixed", window=8)])
    with create_engine(resolve_url(db), poolclass=NullPool).begin() as conn:
        conn.execute(text(f"UPDATE runs SET {column} = {stored}"))
    with connect_readonly(db).connect() as conn:
        if isinstance(read, str):
            with pytest.raises(FibctlError, match=re.escape(read)):
                conn.execute(select(Run.__table__.c[column])).all()
        else:
            value = conn.execute(select(Run.__table__.c[column])).scalar()
            assert value == read and type(value) is type(read)


def test_foreign_database_is_refused(db_url):
    engine = create_engine(resolve_url(db_url), poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE metrics (x INTEGER)"))
    with pytest.raises(FibctlError, match="not a fibctl database"):
        connect(db_url)
    assert inspect(engine).get_table_names() == ["metrics"]


def test_missing_database_or_directory(tmp_path):  # SQLite only: files and folders
    with pytest.raises(FibctlError, match="does not exist"):
        connect(str(tmp_path / "nope" / "x.db"))
    with pytest.raises(FibctlError, match="no database at"):
        connect(str(tmp_path / "x.db"), create=False)
    with pytest.raises(FibctlError, match="no database at"):
        connect_readonly(str(tmp_path / "x.db"))
    assert not (tmp_path / "x.db").exists()
    connect(str(tmp_path / "x.db")).dispose()  # create=True makes it
    assert connect(str(tmp_path / "x.db"), create=False)


def test_readonly_connection_refuses_writes(db_url):
    db = db_url
    add_runs(connect(db), [RunConfig.resolve("r1", "m", "micro", schedule="fixed")])
    engine = connect_readonly(db)
    # each driver's class for it: sqlite3's OperationalError, PostgreSQL's SQLSTATE 25006 (class 25)
    refused = OperationalError if engine.dialect.name == "sqlite" else InternalError
    with engine.connect() as conn:
        assert conn.execute(text("SELECT name FROM runs")).scalar() == "r1"
        with pytest.raises(refused, match="readonly|read-only"):
            conn.execute(text("DELETE FROM runs"))
    with connect(db).connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 1


@pytest.mark.parametrize("name", ["q?x.db", "a#b.db", "a%41.db"])
def test_a_read_only_connection_reads_the_file_named_whatever_its_characters(name, tmp_path, monkeypatch):
    """The read-only URL's quoted name was decoded again on its way to SQLite: `--db 'q?x.db'`
    (a SQLite URI's query) created and read an empty file `q`, `--db 'a#b.db'` one named `a`,
    and `--db a%41.db` read the database aA.db."""
    monkeypatch.chdir(tmp_path)
    for db, run in ((name, "r1"), ("aA.db", "other")):
        add_runs(connect(db), [RunConfig.resolve(run, "m", "micro", schedule="fixed")])
    release()  # as every command ends: the -wal and -shm files go
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "aA.db"])
    with connect_readonly(name).connect() as conn:
        assert conn.execute(text("SELECT name FROM runs")).scalars().all() == ["r1"]
    release()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, "aA.db"])


def test_read_only_commands_leave_a_wal_database_and_its_folder_as_they_were(tmp_path):
    """SQLite makes -wal and -shm files for every connection to a WAL database and keeps them
    after a read-only one: each command below must leave the folder byte for byte as it was."""
    import hashlib
    import subprocess
    import sys

    from fibctl.db.engine import connect
    from fibctl.queue import add_runs
    from train_helpers import micro_run

    db = tmp_path / "r.db"
    engine = connect(str(db))
    add_runs(engine, [micro_run("a")])
    engine.dispose()
    state = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}  # noqa: E731
    before = state()
    assert list(before) == ["r.db"]
    for args in (["queue", "ls"], ["status"], ["db", "current"], ["report", "table1"], ["sql", "select 1"],
                 ["sql", "select * from nope"], ["figure", "alphas", "--out", str(tmp_path / "no" / "a.png")],
                 ["sample", "a"]):
        done = subprocess.run([sys.executable, "-m", "fibctl", *args, "--db", str(db)], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert state() == before, (args, done.stderr)


MEMORY = ["sqlite://", "sqlite:///:memory:", "sqlite+pysqlite:///:memory:", ":memory:",
          "sqlite:///file::memory:?cache=shared&uri=true", "sqlite:///file:scratch?mode=memory&uri=true"]


@pytest.mark.parametrize("db", MEMORY)
def test_an_in_memory_database_is_refused(db, tmp_path, monkeypatch):
    """It would be gone when the command ends: `db upgrade` said "already at revision None"
    and `queue add` "no such table: runs"."""
    monkeypatch.chdir(tmp_path)
    for open_ in (resolve_url, connect, connect_readonly, upgrade):
        with pytest.raises(FibctlError, match=r"^--db .* is an in-memory database: it keeps nothing between "
                                              r"commands; name a file"):
            open_(db)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["db", "upgrade"], ["db", "current"], ["queue", "add", "demo"],
                                  ["queue", "ls"], ["sql", "select 1"]])
def test_cli_refuses_an_in_memory_database_in_one_line(args, tmp_path, monkeypatch, capsys):
    import sys

    from fibctl.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fibctl", *args, "--db", "sqlite://"])
    with pytest.raises(SystemExit) as exit_:  # the entry point in this process: no new Python to start
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [
        "error: --db sqlite:// is an in-memory database: it keeps nothing between commands; name a file "
        "(e.g. results.db)"]


def test_a_sqlite_url_option_its_driver_would_ignore_is_refused(tmp_path, monkeypatch, capsys):
    """`sqlite:///r.db?mode=ro`: SQLAlchemy warned in two lines of Python and ignored it, and
    `queue add` then made and wrote the database the user had asked to open read-only."""
    import sys

    from fibctl.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "add", "demo", "--db", "sqlite:///r.db?mode=ro"])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr()
    assert exit_.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [
        "error: --db sqlite:///r.db?mode=ro: the SQLite driver ignores mode without uri=true; name the file "
        "alone (commands that only read open it read-only themselves)"]
    assert list(tmp_path.iterdir()) == []
    resolve_url("sqlite:///r.db?timeout=5")  # one the driver takes


@pytest.mark.parametrize("url", ["postgresql+psycopg://u:secret@localhost:notaport/x",
                                 "postgresql://u@[::1/x"])
def test_a_url_whose_port_is_not_a_number_is_one_line(url, tmp_path, monkeypatch, capsys):
    """SQLAlchemy's parser raises ValueError, not ArgumentError, for such a port: it was a
    traceback, from every --db command."""
    import sys

    from fibctl.__main__ import main

    for args in (["queue", "ls", "--db", url], ["db", "copy", "--from", url, "--to", str(tmp_path / "t.db")]):
        monkeypatch.setattr(sys, "argv", ["fibctl", *args])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "is not a database URL" in err and "secret" not in err, err
        assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_never_answers_fails_in_one_line_instead_of_hanging(tmp_path):
    """A server that takes the TCP connection and says nothing (a firewall, a wedged host):
    every --db command hung (psycopg waits 130 s, libpq forever) until fibctl gave the
    connection a timeout of its own. Within a generous bound: the default, then
    PGCONNECT_TIMEOUT's."""
    import os
    import socket
    import subprocess
    import sys
    import threading

    pytest.importorskip("psycopg")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    held = []  # accepted and never answered

    def accept():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    url = f"postgresql+psycopg://fib@127.0.0.1:{port}/fib"
    env = {k: v for k, v in os.environ.items() if k != "PGCONNECT_TIMEOUT"}
    try:
        for extra, waited in (({}, "10"), ({"PGCONNECT_TIMEOUT": "2"}, "2")):
            done = subprocess.run([sys.executable, "-m", "fibctl", "db", "current", "--db", url],
                                  capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**env, **extra})
            assert done.returncode == 2
            assert done.stderr.strip().splitlines() == [
                f"error: the database server 127.0.0.1:{port} did not answer within {waited} s ({url}); "
                "is it up, and is that its address?"]
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert held  # the connections did reach the listener


def test_a_database_whose_folder_cannot_be_written_says_so():
    """`db upgrade --db rodir/new.db` said "unable to open database file". Root may write
    anywhere, so as root the upgrade runs in a child process that has given up root; a
    database in a writable folder beside it is the control."""
    import os
    import shutil
    import tempfile

    base = tempfile.mkdtemp()  # not under pytest's root-only folder: the child must reach it
    try:
        os.chmod(base, 0o755)
        for name, mode in (("ro", 0o555), ("rw", 0o777)):
            os.mkdir(os.path.join(base, name), mode)
            os.chmod(os.path.join(base, name), mode)
        # `db upgrade` builds a new file under a temporary name (upgraded_or_created): named the same
        outcomes = _without_root(lambda: [_outcome(call, os.path.join(base, d, name))
                                          for call, name in ((upgrade, "new.db"), (upgraded_or_created, "whole.db"))
                                          for d in ("ro", "rw")])
        assert outcomes == [f"cannot create database {base}/ro/{name}: directory {base}/ro is not writable"
                            if d == "ro" else f"(None, '{head_revision()}')"
                            for name in ("new.db", "whole.db") for d in ("ro", "rw")]
    finally:
        os.chmod(os.path.join(base, "ro"), 0o755)
        shutil.rmtree(base)


def test_reading_a_wal_database_one_cannot_write_leaves_no_files_beside_it():
    """A read-only command on a WAL database whose file (not folder) this user cannot write
    left -wal and -shm files that nothing removed. Root may write anywhere: as root the read
    runs in a child process that has given up root."""
    import os
    import shutil
    import tempfile

    from fibctl.db.engine import release

    base = tempfile.mkdtemp()  # not under pytest's root-only folder: the child must reach it
    try:
        os.chmod(base, 0o777)
        db = os.path.join(base, "r.db")
        connect(db).dispose()  # a WAL database
        os.chmod(db, 0o444)

        def read():
            engine = connect_readonly(db)
            with engine.connect() as conn:
                runs = conn.execute(text("SELECT count(*) FROM runs")).scalar()
            release()
            return [runs, sorted(os.listdir(base))]
        assert _without_root(read) == [0, ["r.db"]]
    finally:
        shutil.rmtree(base)


def test_a_database_under_a_file_or_a_missing_folder_is_refused(tmp_path):
    (tmp_path / "a.db").write_bytes(b"")
    with pytest.raises(FibctlError, match=f"^cannot create database {tmp_path}/a.db/new.db: {tmp_path}/a.db "
                                          "is not a directory$"):
        upgrade(str(tmp_path / "a.db" / "new.db"))
    with pytest.raises(FibctlError, match="directory .*/nope does not exist"):
        upgrade(str(tmp_path / "nope" / "new.db"))


def test_a_path_ending_in_a_slash_names_a_folder_not_a_file(tmp_path):
    """`db copy --to adir/` made a SQLite file named adir."""
    for call in (upgrade, connect_readonly):
        with pytest.raises(FibctlError, match="adir/ ends with '/': name a database file, not a folder"):
            call(f"{tmp_path}/adir/")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("db", [".", "./", "/", "sqlite:////"])
def test_a_folder_without_a_name_is_refused_as_a_folder(db, tmp_path, monkeypatch):
    """`--db .` or `--db /` was a ValueError traceback (no name to put -wal beside)."""
    monkeypatch.chdir(tmp_path)
    for call in (upgrade, connect_readonly):
        with pytest.raises(FibctlError, match="is a directory, not a database file$"):
            call(db)
    assert list(tmp_path.iterdir()) == []


def _outcome(call, *args) -> str:
    try:
        return str(call(*args))
    except FibctlError as e:
        return str(e)


def _without_root(call):
    """call()'s result; as root, from a forked child running as nobody (the interpreter may
    live where nobody can read it, so a new process could not start)."""
    import json
    import os

    if os.geteuid() != 0:
        return call()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, json.dumps(call()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    assert out, "the child running as nobody reported nothing"
    return json.loads(out)
