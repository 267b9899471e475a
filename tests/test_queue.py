"""The run queue: idempotent adds, cancel/retry, atomic claims under concurrency,
reclaiming runs whose worker died, and the CLI's handling of bad input."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from fibctl import queue
from fibctl.config import RunConfig
from fibctl.db.engine import connect, resolve_url
from fibctl.db.store import RunRecorder
from fibctl.durable import pid_space
from fibctl.errors import FibctlError
from fibctl.matrix import load_matrix


def _configs(n: int, **kw) -> list[RunConfig]:
    return [RunConfig.resolve(f"r{i:03d}", "test", "micro", schedule="fixed", seed=i, **kw) for i in range(n)]


@pytest.fixture
def db(db_url):
    """A fresh database: a SQLite file, and one on the FIBCTL_TEST_PG server (tests/conftest.py)."""
    return db_url


def _events(engine, run_id):
    with engine.connect() as conn:
        return [r.kind for r in conn.execute(text("SELECT kind FROM events WHERE run_id = :r ORDER BY id"),
                                              {"r": run_id})]


def test_add_is_idempotent(db):
    engine = connect(db)
    configs = load_matrix("demo").resolve()
    assert queue.add_runs(engine, configs) == ([c.name for c in configs], [])
    assert queue.add_runs(engine, configs) == ([], [c.name for c in configs])
    runs = queue.list_runs(engine)
    assert [(r["name"], r["status"], r["attempts"]) for r in runs] == [(c.name, "queued", 0) for c in configs]
    assert runs[0]["created_at"] is not None and runs[0]["base"] is None  # dense


def test_conflicting_add_names_the_differing_fields_and_adds_nothing(db):
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    clash = [_configs(2)[1], RunConfig.resolve("r000", "test", "micro", schedule="fixed", seed=0, window=4)]
    with pytest.raises(FibctlError, match="r000 differs in model.window"):
        queue.add_runs(engine, clash)
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000"]  # r001 not added either


def test_cancel_and_retry(db):
    engine = connect(db)
    queue.add_runs(engine, _configs(2))
    queue.cancel(engine, "r000")
    assert [r["name"] for r in queue.list_runs(engine, status="cancelled")] == ["r000"]
    with pytest.raises(FibctlError, match="cannot cancel run 'r000': it is cancelled"):
        queue.cancel(engine, "r000")
    with pytest.raises(FibctlError, match="cannot retry run 'r001': it is queued"):
        queue.retry(engine, "r001")
    with pytest.raises(FibctlError, match="no run named 'nope'"):
        queue.cancel(engine, "nope")
    with pytest.raises(FibctlError, match="unknown status"):
        queue.list_runs(engine, status="sleeping")

    claimed = queue.claim_next(engine, "w1")
    assert claimed.name == "r001"  # the cancelled run is skipped
    queue.fail(engine, claimed.id, "RuntimeError: boom\ntraceback...")
    queue.retry(engine, "r001")
    queue.retry(engine, "r000")
    assert queue.status_counts(engine) == {"queued": 2}
    assert queue.list_runs(engine, status="queued")[1]["attempts"] == 0
    assert _events(engine, claimed.id) == ["claimed", "failed", "retried"]


def test_claim_release_finish(db):
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    run = queue.claim_next(engine, "w1", host="h", device="cpu")
    assert (run.name, run.attempts, run.config) == ("r000", 1, _configs(1)[0])
    assert queue.claim_next(engine, "w2") is None  # the only run is taken and alive
    assert queue.release(engine, run.id)
    run = queue.claim_next(engine, "w2")
    assert (run.name, run.attempts) == ("r000", 1)  # a clean stop used no attempt
    queue.finish(engine, run.id)
    (row,) = queue.list_runs(engine)
    assert (row["status"], row["worker"], row["finished_at"] is not None) == ("done", "w2", True)
    assert queue.claim_next(engine, "w3") is None


def _claim_all(db: str, worker: str, barrier, out_path: str) -> None:
    """Worker process: claim until the queue is empty; write what it got, or its error."""
    result = {"ids": [], "error": None}
    try:
        engine = connect(db)
        barrier.wait()
        while (run := queue.claim_next(engine, worker)) is not None:
            result["ids"].append(run.id)
    except Exception as e:  # reported to the test, which fails on it
        result["error"] = f"{type(e).__name__}: {e}"
    with open(out_path, "w") as f:
        json.dump(result, f)


def eight_claimers_take_each_of_200_runs_once(db: str, tmp_path) -> None:
    """8 processes claim a queue of 200 runs at once: each run claimed exactly once, no error."""
    queue.add_runs(connect(db), _configs(200))
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(8)
    outs = [str(tmp_path / f"w{i}.json") for i in range(8)]
    procs = [ctx.Process(target=_claim_all, args=(db, f"w{i}", barrier, outs[i])) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = [json.load(open(o)) for o in outs]
    assert [r["error"] for r in results] == [None] * 8
    assert sorted(i for r in results for i in r["ids"]) == list(range(1, 201))
    engine = connect(db)
    assert queue.status_counts(engine) == {"running": 200}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events WHERE kind = 'claimed'")).scalar() == 200


def test_eight_workers_claim_each_run_exactly_once(db, tmp_path):
    eight_claimers_take_each_of_200_runs_once(db, tmp_path)


def _claim_and_die(db: str) -> None:
    queue.claim_next(connect(db), "doomed")
    os._exit(1)  # no release, no cleanup: the run is left 'running' with a stale heartbeat


def test_dead_worker_run_is_reclaimed_then_failed_after_max_attempts(db):
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    p = mp.get_context("fork").Process(target=_claim_and_die, args=(db,))
    p.start()
    p.join(60)
    assert p.exitcode == 1
    (row,) = queue.list_runs(engine)
    assert (row["status"], row["worker"], row["attempts"]) == ("running", "doomed", 1)

    assert queue.claim_next(engine, "w2", heartbeat_timeout_s=60) is None  # not stale yet
    time.sleep(0.3)
    run = queue.claim_next(engine, "w2", heartbeat_timeout_s=0.2, max_attempts=2)
    assert (run.name, run.attempts) == ("r000", 2)
    assert RunRecorder(engine, run.id, worker="doomed").heartbeat() is False  # not its run any more
    assert RunRecorder(engine, run.id, worker="w2").heartbeat() is True

    time.sleep(0.3)  # w2 goes silent too; two attempts are used up
    assert queue.claim_next(engine, "w3", heartbeat_timeout_s=0.2, max_attempts=2) is None
    (row,) = queue.list_runs(engine)
    assert row["status"] == "failed" and "abandoned: no heartbeat" in row["error"]
    assert _events(engine, run.id) == ["claimed", "reclaimed", "abandoned"]


def test_train_by_name_takes_at_once_a_run_whose_worker_on_this_machine_has_ended(db):
    """`fibctl train NAME` again after a kill was refused ('is running on host:pid') until the
    heartbeat was 10 minutes old, saying neither; a live worker's run is still refused, with
    its heartbeat's age and the way a dead one elsewhere is taken."""
    import socket

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    live = f"{socket.gethostname()}:{os.getpid()}"
    queue.claim_named(engine, "r000", live, "h", "cpu", 600)
    with pytest.raises(FibctlError, match=rf"is running on {live} \(heartbeat \d+s ago\); .* older than "
                                          r"--heartbeat-timeout \(10m00s\)"):
        queue.claim_named(engine, "r000", "w2", "h", "cpu", 600)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    with engine.begin() as conn:  # as a worker killed mid-run leaves it: running, heartbeat fresh
        conn.execute(text("UPDATE runs SET worker = :w"), {"w": f"{socket.gethostname()}:{ended.pid}"})
    run = queue.claim_named(engine, "r000", "w2", "h", "cpu", 600)
    assert (run.name, run.attempts) == ("r000", 2)
    (row,) = queue.list_runs(engine)
    assert (row["status"], row["worker"]) == ("running", "w2")
    assert _event_rows(engine, run.id)[-1][1].endswith("on this machine had ended")



def test_train_by_name_leaves_a_run_whose_worker_runs_in_another_pid_space_of_the_same_host_name(db, monkeypatch):
    """Two containers of one host name (docker --network host, a cluster's identical names)
    see different processes: a worker alive in one looked ended from the other, whose
    `fibctl train NAME` took its run at once, two trainers on one run. Its claim says where
    its PID means something; a claim that does not (an older fibctl's) waits for the timeout."""
    import socket

    from fibctl import durable

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # its PID, here: no process; in the other container, the live worker's
    worker = f"{socket.gethostname()}:{ended.pid}"
    with monkeypatch.context() as other:
        other.setattr(durable, "pid_space", lambda: "0123456789ab")
        queue.claim_named(engine, "r000", worker, "h", "cpu", 600)
    with pytest.raises(FibctlError, match=rf"is running on {worker} \(heartbeat \d+s ago\)"):
        queue.claim_named(engine, "r000", "w2", "h", "cpu", 600)
    with engine.begin() as conn:  # as an older fibctl recorded its claim: no PID space
        conn.execute(text("UPDATE events SET data = :d"), {"d": json.dumps({"attempt": 1})})
    with pytest.raises(FibctlError, match=rf"is running on {worker} "):
        queue.claim_named(engine, "r000", "w2", "h", "cpu", 600)
    time.sleep(0.3)  # its heartbeat goes stale: taken, as any silent worker's run
    run = queue.claim_named(engine, "r000", "w2", "h", "cpu", 0.2)
    assert (run.name, run.attempts) == ("r000", 2)
    assert not _event_rows(engine, run.id)[-1][1].endswith("had ended")


def _event_rows(engine, run_id):
    from sqlalchemy import select

    from fibctl.db.schema import Event

    with engine.connect() as conn:  # through the ORM column: `data` read back as JSON on both backends
        return [tuple(r) for r in conn.execute(
            select(Event.kind, Event.message, Event.data).where(Event.run_id == run_id).order_by(Event.id))]


def claims_sweep_reclaim_and_record(db: str) -> None:
    """One claim fails an abandoned run that used its attempts (even while a queued run is
    what it claims), reclaims one under the limit naming its previous worker, and records
    each claim's attempt, host, device and times."""
    engine = connect(db)
    queue.add_runs(engine, _configs(3))
    first = queue.claim_next(engine, "w1", host="h1", device="cpu")  # r000, attempt 1
    second = queue.claim_next(engine, "w2", host="h2", device="cpu")  # r001, attempt 1
    with engine.begin() as conn:  # both go silent; r000 has used its only attempt
        conn.execute(text("UPDATE runs SET heartbeat_at = :t, attempts = 2 WHERE id = :i"),
                     {"t": queue.utcnow() - timedelta(seconds=120), "i": first.id})
        conn.execute(text("UPDATE runs SET heartbeat_at = :t WHERE id = :i"),
                     {"t": queue.utcnow() - timedelta(seconds=120), "i": second.id})
    before = queue.utcnow()
    run = queue.claim_next(engine, "w3", host="h3", device="cuda:0", heartbeat_timeout_s=60, max_attempts=2)
    assert (run.name, run.attempts) == ("r001", 2)  # the abandoned run comes before the queued r002
    rows = {r["name"]: r for r in queue.list_runs(engine)}
    assert rows["r000"]["status"] == "failed"
    assert rows["r000"]["error"] == "abandoned: no heartbeat for 60 s after 2 attempt(s)"
    assert _event_rows(engine, first.id)[-1] == (
        "abandoned", "abandoned: no heartbeat for 60 s after 2 attempt(s) (last worker w1)", None)
    r1 = rows["r001"]
    assert (r1["status"], r1["worker"], r1["host"], r1["device"], r1["attempts"]) == ("running", "w3", "h3", "cuda:0", 2)
    assert r1["heartbeat_at"] >= before and r1["started_at"] < before  # started_at kept from attempt 1
    here = pid_space()  # where the claimer's PIDs mean something: fibctl train NAME's take-back reads it
    assert _event_rows(engine, second.id) == [
        ("claimed", "claimed by w2", {"attempt": 1, "pid_space": here}),
        ("reclaimed", "taken from w2 (no heartbeat for 60 s) by w3",
         {"previous_worker": "w2", "attempt": 2, "pid_space": here})]

    third = queue.claim_next(engine, "w4", host="h4", device="cpu", heartbeat_timeout_s=60, max_attempts=2)
    assert third.name == "r002" and _event_rows(engine, third.id) == [
        ("claimed", "claimed by w4", {"attempt": 1, "pid_space": here})]
    r2 = next(r for r in queue.list_runs(engine) if r["name"] == "r002")
    assert r2["started_at"] == r2["heartbeat_at"] and r2["started_at"] >= before
    assert queue.claim_next(engine, "w5", heartbeat_timeout_s=60, max_attempts=2) is None
    assert queue.status_counts(engine) == {"failed": 1, "running": 2}


def test_a_worker_whose_run_was_taken_over_leaves_the_new_claim_alone(db):
    """A worker that stalled past another's heartbeat timeout finds its run reclaimed: its
    finish, fail, release and row updates change nothing; the new owner's still work."""
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    old = queue.claim_next(engine, "w1")
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET heartbeat_at = :t WHERE id = :i"),
                     {"t": queue.utcnow() - timedelta(seconds=120), "i": old.id})
    new = queue.claim_next(engine, "w2", heartbeat_timeout_s=60)
    assert new.id == old.id
    assert not queue.finish(engine, old.id, "w1")
    assert not queue.fail(engine, old.id, "RuntimeError: late", "w1")
    assert not queue.release(engine, old.id, "stopped", "w1")
    RunRecorder(engine, old.id, "w1").update_run(checkpoint_path="w1/step_00000009.pt", final_step=9)
    (row,) = queue.list_runs(engine)
    assert (row["status"], row["worker"], row["error"]) == ("running", "w2", None)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT checkpoint_path, final_step FROM runs")).one() == (None, None)
    assert _events(engine, old.id) == ["claimed", "reclaimed"]
    RunRecorder(engine, new.id, "w2").update_run(final_step=3)
    assert queue.finish(engine, new.id, "w2")
    assert queue.list_runs(engine)[0]["status"] == "done"
    assert not queue.finish(engine, new.id, "w2")  # done already: once


def test_claim_sweeps_reclaims_and_records(db):
    claims_sweep_reclaim_and_record(db)


def test_cancelled_running_run_stops_its_worker(db):
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    run = queue.claim_next(engine, "w1")
    rec = RunRecorder(engine, run.id, worker="w1")
    assert rec.heartbeat() is True
    queue.cancel(engine, "r000")
    assert rec.heartbeat() is False
    assert queue.release(engine, run.id) is False  # stays cancelled


# `fibctl queue add demo` in a new Python, a real SIGINT (or SIGTERM) sent to it at one point
# of the add: once the commit is made (SQLAlchemy's do_commit returned; the signal's handler
# runs at the next bytecode, inside SQLAlchemy), or while the runs' rows are built, before any
# insert
SIGNAL_AT = """import os, signal, sys
from sqlalchemy.engine import default
import fibctl.queue as q
rows, commit = q.run_row, default.DefaultDialect.do_commit
built = []
def run_row(config):
    built.append(config.name)
    if AT == 'rows':
        os.kill(os.getpid(), SIGNAL)
    return rows(config)
def do_commit(self, connection):
    commit(self, connection)
    if AT == 'commit' and built:
        os.kill(os.getpid(), SIGNAL)
q.run_row, default.DefaultDialect.do_commit = run_row, do_commit
sys.argv = ['fibctl', 'queue', 'add', 'demo', '--db', DB]
from fibctl.__main__ import program
program()
"""


@pytest.mark.parametrize("signum, stopped", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")],
                         ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("at, said, queued", [
    ("commit", "{} after the commit: queued 3 run(s); 0 already present", 3),
    ("rows", "{}; nothing was queued", 0)])
def test_a_ctrl_c_or_sigterm_as_queue_add_commits_says_whether_the_runs_were_queued(db, at, said, queued, signum,
                                                                                     stopped):
    """A Ctrl-C just after `queue add` committed said only "interrupted", though every run was
    queued (the same command again said so), and a SIGTERM nothing at all (exit 143). Either is
    held from just before the commit, and the command says what it did; one before the commit
    leaves nothing queued, and says that. Exit 130 after a Ctrl-C, 143 after a SIGTERM."""
    script = SIGNAL_AT.replace("AT ==", f"{at!r} ==").replace("DB]", f"{db!r}]").replace(
        "SIGNAL)", f"signal.{signum.name})")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (128 + signum, "", said.format(stopped) + "\n"), \
        done.stderr[-2000:]
    assert len(queue.list_runs(connect(db))) == queued


def test_queue_add_says_the_command_that_trains_what_it_queued(tmp_path, monkeypatch, capsys):
    """`queued 3 run(s); 0 already present` left a new user at the count, where `fibctl probe`
    names the worker to start: queue add says it too, with its database, and only when it
    queued something (the runs of a second add are the first one's)."""
    from cli_helpers import ran

    db = str(tmp_path / "my results.db")
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "demo", "--db", db, "--preset", "micro")
    assert code == 0, err
    assert out.splitlines() == ["queued 3 run(s); 0 already present. Train them with:",
                                f"  fibctl worker --db '{db}'"], out
    code, out, err = ran(monkeypatch, capsys, "queue", "add", "demo", "--db", db, "--preset", "micro")
    assert (code, out) == (0, "queued 0 run(s); 3 already present\n"), err


def test_cli_queue_add_ls_cancel(db):
    from fibctl.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["queue", "add", "demo", "--db", db, "--preset", "micro", "--only", "fib_*"])
    assert result.exit_code == 0, result.output
    assert "queued 2 run(s); 0 already present" in result.output
    result = runner.invoke(app, ["queue", "add", "demo", "--db", db, "--preset", "micro", "--only", "fib_*"])
    assert "queued 0 run(s); 2 already present" in result.output
    assert runner.invoke(app, ["queue", "cancel", "fib_fixed_w8", "--db", db]).exit_code == 0
    result = runner.invoke(app, ["queue", "ls", "--db", db, "--status", "queued"])
    assert "fib_stagger_w8" in result.output and "fib_fixed_w8" not in result.output
    assert "1 run(s) listed" in result.output and "1 cancelled" in result.output
    result = runner.invoke(app, ["matrix", "show", "paper"])
    assert "f13__fib_stagger_w12" in result.output and "ref_e0000" in result.output
    result = runner.invoke(app, ["db", "current", "--db", db])
    assert "up to date" in result.output


def _main_exit(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run `fibctl ARGS` in this process through fibctl.cli.main; (exit code, stderr)."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err


def test_cli_bad_input_exits_2_and_leaves_database_untouched(tmp_path, monkeypatch, capsys):
    # SQLite only: files that are not databases, and a mistyped path that must not become one
    notes = tmp_path / "notes.txt"
    notes.write_text("not a database\n")
    future = tmp_path / "future.db"
    connect(str(future)).dispose()
    con = sqlite3.connect(future)
    con.execute("UPDATE alembic_version SET version_num = '0099'")
    con.commit()

    cases = [
        (("queue", "ls", "--db", str(notes)), "is not a SQLite database"),
        (("db", "upgrade", "--db", str(future)), "newer fibctl"),
        (("queue", "add", str(tmp_path / "missing.toml"), "--db", str(tmp_path / "x.db")), "no matrix file"),
        (("queue", "add", str(tmp_path), "--db", str(tmp_path / "x.db")), f"{tmp_path} is a folder, not a matrix file"),
    ]
    for args, message in cases:
        code, err = _main_exit(monkeypatch, capsys, *args)
        assert code == 2 and message in err, err
    assert notes.read_text() == "not a database\n"
    assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0099",)]

    # the real entry point, end to end
    proc = subprocess.run([sys.executable, "-m", "fibctl", "queue", "add", "nosuch", "--db", str(tmp_path / "x.db")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown matrix 'nosuch'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.db").exists()


def test_cli_queue_rm_removes_rows_and_with_checkpoints_the_folder(db, tmp_path, monkeypatch, capsys):
    engine = connect(db)
    queue.add_runs(engine, _configs(3))
    runs = tmp_path / "runs"
    for name in ("r000", "r001", "r002"):
        (runs / name).mkdir(parents=True)
        (runs / name / "step_00000010.pt").write_bytes(b"x")
    (tmp_path / "elsewhere").mkdir()
    running = queue.claim_next(engine, "w1")  # r000
    ids = {r["name"]: r["id"] for r in queue.list_runs(engine)}
    recorder = RunRecorder(engine, ids["r001"])
    recorder.log_step(10, 3.0, 1e-3)
    recorder.log_eval(10, "docs_val", 64, 4096, 3.1)
    queue.cancel(engine, "r001")
    def count(table: str, where: str = "", **params) -> int:  # read afresh, as another process would
        with create_engine(resolve_url(db), poolclass=NullPool).connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table} {where}"), params).scalar()

    before = {t: count(t) for t in ("runs", "train_steps", "evaluations", "events")}

    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r000", "--db", db, "--checkpoints",
                           "--runs-dir", str(runs))
    assert code == 2 and err.strip().splitlines() == [
        "error: cannot remove run 'r000': it is running; stop its worker or `fibctl queue cancel r000` first"]
    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "nope", "--db", db)
    assert code == 2 and "no run named 'nope'" in err
    assert {t: count(t) for t in before} == before and (runs / "r000").is_dir()

    code, _ = _main_exit(monkeypatch, capsys, "queue", "rm", "r001", "--db", db)  # rows only
    assert code == 0
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000", "r002"]
    assert count("train_steps") == count("evaluations") == 0  # cascaded
    assert count("events", "WHERE run_id = :r", r=ids["r001"]) == 0
    assert (runs / "r001" / "step_00000010.pt").is_file()

    # a --runs-dir that is no folder (a file, a path through one, a typo) would find no
    # checkpoint folder and leave it behind the deleted rows: refused, the run kept
    (tmp_path / "notes.txt").write_text("mine")
    for wrong in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "runs", tmp_path / "runz"):
        code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r002", "--db", db, "--checkpoints",
                               "--runs-dir", str(wrong))
        assert code == 2 and err.strip().splitlines() == [
            f"error: --runs-dir {wrong} is not a folder; nothing was removed"]
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000", "r002"]

    code, _ = _main_exit(monkeypatch, capsys, "queue", "rm", "r002", "--db", db, "--checkpoints",
                         "--runs-dir", str(runs))
    assert code == 0 and not (runs / "r002").exists() and (runs / "r001").is_dir()
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000"]

    # a checkpoint folder that is a link out of the runs folder is refused, the run kept
    queue.finish(engine, running.id)
    (runs / "r000").rename(tmp_path / "elsewhere" / "r000")
    (runs / "r000").symlink_to(tmp_path / "elsewhere" / "r000")
    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r000", "--db", db, "--checkpoints",
                           "--runs-dir", str(runs))
    assert code == 2 and "not a checkpoint folder" in err
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000"]
    assert (tmp_path / "elsewhere" / "r000" / "step_00000010.pt").is_file()

    # a folder of the run's name holding what fibctl did not write there is refused, the run kept
    (runs / "r000").unlink()
    (runs / "r000" / "tensorboard").mkdir(parents=True)
    (runs / "r000" / "step_00000020.pt.tmp").write_bytes(b"half")
    (runs / "r000" / "notes.txt").write_text("mine")
    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r000", "--db", db, "--checkpoints",
                           "--runs-dir", str(runs))
    assert code == 2 and err.strip().splitlines() == [
        f"error: {runs / 'r000'} holds 1 file(s) fibctl did not write there ('notes.txt'); nothing was removed"]
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000"] and (runs / "r000" / "notes.txt").is_file()
    (runs / "r000" / "notes.txt").unlink()  # checkpoints and loggers' folders only: deleted whole
    code, _ = _main_exit(monkeypatch, capsys, "queue", "rm", "r000", "--db", db, "--checkpoints",
                         "--runs-dir", str(runs))
    assert code == 0 and not (runs / "r000").exists() and queue.list_runs(engine) == []


@pytest.mark.parametrize("answer", ["n\n", "\n", "", "y\n"])
def test_queue_rm_at_a_terminal_says_what_it_deletes_and_asks(tmp_path, monkeypatch, answer):
    """`queue rm` deleted a run and its results without a word: at a terminal it now says what
    goes and asks; anything but y or yes (Enter, a closed stdin) removes nothing, exit code 1."""
    from fibctl.cli import app, db as cli_db

    path = str(tmp_path / "r.db")
    engine = connect(path)
    queue.add_runs(engine, _configs(1))
    RunRecorder(engine, queue.list_runs(engine)[0]["id"]).log_step(10, 3.0, 1e-3)
    (tmp_path / "runs" / "r000").mkdir(parents=True)
    monkeypatch.setattr(cli_db, "interactive", lambda: True)
    done = CliRunner().invoke(app, ["queue", "rm", "r000", "--db", path, "--checkpoints", "--runs-dir",
                                    str(tmp_path / "runs")], input=answer, env={"COLUMNS": "200"})
    asked = (f"remove run r000 (queued) and its 1 metric and event row(s), and delete {tmp_path / 'runs' / 'r000'}? "
             "[y/N] ")
    assert done.output.startswith(asked), done.output
    if answer == "y\n":
        assert done.exit_code == 0 and "removed run r000" in done.output and queue.list_runs(engine) == []
        assert not (tmp_path / "runs" / "r000").exists()
    else:
        assert done.exit_code == 1 and done.output[len(asked):].strip() == "nothing was removed", done.output
        assert [r["name"] for r in queue.list_runs(engine)] == ["r000"] and (tmp_path / "runs" / "r000").is_dir()


def test_queue_rm_declined_leaves_an_older_database_as_it_was(tmp_path, monkeypatch):
    """connect upgraded the database before the question: a "no" left it upgraded. Now what
    goes is read from it as it is (revision 0001: no events table, no runs_dir) and asked
    about first; only a "yes" upgrades it and removes the run."""
    from fibctl.cli import app, db as cli_db
    from fibctl.db.engine import head_revision, release, upgrade
    from test_db import _insert_rev1_run

    path = str(tmp_path / "old.db")
    upgrade(path, "0001")
    _insert_rev1_run(path, "r1", RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=8).to_json())
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(cli_db, "interactive", lambda: True)
    asked = "remove run r1 (done) and its 64 metric and event row(s)? [y/N] "
    done = CliRunner().invoke(app, ["queue", "rm", "r1", "--db", path], input="n\n")
    assert done.exit_code == 1 and done.output == asked + "nothing was removed\n", done.output
    release()  # as main() does when a command ends: the reader's -wal and -shm files go
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    done = CliRunner().invoke(app, ["queue", "rm", "r1", "--db", path], input="y\n")
    assert done.exit_code == 0 and done.output.startswith(asked + "removed run r1 (done)"), done.output
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [(head_revision(),)]
        assert con.execute("SELECT count(*) FROM runs").fetchall() == [(0,)]
    con.close()


@pytest.mark.parametrize("terminal", [True, False])
def test_queue_rm_of_an_older_database_counts_the_rows_the_run_had_not_those_its_upgrade_derived(
        tmp_path, monkeypatch, terminal):
    """At revision 0006 a probe model's 3 metric rows were asked about, then the upgrade named
    its task (a 4th row) and "removed ... 4 metric and event row(s)" answered a question about 3."""
    from fibctl.cli import app, db as cli_db
    from test_db import rev6_probe

    path = str(tmp_path / "old.db")
    name = rev6_probe(path)
    monkeypatch.setattr(cli_db, "interactive", lambda: terminal)
    done = CliRunner().invoke(app, ["queue", "rm", name, "--db", path], input="y\n", env={"COLUMNS": "200"})
    asked = f"remove run {name} (done) and its 3 metric and event row(s)? [y/N] " if terminal else ""
    assert done.exit_code == 0 and done.output == f"{asked}removed run {name} (done) and 3 metric and event row(s)\n", \
        done.output
    with sqlite3.connect(path) as con:
        assert con.execute("SELECT count(*) FROM aux_metrics").fetchall() == [(1,)]  # the other run's alone
    con.close()


@pytest.mark.parametrize("terminal, args", [(True, ["--yes"]), (True, ["-y"]), (False, [])])
def test_queue_rm_asks_nothing_with_yes_or_in_a_script(tmp_path, monkeypatch, terminal, args):
    """Scripts (the tests, the docs' commands, a user's own) ran `queue rm NAME` without a
    terminal: they go on as before, as does --yes at a terminal."""
    from fibctl.cli import app, db as cli_db

    path = str(tmp_path / "r.db")
    engine = connect(path)
    queue.add_runs(engine, _configs(1))
    monkeypatch.setattr(cli_db, "interactive", lambda: terminal)
    done = CliRunner().invoke(app, ["queue", "rm", "r000", "--db", path, *args], input="n\n")
    assert done.exit_code == 0 and "[y/N]" not in done.output and "removed run r000" in done.output, done.output
    assert queue.list_runs(engine) == []


def test_a_closed_stdin_is_no_terminal_to_ask_at(monkeypatch):
    """`fibctl queue rm NAME <&-`: isatty on the closed stdin raised ValueError."""
    import io

    from fibctl.cli.common import interactive

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdin", closed)
    assert interactive() is False


def test_status_shows_each_running_run_where_how_far_and_how_fast(db, monkeypatch, capsys):
    engine = connect(db)
    queue.add_runs(engine, _configs(3, steps=100))
    run = queue.claim_next(engine, "host-a:1", host="host-a", device="cpu (2 threads)")
    RunRecorder(engine, run.id).log_step(40, 3.5, 1e-3, 0.5, tokens_per_s=512.0, elapsed_s=40.0)
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "fibctl", "status", "--db", db], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    text_ = out.stdout
    # 40 s for 40 steps: 60 steps left at 1 s a step, 60 s
    assert "r000" in text_ and "40/100" in text_ and "512" in text_ and "1m00s" in text_ and "3.500" in text_
    assert "host-a" in text_ and "1 running; 2 queued, 0 done" in text_
    assert "…" not in text_ and max(map(len, text_.splitlines())) <= 80
    code, err = _main_exit(monkeypatch, capsys, "status", "--db", db, "--watch", "--every", "0")
    assert code == 2 and "--every must be above 0" in err
    # Ctrl-C is the way out of --watch: 130 and one line, as for every command a Ctrl-C ends (it
    # was 0, then 130 saying nothing). On a terminal (a pty), so the view is drawn: the signal
    # comes once the first frame is
    import signal

    from cli_helpers import Terminal

    with Terminal() as shown:
        watch = subprocess.Popen([sys.executable, "-m", "fibctl", "status", "--db", db, "--watch", "--every", "0.2"],
                                 stdout=shown.secondary, stderr=subprocess.PIPE, text=True, env=env)
        shown.started()
        assert shown.until(b"queued"), shown.shown
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    assert watch.returncode == 130 and err == "interrupted\n", err


def test_status_queue_ls_and_queue_show_print_json_for_scripts(db, monkeypatch, capsys):
    import json
    from datetime import datetime

    from fibctl.cli import main

    def printed(*args: str):
        monkeypatch.setattr(sys, "argv", ["fibctl", *args, "--db", db, "--json"])
        with pytest.raises(SystemExit) as exit_:
            main()
        out = capsys.readouterr()
        assert exit_.value.code == 0, out.err
        return json.loads(out.out)

    engine = connect(db)
    queue.add_runs(engine, _configs(3, steps=100))
    run = queue.claim_next(engine, "host-a:1", host="host-a", device="cpu (2 threads)")
    RunRecorder(engine, run.id).log_step(40, 3.5, 1e-3, 0.5, tokens_per_s=512.0, elapsed_s=40.0)
    shown = printed("status")
    [running], counts = shown["running"], shown["counts"]
    assert counts == {"queued": 2, "running": 1}
    assert (running["name"], running["host"], running["step"], running["steps"], running["eta_s"]) == \
        ("r000", "host-a", 40, 100, 60.0)
    assert datetime.fromisoformat(running["heartbeat_at"].removesuffix("Z"))  # ISO 8601, UTC
    shown = printed("queue", "show", "r000")
    assert (shown["run"]["status"], shown["config"]["train"]["steps"], shown["last_step"]["step"]) == \
        ("running", 100, 40)
    assert [e["kind"] for e in shown["events"]] == ["claimed"] and "config_json" not in shown["run"]
    listed = printed("queue", "ls", "--status", "queued")
    assert [r["name"] for r in listed["runs"]] == ["r001", "r002"]
    assert {r["status"] for r in listed["runs"]} == {"queued"} and listed["counts"]["running"] == 1
    code, err = _main_exit(monkeypatch, capsys, "status", "--db", db, "--json", "--watch")
    assert code == 2 and "--json prints one view; leave out --watch" in err


def test_status_eta_is_the_training_line_s_pace_with_evaluations_and_checkpoints(db):
    """`fibctl status` took its ETA from the newest row's tokens/s (training steps alone: 60 s
    here) while the training line counted its evaluations and checkpoints too: two ETAs for
    one run. Both now read the run's wall time per step (fibctl.units.eta_s)."""
    from fibctl.units import eta_s

    engine = connect(db)
    queue.add_runs(engine, _configs(1, steps=100))
    run = queue.claim_next(engine, "host-a:1")
    # 512 tokens a step at 512 tok/s is 1 s of training a step; with its evaluations, 2 s
    RunRecorder(engine, run.id).log_step(40, 3.5, 1e-3, 0.5, tokens_per_s=512.0, elapsed_s=80.0)
    [running] = queue.progress(engine)
    assert running["eta_s"] == eta_s(40, 100, 80.0) == 120.0


def test_status_watch_into_a_log_writes_each_view_with_its_time(db):
    """Not on a terminal, --watch printed its first view and then nothing until Ctrl-C: a log
    (`fibctl status --watch >> status.log`) never saw the runs move. Each view is now
    written, under the time it was read."""
    import re
    import select
    import signal

    engine = connect(db)
    queue.add_runs(engine, _configs(1, steps=100))
    run = queue.claim_next(engine, "host-a:1", host="host-a", device="cpu")
    RunRecorder(engine, run.id).log_step(40, 3.5, 1e-3, 0.5, tokens_per_s=512.0, elapsed_s=40.0)
    watch = subprocess.Popen([sys.executable, "-m", "fibctl", "status", "--db", db, "--watch", "--every", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "80"})
    shown = b""
    while shown.count(b" UTC\n") < 3 and select.select([watch.stdout], [], [], 60)[0]:
        chunk = os.read(watch.stdout.fileno(), 4096)
        if not chunk:
            break
        shown += chunk
    watch.send_signal(signal.SIGINT)
    _, err = watch.communicate(timeout=60)
    assert watch.returncode == 130 and err == b"interrupted\n", err
    text_ = shown.decode()
    assert len(re.findall(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", text_, re.M)) >= 3, text_
    assert text_.count("40/100") >= 3 and "\x1b" not in text_


def test_status_watch_waits_out_a_database_it_cannot_open(tmp_path, monkeypatch, capsys):
    """A database that did not answer as --watch drew a view (a server restarting, a file
    moved) ended the watch: one line, exit code 2. The view says so, with the time it began,
    and the watch tries again at its interval (the same path as tests/test_postgres.py's
    server restart, on a SQLite file moved away and back)."""
    import re

    from fibctl.cli import main

    db, moved = tmp_path / "r.db", tmp_path / "moved.db"
    engine = connect(str(db))
    queue.add_runs(engine, _configs(1))
    engine.dispose()
    between = iter([lambda: db.rename(moved), lambda: None, lambda: moved.rename(db)])

    def sleep(_seconds):  # each pause between views: the file goes, stays gone, comes back; then Ctrl-C
        next(between, lambda: (_ for _ in ()).throw(KeyboardInterrupt))()

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(sys, "argv", ["fibctl", "status", "--db", str(db), "--watch", "--every", "3"])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr().out
    views = re.split(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC$", out, flags=re.M)[1:]
    assert exit_.value.code == 130 and len(views) == 4, out
    said = [" ".join(v.split()) for v in views]
    assert "1 queued" in said[0] and "1 queued" in said[3], out
    refused = re.compile(rf"the database {re.escape(str(db))} refused the operation: unable to open database file; "
                         r"since (\d\d:\d\d:\d\d) UTC, trying again every 3 s")
    down = [refused.fullmatch(v) for v in said[1:3]]
    assert all(down) and down[0][1] == down[1][1], out  # since the first view it missed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.db"]


def test_status_watch_on_postgresql_holds_no_connection_between_views():
    """`status --watch` kept its one connection open, idle between views, for as long as it
    ran (hours, on a shared server), and a server restart or a server that ends idle sessions
    ended the watch: `refused the operation: terminating connection`, exit 2."""
    import select
    import signal

    from sqlalchemy.engine import make_url

    from conftest import NO_PG, PG_SERVER, pg_database

    if not PG_SERVER:
        pytest.skip(NO_PG)
    with pg_database() as db:
        engine = connect(db)
        queue.add_runs(engine, _configs(1))
        engine.dispose()
        name = make_url(db).database
        admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        watch = subprocess.Popen([sys.executable, "-m", "fibctl", "status", "--db", db, "--watch", "--every", "0.5"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "80"})
        shown = b""

        def views(n: int) -> None:
            nonlocal shown
            while shown.count(b" UTC\n") < n and select.select([watch.stdout], [], [], 60)[0]:
                chunk = os.read(watch.stdout.fileno(), 4096)
                if not chunk:
                    break
                shown += chunk

        try:
            views(1)
            held = []
            with admin.connect() as conn:
                for _ in range(40):  # 2 s: four views, each a few milliseconds long
                    held.append(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                                             {"d": name}).scalar())
                    time.sleep(0.05)
                # what a restart does to a connection: ended by the server under the watch
                conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                             {"d": name})
            seen = shown.count(b" UTC\n")
            views(seen + 2)
            assert watch.poll() is None, watch.stderr.read()
        finally:
            watch.send_signal(signal.SIGINT)
            _, err = watch.communicate(timeout=60)
            admin.dispose()
    assert held.count(0) > len(held) // 2, held
    assert watch.returncode == 130 and err == b"interrupted\n", err
    assert shown.count(b"1 queued") >= seen + 2, shown


def test_queue_rm_without_checkpoints_says_where_they_stay(db, tmp_path, monkeypatch, capsys):
    """Removing a run's rows left its checkpoints silently: the same name queued again was then
    refused by the worker (its folder holds checkpoints the database does not know). The line
    says where they stay, and how to delete them; a run with none says nothing of them."""
    from fibctl.cli import main

    queue.add_runs(connect(db), _configs(2))
    (tmp_path / "runs" / "r000").mkdir(parents=True)
    (tmp_path / "runs" / "r000" / "step_00000010.pt").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)  # the default runs folder, ./runs
    for name, said in (("r000", "removed run r000 (queued) and 0 metric and event row(s); its checkpoints stay "
                                "in runs/r000 (--checkpoints deletes them)"),
                       ("r001", "removed run r001 (queued) and 0 metric and event row(s)")):
        monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "rm", name, "--db", db])
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code == 0 and " ".join(capsys.readouterr().out.split()) == said
    assert (tmp_path / "runs" / "r000" / "step_00000010.pt").is_file()


def test_queue_rm_checkpoints_keeps_the_run_when_its_folder_cannot_go(db, tmp_path, monkeypatch, capsys):
    """The rows were deleted first, then the folder failed to go: exit 2 said nothing of the
    rows, gone. Now a folder that cannot be moved keeps the run and its rows; one that moved
    but could not be emptied is named, with the rows said to be removed."""
    import shutil
    from pathlib import Path

    engine = connect(db)
    queue.add_runs(engine, _configs(2))
    runs = tmp_path / "runs"
    for name in ("r000", "r001"):
        (runs / name).mkdir(parents=True)
        (runs / name / "step_00000010.pt").write_bytes(b"x")
    real_rename = Path.rename

    def refused(self, target):
        if self == runs / "r000":
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", refused)
    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r000", "--db", db, "--checkpoints",
                           "--runs-dir", str(runs))
    assert code == 2 and err.strip().splitlines() == [
        f"error: cannot delete {runs / 'r000'}: Permission denied; nothing was removed"], err
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000", "r001"]
    assert (runs / "r000" / "step_00000010.pt").is_file()

    def stuck(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(Path(path) / "step_00000010.pt"))

    monkeypatch.setattr(shutil, "rmtree", stuck)
    code, err = _main_exit(monkeypatch, capsys, "queue", "rm", "r001", "--db", db, "--checkpoints",
                           "--runs-dir", str(runs))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "removed run r001 (queued) and 0 metric and event row(s), but not all of its checkpoint folder" in err
    assert f"what is left is at {runs / 'r001'}: delete it by hand" in err
    assert [r["name"] for r in queue.list_runs(engine)] == ["r000"] and (runs / "r001").is_dir()
    assert sorted(p.name for p in runs.iterdir()) == ["r000", "r001"]  # nothing hidden left behind



def test_a_folder_a_queue_rm_moved_aside_in_another_pid_space_is_left_alone(db, tmp_path, monkeypatch):
    """`queue rm --checkpoints` named the folder it moved aside with its PID alone: a container
    of the same host name sharing the runs folder, which cannot see that process, took it for a
    killed one's and moved it back (or deleted it) under the live `queue rm` deleting it. The
    name says its PID space too; one an older fibctl named is settled as this machine's."""
    import shutil

    from fibctl import durable
    from fibctl.flows import removal

    runs = tmp_path / "runs"
    dead = 2**22 + 1  # above any pid_max: no process has it here
    other, ours, older = (runs / f".r.removing-{dead}{tail}" for tail in
                          ("-0123456789ab", f"-{durable.pid_space()}", ""))  # other: alive in its container
    for hidden in (other, ours, older):
        hidden.mkdir(parents=True)
    removal.settle_aside(runs, "r", owned=False)
    assert [p.name for p in runs.iterdir()] == [other.name]
    removal.settle_aside(runs, "r", owned=True)
    assert [p.name for p in runs.iterdir()] == [other.name]

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    (runs / "r000").mkdir()
    (runs / "r000" / "step_00000010.pt").write_bytes(b"x")
    deleted, rmtree = [], shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: (deleted.append(path.name), rmtree(path, *a, **k)))
    removal.remove_run(db, "r000", True, runs, lambda _: None)
    assert deleted == [f".r000.removing-{os.getpid()}-{durable.pid_space()}"]


def test_queue_rm_settles_the_folder_a_killed_queue_rm_moved_aside(db, tmp_path, monkeypatch, capsys):
    """`queue rm --checkpoints` renames RUNS/NAME to RUNS/.NAME.removing-PID, commits, then
    deletes it. Killed (SIGKILL) after the commit, the hidden folder stayed for good; killed in
    the commit, the run stayed with its folder hidden. The next `queue rm` of the name moves it
    back where the run is there, deletes it where the run is gone; a live process's stays."""
    from fibctl.cli import main

    engine = connect(db)
    queue.add_runs(engine, _configs(4))
    runs = tmp_path / "runs"
    dead = 2**22 + 1  # above any pid_max: no process has it
    live = runs / f".r002.removing-{os.getpid()}"  # a `queue rm` still at work
    for hidden in (*(runs / f".r00{i}.removing-{dead}" for i in (0, 1, 3)), live):
        hidden.mkdir(parents=True)
        (hidden / "step_00000010.pt").write_bytes(b"x")
    queue.remove(engine, "r001")  # its removal committed before the kill
    monkeypatch.chdir(tmp_path)  # the default runs folder, ./runs

    def rm(*args: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "rm", *args, "--db", db])
        with pytest.raises(SystemExit) as done:
            main()
        said = capsys.readouterr()
        return done.value.code, " ".join((said.out + said.err).split())

    assert rm("r000") == (0, "removed run r000 (queued) and 0 metric and event row(s); its checkpoints stay in "
                             "runs/r000 (--checkpoints deletes them)")
    assert (runs / "r000" / "step_00000010.pt").is_file()
    assert rm("r003", "--checkpoints") == (0, "removed run r003 (queued) and 0 metric and event row(s); "
                                              "deleted runs/r003")
    assert rm("r001", "--checkpoints") == (2, "error: no run named 'r001'; did you mean 'r002'?")
    # the live one's folder may be the run's checkpoints: --checkpoints, unable to delete it,
    # is refused where it said "no checkpoint folder" and left it behind the rows
    assert rm("r002", "--checkpoints") == (2, f"error: run r002: a `fibctl queue rm --checkpoints` (process "
                                              f"{os.getpid()}, still running) moved the run's folder aside to "
                                              f"runs/{live.name}: once that command is not running, move it back "
                                              "to runs/r002; nothing was removed")
    # without --checkpoints the rows go and the hidden folder stays: it is where the checkpoints are
    assert rm("r002") == (0, f"removed run r002 (queued) and 0 metric and event row(s); its checkpoints stay in "
                             f"runs/{live.name}, moved aside there by a `fibctl queue rm --checkpoints` (process "
                             f"{os.getpid()}, still running) that was to delete them")
    assert sorted(p.name for p in runs.iterdir()) == [live.name, "r000"]
    assert [r["name"] for r in queue.list_runs(engine)] == []


@pytest.mark.parametrize("maker", ["other-space", "running"])
def test_retry_from_start_refuses_while_the_runs_folder_is_aside(db, tmp_path, monkeypatch, capsys, maker):
    """A folder a `queue rm --checkpoints` moved aside and `settle_aside` may not settle (its
    maker in another container, or still at work): the retry found no checkpoint in
    RUNS/NAME and deleted the run's rows, though its checkpoints were there, hidden."""
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    run = queue.claim_next(engine, "w1")
    RunRecorder(engine, run.id, "w1").log_step(5, 3.0, 1e-3)
    queue.cancel(engine, "r000")
    runs = tmp_path / "runs"
    owner = f"{2**22 + 1}-0123456789ab" if maker == "other-space" else f"{os.getpid()}-{pid_space()}"
    hidden = runs / f".r000.removing-{owner}"
    hidden.mkdir(parents=True)
    (hidden / "step_00000005.pt").write_bytes(b"x")
    who = ("process 4194305 of another machine or container" if maker == "other-space"
           else f"process {os.getpid()}, still running")
    code, err = _main_exit(monkeypatch, capsys, "queue", "retry", "r000", "--from-start", "--db", db,
                           "--runs-dir", str(runs))
    assert code == 2 and " ".join(err.split()) == (
        f"error: run r000: a `fibctl queue rm --checkpoints` ({who}) moved the run's folder aside to {hidden}: "
        f"once that command is not running, move it back to {runs / 'r000'}; nothing was changed"), err
    assert err.count("\n") == 1, err
    assert queue.list_runs(engine)[0]["status"] == "cancelled" and [p.name for p in runs.iterdir()] == [hidden.name]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT step FROM train_steps")).scalars().all() == [5]
    hidden.rename(runs / "r000")  # as the message says: the retry then sees the checkpoint
    code, err = _main_exit(monkeypatch, capsys, "queue", "retry", "r000", "--from-start", "--db", db,
                           "--runs-dir", str(runs))
    assert code == 2 and "step_00000005.pt is still there" in err, err


def test_queue_rm_without_checkpoints_names_both_folders_the_checkpoints_stay_in(db, tmp_path, monkeypatch, capsys):
    """Plain `queue rm` said the checkpoints stay in RUNS/NAME, and nothing of the folder another
    container's `queue rm --checkpoints` had moved aside, holding the run's recorded one."""
    from fibctl.cli import app

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    monkeypatch.chdir(tmp_path)  # the default runs folder, ./runs
    runs = Path("runs")
    hidden = runs / ".r000.removing-4194305-0123456789ab"  # another PID space's: left alone
    for folder, step in ((hidden, 5), (runs / "r000", 2)):
        folder.mkdir(parents=True)
        (folder / f"step_{step:08d}.pt").write_bytes(b"x")
    said = CliRunner().invoke(app, ["queue", "rm", "r000", "--db", db])
    assert said.exit_code == 0 and " ".join(said.output.split()) == (
        f"removed run r000 (queued) and 0 metric and event row(s); its checkpoints stay in {runs / 'r000'} "
        f"(--checkpoints deletes them) and in {hidden}, moved aside there by a `fibctl queue rm --checkpoints` "
        "(process 4194305 of another machine or container) that was to delete them"), said.output
    assert sorted(p.name for p in runs.iterdir()) == [hidden.name, "r000"] and not queue.list_runs(engine)


@pytest.mark.parametrize("command", [("rm", "--checkpoints"), ("retry", "--from-start")])
def test_a_folder_moved_aside_beside_a_new_one_of_its_name_is_named_with_where_the_checkpoint_is(
        db, tmp_path, monkeypatch, capsys, command):
    """A killed `queue rm --checkpoints` left RUNS/.NAME.removing-PID, and RUNS/NAME was made
    again since: `settle_aside` cannot move it back (the rename would replace the new one),
    and the refusal said "move it back to RUNS/NAME", a folder that is there. It names both,
    which one holds the run's recorded checkpoint, and to move or merge them by hand."""
    from fibctl.flows import removal

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET checkpoint_path = 'r000/step_00000005.pt', status = 'cancelled'"))
    runs = tmp_path / "runs"
    hidden = runs / f".r000.removing-{2**22 + 1}"  # above any pid_max: its process is gone
    hidden.mkdir(parents=True)
    (hidden / "step_00000005.pt").write_bytes(b"x")
    (runs / "r000").mkdir()
    (runs / "r000" / "step_00000002.pt").write_bytes(b"x")
    code, err = _main_exit(monkeypatch, capsys, "queue", *command[:1], "r000", *command[1:], "--db", db,
                           "--runs-dir", str(runs))
    unchanged = "nothing was removed" if command[0] == "rm" else "nothing was changed"
    assert code == 2 and err.count("\n") == 1 and " ".join(err.split()) == (
        f"error: run r000: a `fibctl queue rm --checkpoints` (process 4194305, ended) moved the run's folder aside "
        f"to {hidden}, and {runs / 'r000'} was made again since; the run's recorded checkpoint step_00000005.pt is "
        f"in {hidden}: move or merge by hand what is the run's into "
        f"{runs / 'r000'}, and delete {hidden}; {unchanged}"), err
    assert sorted(p.name for p in runs.iterdir()) == [hidden.name, "r000"] and queue.list_runs(engine)
    # the other places it can be, and a run that records none (a worker's earlier attempt)
    (runs / "r000" / "step_00000005.pt").write_bytes(b"x")
    assert "checkpoint step_00000005.pt is in both" in removal.aside_hint(runs, "r000", "r000/step_00000005.pt")
    (hidden / "step_00000005.pt").unlink()
    assert f"step_00000005.pt is in {runs / 'r000'}:" in removal.aside_hint(runs, "r000", "r000/step_00000005.pt")
    assert "step_00000009.pt is in neither:" in removal.aside_hint(runs, "r000", "r000/step_00000009.pt")
    assert "since; the run records no checkpoint: move" in removal.aside_hint(runs, "r000")


@pytest.mark.parametrize("damage", ["not json", "[]", '{"name": 5}', "[" * 100_000 + "]" * 100_000])
def test_a_run_whose_stored_config_is_damaged_is_one_line_and_no_worker_crashes_on_it(
        db, damage, monkeypatch, capsys):
    """A row edited by hand or written by another tool: the commands that read its config
    tracebacked (every worker claiming it, over and over); now each names the run in one line,
    and a worker fails that run with the reason and trains the next."""
    engine = connect(db)
    queue.add_runs(engine, _configs(2))
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET config_json = :c WHERE name = 'r000'"), {"c": damage})
    for read in (lambda: queue.run_config(engine, "r000"),
                 lambda: queue.claim_named(engine, "r000", "w", "h", "cpu", 600)):
        with pytest.raises(FibctlError, match=r"^run 'r000': its stored config is not a fibctl config \("):
            read()
    assert queue.list_runs(engine, "queued") == queue.list_runs(engine)  # nothing claimed
    claimed = queue.claim_next(engine, "w1")
    assert claimed is not None and claimed.name == "r001"
    failed = queue.list_runs(engine, "failed")
    assert [r["name"] for r in failed] == ["r000"] and "stored config is not a fibctl config" in failed[0]["error"]
    with engine.begin() as conn:  # damaged after a worker read it: `fibctl status` reads running runs' configs
        conn.execute(text("UPDATE runs SET status = 'running' WHERE name = 'r000'"))
    # it refused to show anything; now the run is listed, its length unknown, beside the others
    assert [(p["name"], p["step"], p["steps"], p["eta_s"]) for p in queue.progress(engine)] == \
        [("r000", 0, None, None), ("r001", 0, 30, None)]
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", "status", "--db", db])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    assert exit_.value.code in (0, None) and err == "", err
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    assert [(c[0], c[3]) for c in cells] == [("r000", "0/?"), ("r001", "0/30")], out
    from fibctl.cli.common import step_of  # `fibctl slurm status` shows the same progress

    assert [step_of(*s) for s in ((0, None), (3, 30), (1200, 5000))] == ["0/?", "3/30", "1,200/5,000"]


def test_a_worker_names_the_run_it_failed_for_a_damaged_stored_config(tmp_path, monkeypatch, capsys):
    """Its closing summary said "nothing queued", exit 0: the run failed as it was claimed
    never reached the worker's outcomes."""
    from fibctl.cli import main
    from train_helpers import write_data

    engine = connect(str(tmp_path / "r.db"))
    queue.add_runs(engine, _configs(1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET config_json = 'not json'"))
    monkeypatch.setattr(sys, "argv", ["fibctl", "worker", "--db", str(tmp_path / "r.db"), "--data",
                                      str(write_data(tmp_path / "data")), "--runs-dir", str(tmp_path / "runs")])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr().out
    assert exit_.value.code == 1, out  # a run failed
    lines = out.strip().splitlines()
    assert lines[0].startswith("r000: failed while starting: run 'r000': its stored config is not a fibctl config"), out
    assert lines[-1] == "worker: 1 run(s): r000 failed", out
    assert [r["name"] for r in queue.list_runs(engine, "failed")] == ["r000"]


def test_reports_pass_over_a_stored_config_nested_too_deeply(db):
    from fibctl.reports import html, tables

    deep = "[" * 100_000 + "]" * 100_000
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET config_json = :c"), {"c": deep})
    assert tables.deviation_notes(engine, ["r000"]) == []  # no note to make, and no RecursionError
    assert html._pretty_json(deep) == deep  # shown as stored


def test_queue_show_gives_one_run_at_a_glance(db):
    """Status, config, last logged step, the perplexities of the last evaluation (the final
    step's, not an earlier one's) and the newest events, within 80 columns."""
    from fibctl.cli import app

    engine = connect(db)
    queue.add_runs(engine, _configs(2))
    claimed = queue.claim_next(engine, "w1", host="h", device="cpu")
    rec = RunRecorder(engine, claimed.id, "w1")
    rec.log_step(10, 4.5, 1e-3, 0.7, 1234.0, 1.0)
    rec.log_step(20, 4.25, 5e-4, 0.5, 2345.0, 2.0)
    rec.log_eval(10, "val", 64, 640, 4.6)
    rec.log_eval(20, "val", 64, 640, 4.3)
    rec.log_eval(20, "val", 128, 1280, 4.4)
    queue.fail(engine, claimed.id, "step 20 gave a loss of [red]nan[/red]", "w1")
    engine.dispose()
    runner = CliRunner()
    shown = runner.invoke(app, ["queue", "show", "r000", "--db", db], env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    out = shown.output
    assert out.startswith("r000: failed (matrix test, id 1, preset micro)")
    assert "model: fixed fib W=" in out and "attempt(s)" in out
    assert "error: step 20 gave a loss of [red]nan[/red]" in out  # as written, never markup
    assert "last logged step 20: loss 4.250, lr 5.00e-04, grad norm 0.500, 2,345 tok/s" in out
    assert "perplexity at step 20" in out
    assert re.search(r"│ val +│ +73\.70 │ +81\.45 │", out)  # exp(4.3), exp(4.4): step 20's, not step 10's
    assert "claimed" in out and "failed" in out and all(len(line) <= 80 for line in out.splitlines())
    fewer = runner.invoke(app, ["queue", "show", "r000", "--db", db, "--events", "1"], env={"COLUMNS": "80"})
    assert "events, the newest 1 of" in fewer.output
    queued = runner.invoke(app, ["queue", "show", "r001", "--db", db], env={"COLUMNS": "80"}).output
    assert queued.startswith("r001: queued") and "perplexity" not in queued and "last logged" not in queued
    # the paper's widest numbers (vocab 32,768, T=1024) wrapped the model line at 81 columns
    queue.add_runs(connect(db), [RunConfig.resolve("f02__fib_learned_w8", "paper", "paper", schedule="learned")])
    paper = runner.invoke(app, ["queue", "show", "f02__fib_learned_w8", "--db", db], env={"COLUMNS": "80"}).output
    assert "model: learned fib W=8; 16 layers, d 512, 8 heads (2 kv), vocab 32,768, T=1024\n" in paper
    assert all(len(line) <= 80 for line in paper.splitlines())


def test_queue_show_writes_a_length_as_the_report_tables_do(db):
    """Its perplexity table's headers were 1,024 where the report tables write 1024."""
    from fibctl.cli import app

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    claimed = queue.claim_next(engine, "w1")
    RunRecorder(engine, claimed.id, "w1").log_eval(10, "val", 1024, 2048, 4.3)
    engine.dispose()
    out = CliRunner().invoke(app, ["queue", "show", "r000", "--db", db], env={"COLUMNS": "80"}).output
    assert re.search(r"┃ dataset ┃ +1024 ┃", out) and "1,024" not in out, out


def test_queue_show_says_the_step_a_running_run_has_trained_to(db):
    """Its `trained:` line gave the tokens of its newest checkpoint and no step: the step is
    what they are of (the runs row records a step only once the run is done)."""
    from fibctl.cli import app

    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    claimed = queue.claim_next(engine, "w1")
    RunRecorder(engine, claimed.id, "w1").update_run(tokens_trained=20 * 512, wall_seconds=75.0)  # micro: 512 a step
    engine.dispose()
    out = CliRunner().invoke(app, ["queue", "show", "r000", "--db", db], env={"COLUMNS": "80"}).output
    assert "trained: step 20 of 30, 10,240 tokens, 1m15s, 1 attempt(s)\n" in out, out


@pytest.mark.parametrize("args, line", [
    (["queue", "show", "r01"], "no run named 'r01'; did you mean 'r001'?"),
    (["queue", "show", "zzz"], "no run named 'zzz' (see fibctl queue ls)"),
    (["queue", "rm", "r0002"], "no run named 'r0002'; did you mean 'r002'?"),
    (["queue", "cancel", "r02"], "no run named 'r02'; did you mean 'r002'?"),
    (["train", "r0000"], "no run named 'r0000' in the database; did you mean 'r000'?"),
    (["train", "zzz"], "no run named 'zzz' in the database; queue it first (fibctl queue add MATRIX)"),
    (["eval", "r000", "r0001", "--length", "64"], "no run named 'r0001' in the database; did you mean 'r001'?"),
])
def test_a_mistyped_run_name_gets_the_closest_one(tmp_path, monkeypatch, capsys, args, line):
    path = str(tmp_path / "r.db")
    queue.add_runs(connect(path), _configs(3))
    code, err = _main_exit(monkeypatch, capsys, *args, "--db", path)
    assert code == 2 and err.strip() == f"error: {line}"


def test_queue_show_refuses_an_unknown_run_and_reads_a_damaged_config(tmp_path, monkeypatch, capsys):
    import hashlib

    path = tmp_path / "r.db"
    engine = connect(str(path))
    queue.add_runs(engine, _configs(1))
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET config_json = '[1, 2'"))
    engine.dispose()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    code, err = _main_exit(monkeypatch, capsys, "queue", "show", "nope", "--db", str(path))
    assert code == 2 and err.strip() == "error: no run named 'nope' (see fibctl queue ls)"
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "show", "r000", "--db", str(path)])
    from fibctl.cli import main
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None) and "its stored config is not a fibctl config" in out
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()} == before  # read-only


def test_a_worker_with_nothing_to_take_says_which_runs_are_marked_running(tmp_path, monkeypatch, capsys):
    """After a worker was killed, the next one said "nothing queued" while the run sat running
    until its heartbeat went stale: it now says so, and where to look."""
    from fibctl.cli import main
    from train_helpers import write_data

    db = str(tmp_path / "r.db")
    engine = connect(db)
    queue.add_runs(engine, _configs(1))
    queue.claim_next(engine, "gone:1", host="elsewhere")  # its worker killed a moment ago
    data = write_data(tmp_path / "data")
    monkeypatch.setattr(sys, "argv", ["fibctl", "worker", "--db", db, "--data", str(data), "--plain"])
    with pytest.raises(SystemExit) as exit_:
        main()
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None) and " ".join(out.split()) == (
        "worker: 0 run(s): nothing queued; 1 run(s) marked running: another worker's, or one whose worker "
        "stopped (taken back once its heartbeat is 600 s old; see fibctl status)")
