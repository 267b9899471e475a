"""`fibctl db copy` never moves a run backwards: a target that has a run further along (or
with results the source lacks) keeps it, and its metrics, as they were; the source's rows
only add. The target is each backend in turn (`db_url`), the source a SQLite file. And
`db copy`'s messages name the option (--from, --to) the user gave the database with."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime

import pytest
from sqlalchemy import select, text

from conftest import NO_PG, PG_SERVER, pg_database
from fibctl.db import schema
from fibctl.db.copy import AS_FAR, FURTHER, METRIC_TABLES, MORE_RESULTS, copy_database, counts
from fibctl.db.engine import connect
from fibctl.db.store import RunRecorder
from fibctl.errors import FibctlError
from fibctl.queue import add_runs
from train_helpers import micro_run

RUNS = ("a", "b")


def recorder(engine, name: str) -> RunRecorder:
    with engine.connect() as conn:
        return RunRecorder(engine, conn.execute(select(schema.Run.id).where(schema.Run.name == name)).scalar_one())


def trained(engine, name: str, loss: float = 1.0) -> None:
    """The run done, with what training records: results, a train step, an evaluation, an event."""
    rec = recorder(engine, name)
    rec.update_run(status="done", attempts=1, final_step=30, tokens_trained=30 * 512, params_total=1000,
                   params_non_embedding=800, wall_seconds=12.5, checkpoint_path=f"{name}/step_30.pt",
                   finished_at=datetime(2026, 1, 2))
    rec.log_step(30, loss, 1e-3)
    rec.log_eval(30, "math_val", 64, 4096, loss)
    rec.event("done", "trained")


def snapshot(engine) -> dict[str, list[str]]:
    """Every row of every table the copy writes, ids included."""
    with engine.connect() as conn:
        return {m.__tablename__: sorted(map(repr, conn.execute(select(m.__table__)).all()))
                for m in (schema.Run, *METRIC_TABLES, schema.Event)}


def databases(target_url: str, tmp_path, names=("a",)):
    """The target and the source, each with the same runs queued (same names and configs)."""
    target, source = connect(target_url), connect(str(tmp_path / "source.db"))
    for engine in (target, source):
        add_runs(engine, [micro_run(n) for n in names])
    return target, source


def test_a_stale_queued_copy_leaves_done_runs_and_their_metrics_as_they_were(db_url, tmp_path):
    """The audit's case: the same runs queued again elsewhere, copied onto a database where
    they were trained. Nothing in the target changes, now or when copied again."""
    target, source = databases(db_url, tmp_path, RUNS)
    for name in RUNS:
        trained(target, name)
    before = snapshot(target)
    summary = copy_database(source, target)
    assert summary.kept == {"a": FURTHER, "b": FURTHER} and summary.written == 0
    assert snapshot(target) == before
    again = copy_database(source, target)
    assert again.written == 0 and snapshot(target) == before


def test_a_kept_run_gains_only_the_metrics_it_lacks(db_url, tmp_path):
    target, source = databases(db_url, tmp_path)
    trained(target, "a", loss=1.0)
    stopped = recorder(source, "a")  # an attempt elsewhere that failed early
    stopped.update_run(status="failed", final_step=10, error="out of memory")
    stopped.log_step(30, 9.0, 1e-3)  # the target's key: its value stays
    stopped.log_eval(10, "math_val", 64, 4096, 3.0)  # a key the target lacks: added
    summary = copy_database(source, target)
    assert summary.kept == {"a": FURTHER}
    assert (summary.rows["train_steps"], summary.rows["evaluations"]) == (0, 1)
    with target.connect() as conn:
        assert conn.execute(text("SELECT status, final_step, error FROM runs WHERE name = 'a'")).one() == (
            "done", 30, None)
        assert conn.execute(text("SELECT step, loss FROM train_steps")).all() == [(30, 1.0)]
        assert conn.execute(text("SELECT step, loss FROM evaluations ORDER BY step")).all() == [(10, 3.0), (30, 1.0)]


def test_a_retried_run_keeps_the_progress_the_source_lacks(db_url, tmp_path):
    """Queued again after a failure, it keeps its checkpoint and final step to resume from:
    a source row that failed without either does not take its place."""
    target, source = databases(db_url, tmp_path)
    recorder(target, "a").update_run(final_step=20, checkpoint_path="a/step_20.pt")
    recorder(source, "a").update_run(status="failed", error="killed")
    before = snapshot(target)
    assert copy_database(source, target).kept == {"a": MORE_RESULTS}
    assert snapshot(target) == before


def test_runs_as_far_along_but_recorded_otherwise_stay_as_the_target_has_them(db_url, tmp_path):
    target, source = databases(db_url, tmp_path)
    recorder(source, "a").update_run(created_at=datetime(2020, 1, 1))
    before = snapshot(target)
    assert copy_database(source, target).kept == {"a": AS_FAR}
    assert snapshot(target) == before


def test_a_run_further_along_in_the_source_moves_the_target_on(db_url, tmp_path):
    target, source = databases(db_url, tmp_path)
    trained(source, "a")
    recorder(target, "a").log_step(10, 5.0, 1e-3)  # the target's own row of another key stays
    summary = copy_database(source, target)
    assert summary.kept == {} and summary.rows["runs"] == 1
    with target.connect() as conn:
        assert conn.execute(text("SELECT status, final_step, checkpoint_path FROM runs WHERE name = 'a'")).one() == (
            "done", 30, "a/step_30.pt")
        assert conn.execute(text("SELECT step, loss FROM train_steps ORDER BY step")).all() == [(10, 5.0), (30, 1.0)]
        assert conn.execute(text("SELECT kind FROM events")).all() == [("done",)]


def fibctl(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "COLUMNS": "80"})


def test_cli_copy_says_how_many_runs_it_kept_and_why(tmp_path):
    target, source = databases(str(tmp_path / "target.db"), tmp_path, RUNS)
    for name in RUNS:
        trained(target, name)
    before = snapshot(target)
    done = fibctl("db", "copy", "--from", "source.db", "--to", "target.db", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert " ".join(done.stdout.split()) == ("source.db -> target.db: wrote nothing "
                                             "kept 2 run(s) as the target has them: 2 further along there")
    assert snapshot(target) == before


def test_cli_copy_of_a_run_whose_events_the_target_has_succeeds(tmp_path):
    """A run's events are copied only where the target has none of it (by design); the check
    of the row counts after the copy then said "the copy holds fewer rows than the source in
    events" and exited 2, though the copy had committed as meant."""
    target, source = databases(str(tmp_path / "target.db"), tmp_path)
    recorder(target, "a").event("cancelled", "by the user")  # the shared queue's own history
    trained(source, "a")
    recorder(source, "a").event("finished")
    done = fibctl("db", "copy", "--from", "source.db", "--to", "target.db", cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    with target.connect() as conn:
        assert conn.execute(select(schema.Run.status)).scalars().all() == ["done"]
        assert conn.execute(select(schema.Event.kind)).scalars().all() == ["cancelled"]


@pytest.mark.parametrize("args, line", [
    (["--from", "source.db", "--to", "foo://x"], "--to foo://x: unknown database kind 'foo'"),
    (["--from", "foo://x", "--to", "new.db"], "--from foo://x: read-only access supports"),
    (["--from", "source.db", "--to", "sqlite://"], "--to sqlite:// is an in-memory database"),
    (["--from", "sqlite:///:memory:", "--to", "new.db"], "--from sqlite:///:memory: is an in-memory database"),
    (["--from", "source.db", "--to", " "], "--to is empty"),
    (["--from", "source.db", "--to", "sqlite://x:y:z@@/"], "--to "),
    # a special file or a folder: it said "/dev/null is not a regular file, not a database file"
    (["--from", "source.db", "--to", "/dev/null"], "--to /dev/null is not a regular file: name a database file or URL"),
    (["--from", "source.db", "--to", "pipe"], "--to pipe is not a regular file: name a database file or URL"),
    (["--from", "pipe", "--to", "new.db"], "--from pipe is not a regular file: name a database file or URL"),
    (["--from", "source.db", "--to", "adir"], "--to adir is a directory, not a database file"),
    (["--from", "source.db", "--to", "notes.txt"], "--to notes.txt is not a SQLite database"),
])
def test_cli_copy_names_the_option_it_refuses(tmp_path, args, line):
    connect(str(tmp_path / "source.db")).dispose()
    os.mkfifo(tmp_path / "pipe")  # nothing writes to it: reading its header would wait forever
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("notes\n")
    done = fibctl("db", "copy", *args, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [error] = done.stderr.strip().splitlines()
    assert error.startswith(f"error: {line}") and "--db" not in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "notes.txt", "pipe", "source.db"]  # nothing created


def test_a_copy_stopped_part_way_leaves_the_target_as_it_was(db_url, tmp_path, monkeypatch):
    """One transaction: a copy that fails at its events (the last table it writes; a signal, a
    lost server) writes nothing. Committed table by table, it left done runs without their
    metrics, which the reports then read."""
    import fibctl.db.copy as copy
    target, source = databases(db_url, tmp_path, RUNS)
    for name in RUNS:
        trained(source, name)
    before = snapshot(target)

    def lost(*args, **kwargs):
        raise ConnectionError("the server went away")

    monkeypatch.setattr(copy, "_copy_events", lost)
    with pytest.raises(ConnectionError):
        copy_database(source, target)
    assert snapshot(target) == before
    monkeypatch.undo()
    assert copy_database(source, target).rows["events"] == 2  # copied again: whole
    assert counts(target) == counts(source)


@pytest.mark.skipif(not PG_SERVER, reason=NO_PG)
def test_a_nan_the_sqlite_target_cannot_hold_is_refused_and_nothing_copied(tmp_path):
    """PostgreSQL holds NaN; SQLite stores NULL instead. The copy died with a traceback on a
    NaN loss (NOT NULL), and would have turned a NaN in a nullable column into NULL."""
    with pg_database() as url:
        source = connect(url)
        add_runs(source, [micro_run("a")])
        recorder(source, "a").log_eval(30, "math_val", 64, 4096, float("nan"))
        target = connect(str(tmp_path / "target.db"))
        before = snapshot(target)
        with pytest.raises(FibctlError, match="^evaluations.loss of run 'a' is NaN, which SQLite cannot hold"):
            copy_database(source, target)
        source.dispose()
    assert snapshot(target) == before


@pytest.mark.skipif(not PG_SERVER, reason=NO_PG)
def test_db_copy_refuses_the_nan_before_it_touches_an_existing_sqlite_target(tmp_path, monkeypatch, capsys):
    """`db copy` made that refusal inside its transaction, after it had switched the target
    to WAL mode (and would have upgraded an older one): a refused copy leaves it as it was."""
    import hashlib
    import sqlite3

    from cli_helpers import refused
    from fibctl.db.engine import release

    db = tmp_path / "target.db"
    add_runs(connect(str(db)), [micro_run("other")])
    release()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with pg_database() as url:
        source = connect(url)
        add_runs(source, [micro_run("a"), micro_run("b")])
        recorder(source, "b").log_step(5, 2.0, 1e-3, float("nan"))  # train_steps: met first
        recorder(source, "a").log_eval(30, "math_val", 64, 4096, float("nan"))
        source.dispose()
        line = refused(monkeypatch, capsys, "db", "copy", "--from", url, "--to", str(db))
    assert line.startswith("error: train_steps.grad_norm of run 'b' is NaN, which SQLite cannot hold"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target.db"]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sqlite3.connect(db).execute("PRAGMA journal_mode").fetchone()[0] == "delete"


@pytest.mark.parametrize("to", ["new.db", "sqlite:///new.db"])
def test_db_copy_names_the_target_the_user_gave_not_its_temporary(tmp_path, monkeypatch, capsys, to):
    """A new SQLite target is built as .new.db.partial-PID-HEX: a failure there (a full disk
    failing its upgrade) named that hidden file, gone by the time the user read the line."""
    import sqlite3

    from alembic import command

    from cli_helpers import refused
    from fibctl.db.engine import head_revision

    add_runs(connect(str(tmp_path / "source.db")), [micro_run("a")])
    monkeypatch.chdir(tmp_path)

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(command, "upgrade", full)
    line = refused(monkeypatch, capsys, "db", "copy", "--from", "source.db", "--to", to)
    assert line == f"error: upgrading {to} to {head_revision()} failed, nothing changed: database or disk is full\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.db"]
