"""A worker resumes a run only from a checkpoint its database accounts for: not one written
before `queue retry --from-start`, nor one past the rows the database holds (restored from an
older copy). Either would finish the run with its history missing, silently."""

from __future__ import annotations

import sqlite3
import threading

import pytest
import torch

from fibctl import queue
from fibctl.errors import WorkerError
from fibctl.flows.worker import WorkerOptions, work
from fibctl.train import checkpoint as ckpt
from test_crash import LONG, assert_same_run, cli, data, reference, rows  # noqa: F401 (fixtures: an uninterrupted run)
from train_helpers import Quiet, micro_run, queued_db

torch.set_num_threads(1)


def opts(data, runs):
    return WorkerOptions(data_dir=data, runs_dir=runs)


def status(db):
    return sqlite3.connect(db).execute("select status, attempts from runs").fetchone()


def stop_at(engine, data, runs, step):
    stop = threading.Event()
    [outcome] = work(engine, opts(data, runs), Quiet(lambda p: p.step == step and stop.set()), stop=stop)
    assert outcome.status == "released"


def copy_db(source, target):
    """A consistent copy of a SQLite database (what a backup, or restoring one, writes)."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)


# ----------------------------------------------------------------------------- a database behind its checkpoints


@pytest.mark.parametrize("older_fibctl", [False, True], ids=["stamped", "older-fibctl"])
def test_a_checkpoint_past_what_a_restored_database_records_is_refused(data, tmp_path, capsys, monkeypatch,
                                                                       reference, older_fibctl):
    """A database restored from a backup taken at step 13 while the checkpoints went on to 30:
    the worker resumed from step 30, trained nothing, marked the run done, and its rows past
    step 10 were missing for good."""
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run", **LONG))
    stop_at(engine, data, runs, 13)
    copy_db(db, tmp_path / "backup.db")
    [done] = work(engine, opts(data, runs), Quiet())
    assert done.status == "done"
    folder = runs / "run"
    if older_fibctl:  # checkpoints that say nothing of what was recorded before them
        for path in ckpt.list_checkpoints(folder):
            state = torch.load(path, weights_only=True)
            state.pop("logged_step", None), state.pop("restarts", None)
            torch.save(state, path)
    engine.dispose()
    copy_db(tmp_path / "backup.db", db)
    before = rows(db)
    with pytest.raises(WorkerError) as e:
        work(engine, opts(data, runs), Quiet())
    message = str(e.value)
    logged = 25 if older_fibctl else 30  # an older fibctl's: the last train_steps row before it
    assert "\n" not in message
    assert message.startswith(f"run 'run' has rows up to step 10 in the database, but checkpoint "
                              f"{folder / 'step_00000030.pt'} was written once step {logged} was recorded"), message
    assert message.endswith(f"resuming from it would leave steps 11-{logged} "
                            f"unrecorded; restore the database that recorded them, or move the checkpoints past "
                            f"step 10 out of {folder} (none left: `fibctl queue cancel run`, then `fibctl queue "
                            "retry run --from-start`)"), message
    assert status(db) == ("queued", 0) and rows(db) == before  # as it was: nothing trained, nothing lost
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000020.pt", "step_00000030.pt"]
    # the way out without that database: the checkpoints past step 10 moved aside, none is left,
    # and the run is trained again from step 0
    aside = tmp_path / "aside"
    folder.rename(aside)
    for args in (["queue", "cancel", "run"], ["queue", "retry", "run", "--from-start"]):
        code, _, err = cli([*args, "--db", str(db)], capsys, monkeypatch)
        assert code in (0, None), err
    [outcome] = work(engine, opts(data, runs), Quiet())
    assert outcome.status == "done"
    assert_same_run(db, ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)


def test_rows_and_a_checkpoint_landing_while_the_worker_starts_are_accounted_for(data, tmp_path, reference,
                                                                                  monkeypatch):
    """The worker read what the database holds of the run, then (seconds later, its model
    built) found a newer checkpoint, written meanwhile with its rows by the worker it took the
    run from (stalled past the heartbeat timeout): it refused it as 'a database restored from
    an older copy', put the run back and stopped (exit 2)."""
    from fibctl.train.trainer import Trainer

    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run", **LONG))
    stop_at(engine, data, runs, 23)  # checkpoints 20 and 23, rows up to 20
    c = sqlite3.connect(db)
    late = {t: c.execute(f"select * from {t} where step > 10").fetchall() for t in ("train_steps", "evaluations")}
    for t in late:
        c.execute(f"delete from {t} where step > 10")
    c.commit()
    newest = runs / "run" / "step_00000023.pt"
    newest.rename(tmp_path / "late.pt")

    def resume(self):  # the old owner's rows, then its checkpoint, land now
        for t, got in late.items():
            c.executemany(f"insert into {t} values ({', '.join('?' * len(got[0]))})", got)
        c.commit()
        (tmp_path / "late.pt").rename(newest)
        return original(self)
    original = Trainer.resume
    monkeypatch.setattr(Trainer, "resume", resume)
    [outcome] = work(engine, opts(data, runs), Quiet())
    assert outcome.status == "done", outcome
    assert_same_run(db, ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)


# ----------------------------------------------------------------------------- retry --from-start


def test_retry_from_start_looks_in_the_folder_the_run_last_trained_in(data, tmp_path, capsys, monkeypatch):
    """--runs-dir naming an existing folder that is not the run's found no checkpoint there and
    deleted its rows; a worker given the real folder then resumed from its checkpoint."""
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run", **LONG))
    stop_at(engine, data, runs, 13)
    queue.cancel(engine, "run")
    (tmp_path / "elsewhere").mkdir()
    before = rows(db)
    code, _, err = cli(["queue", "retry", "run", "--from-start", "--runs-dir", str(tmp_path / "elsewhere"),
                        "--db", str(db)], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: {runs.resolve() / 'run' / 'step_00000013.pt'} is still there: `fibctl queue "
                          "retry run` resumes from it"), err
    assert rows(db) == before and status(db)[0] == "cancelled"


def test_retry_from_start_sees_the_checkpoints_a_killed_queue_rm_moved_aside(data, tmp_path, capsys, monkeypatch):
    """`queue rm --checkpoints` killed in its commit left the run with its folder hidden
    (RUNS/.NAME.removing-PID): the retry found no checkpoint and deleted the run's rows."""
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run", **LONG))
    stop_at(engine, data, runs, 13)
    queue.cancel(engine, "run")
    (runs / "run").rename(runs / f".run.removing-{2**22 + 1}")  # above any pid_max: its process is gone
    before = rows(db)
    code, _, err = cli(["queue", "retry", "run", "--from-start", "--db", str(db)], capsys, monkeypatch)
    assert code == 2 and err.startswith(f"error: {runs.resolve() / 'run' / 'step_00000013.pt'} is still there"), err
    assert rows(db) == before and status(db)[0] == "cancelled" and [p.name for p in runs.iterdir()] == ["run"]


@pytest.mark.parametrize("at", [23, 3])  # 3: before the run's first train_steps row
def test_a_checkpoint_written_before_a_retry_from_start_is_not_resumed(at, data, tmp_path, capsys, monkeypatch,
                                                                       reference):
    """The retry could not see the run's checkpoints (the folder moved since): it deleted the
    rows past step 0, and the worker then resumed from the old checkpoint, the run ending done
    with its history before it deleted, though the user asked for a fresh start."""
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run", **LONG))
    stop_at(engine, data, runs, at)
    queue.cancel(engine, "run")
    moved = tmp_path / "moved"
    runs.rename(moved)
    code, out, err = cli(["queue", "retry", "run", "--from-start", "--db", str(db)], capsys, monkeypatch)
    assert code in (0, None), err
    folder = moved / "run"
    before = rows(db)
    with pytest.raises(WorkerError) as e:
        work(engine, opts(data, moved), Quiet())
    assert str(e.value) == (f"run 'run' was queued again from step 0 (fibctl queue retry --from-start) after its "
                            f"checkpoint {folder / f'step_{at:08d}.pt'} was written: move {folder} away to train "
                            "the run from step 0")
    assert status(db) == ("queued", 0) and rows(db) == before
    # the way out; the checkpoints of the new start are resumed from as any
    folder.rename(tmp_path / "old")
    stop_at(engine, data, moved, 13)
    [outcome] = work(engine, opts(data, moved), Quiet())
    assert outcome.status == "done"
    assert_same_run(db, ckpt.load_checkpoint(outcome.checkpoint)["model"], reference)
