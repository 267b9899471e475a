"""Issue 13: checkpoints run no code and belong to their run, runs folders resolve from
anywhere, a worker's own failures leave the queue as it was, a database that refuses
writes does not strand a run."""

from __future__ import annotations

import pickle
import sqlite3
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from fibctl.data.streams import load_manifest
from sqlalchemy import event

from fibctl.db import store
from fibctl.errors import FibctlError, WorkerError
from fibctl.train import checkpoint as ckpt
from fibctl.train.trainer import Trainer
from fibctl.flows.worker import UNRELEASED, WorkerOptions, work
from train_helpers import HELDOUT, NullReporter, Quiet, micro_run, queued_db, write_data

torch.set_num_threads(1)
SHORT = dict(steps=10, eval_interval=10, checkpoint_interval=10)
LONG = dict(steps=30, eval_interval=50, checkpoint_interval=10)


class Evil:
    """Unpickling this runs a command: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def opts(data, runs_dir, **kw):
    return WorkerOptions(data_dir=data, runs_dir=runs_dir, **kw)


def runs(db):
    return sqlite3.connect(db).execute("select name, status, attempts, started_at, error, checkpoint_path "
                                       "from runs order by id").fetchall()


def cli(args, capsys, monkeypatch, stream: str = "err") -> tuple[int, str]:
    """Run `fibctl ARGS` in-process: (exit code, what it wrote to `stream`)."""
    from fibctl.cli import main
    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, getattr(capsys.readouterr(), stream)


# ----------------------------------------------------------------------------- 1: no code from a checkpoint


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_crafted_checkpoint_is_refused_and_its_code_never_runs(writer, data, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    (tmp_path / "runs" / "run").mkdir(parents=True)
    crafted = {"step": 10, "model": Evil(marker)}
    with open(tmp_path / "runs" / "run" / "step_00000010.pt", "wb") as f:
        torch.save(crafted, f) if writer == "torch.save" else pickle.dump(crafted, f)
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set checkpoint_path = 'run/step_00000010.pt', status = 'done'")
    with warnings.catch_warnings(record=True) as caught:  # a plain pickle: torch warned about its protocol
        warnings.simplefilter("always")
        code, err = cli(["eval", "run", "--length", "64", "--db", str(tmp_path / "r.db"), "--data", str(data),
                         "--runs-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "was refused" in err and ("system" in err or writer == "pickle.dump"), err
    assert len(err.strip().splitlines()) == 1 and not marker.exists()
    assert not [w for w in caught if "pickle" in str(w.message)]
    # resuming from it in a worker is refused the same way
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set status = 'queued'")
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert outcome.status == "failed" and "was refused" in outcome.error and not marker.exists()


@pytest.mark.parametrize("stored", ["../other/step_00000010.pt", "/tmp/elsewhere/step_00000010.pt",
                                    "run/../../step_00000010.pt", "run/evil.pkl"])
def test_a_checkpoint_path_outside_the_runs_own_folder_is_refused(stored, data, tmp_path, capsys, monkeypatch):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set checkpoint_path = ?, status = 'done'", (stored,))
    code, err = cli(["eval", "run", "--length", "64", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "not a step_N.pt file in the run's own folder" in err, err


def test_checkpoints_hold_only_what_weights_only_loading_accepts_and_resume_rng(data, tmp_path):
    trainer = Trainer(micro_run("run", **SHORT), load_manifest(data), tmp_path / "run", NullReporter())
    assert trainer.run().status == "done"
    state = torch.load(tmp_path / "run" / "step_00000010.pt", weights_only=True)  # no extra globals allowed
    assert state["config_hash"] == micro_run("run", **SHORT).config_hash and state["step"] == 10
    ckpt.restore_rng_states(state["rng"])
    import random

    import numpy as np
    first = (torch.rand(1).item(), np.random.rand(), random.random())
    ckpt.restore_rng_states(state["rng"])
    assert (torch.rand(1).item(), np.random.rand(), random.random()) == first


def test_a_checkpoint_written_before_weights_only_loading_still_resumes(tmp_path):
    import random

    import numpy as np
    legacy = {"step": 5, "model": {}, "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                              "python": random.getstate()}}
    torch.save(legacy, tmp_path / "step_00000005.pt")
    state = ckpt.load_checkpoint(tmp_path / "step_00000005.pt")
    expected = np.random.rand()
    ckpt.restore_rng_states(state["rng"])
    assert np.random.rand() == expected


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated", bytes(range(256)) * 8])
def test_an_empty_truncated_or_random_checkpoint_is_one_line(content, tmp_path):
    path = tmp_path / "step_00000001.pt"
    path.write_bytes(content)
    with pytest.raises(FibctlError, match="checkpoint .*step_00000001.pt (is damaged|was refused)"):
        ckpt.load_checkpoint(path)


# ----------------------------------------------------------------------------- 5: a stale checkpoint


def test_resume_refuses_another_configs_checkpoint_and_leaves_the_run_queued(data, tmp_path):
    old = queued_db(tmp_path / "old.db", micro_run("run", **SHORT))
    work(old, opts(data, tmp_path / "runs"), Quiet())
    # the same name queued again with another learning rate, pointed at the old runs folder
    new = queued_db(tmp_path / "new.db", micro_run("run", lr=1e-3, **SHORT))
    with new.begin() as conn:  # as if an earlier attempt had recorded the (old) checkpoint
        conn.exec_driver_sql("update runs set checkpoint_path = 'run/step_00000010.pt'")
    before = runs(tmp_path / "new.db")
    with pytest.raises(WorkerError) as e:
        work(new, opts(data, tmp_path / "runs"), Quiet())
    ours, theirs = micro_run("run", lr=1e-3, **SHORT).config_hash, micro_run("run", **SHORT).config_hash
    assert f"config hash {theirs} but run 'run' has {ours}" in str(e.value)
    assert runs(tmp_path / "new.db") == before  # queued, attempt not counted, nothing trained


def test_resume_refuses_a_checkpoint_trained_on_other_data(data, tmp_path):
    trainer = Trainer(micro_run("run", **SHORT), load_manifest(data), tmp_path / "run", NullReporter())
    trainer.run()
    state = ckpt.load_checkpoint(tmp_path / "run" / "step_00000010.pt")
    ckpt.save_checkpoint(tmp_path / "run", 10, {**state, "data_hash": "f" * 16}, keep=1)
    with pytest.raises(WorkerError, match="trained on data f{16} but 'run' would resume on data 0{16}"):
        Trainer(micro_run("run", **SHORT), load_manifest(data), tmp_path / "run", NullReporter()).run()


def test_a_removed_runs_checkpoints_are_not_taken_by_the_run_queued_again(data, tmp_path):
    """They were: the new row was marked done at once, without a step or an evaluation."""
    from fibctl.queue import remove
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    work(engine, opts(data, tmp_path / "runs"), Quiet())
    remove(engine, "run")  # without --checkpoints: the folder stays
    queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    before = runs(tmp_path / "r.db")
    with pytest.raises(WorkerError, match="has no checkpoint in the database, but .*step_00000010.pt exists"):
        work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert runs(tmp_path / "r.db") == before


def test_a_worker_settles_the_folder_a_killed_queue_rm_moved_aside(data, tmp_path):
    """`queue rm --checkpoints` moves RUNS/NAME to RUNS/.NAME.removing-PID before its commit.
    Killed in the commit, the run stayed with its folder hidden: the worker found no
    checkpoint and stopped. Killed after it, the hidden folder stayed for good beside the
    name queued again. The worker moves back the run's own, deletes a removed run's, and
    leaves one whose process still runs."""
    import os

    from fibctl.queue import remove
    dead = 2**22 + 1  # above any pid_max: no process has it
    runs_dir = tmp_path / "runs"
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, runs_dir), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    live = runs_dir / f".run.removing-{os.getpid()}"  # a `queue rm` still at work: left alone
    (runs_dir / "run").rename(live)
    with pytest.raises(WorkerError, match=rf"step_00000003.pt does not exist: .*\(process {os.getpid()}, still "
                                          rf"running\) moved the run's folder aside to {live}"):
        work(engine, opts(data, runs_dir), Quiet())
    live.rename(runs_dir / f".run.removing-{dead}")
    [outcome] = work(engine, opts(data, runs_dir), Quiet())
    assert outcome.status == "done"
    resumed = sqlite3.connect(tmp_path / "r.db").execute("select message from events where kind = 'resumed'")
    assert [m for (m,) in resumed] == [f"resumed from step 3: {runs_dir / 'run' / 'step_00000003.pt'}"]

    (runs_dir / "run").rename(runs_dir / f".run.removing-{dead}")
    remove(engine, "run")  # committed before the kill
    queued_db(tmp_path / "r.db", micro_run("run", **SHORT))  # the name queued again
    [outcome] = work(engine, opts(data, runs_dir), Quiet())
    assert outcome.status == "done" and sorted(p.name for p in runs_dir.iterdir()) == ["run"]
    assert sorted(p.name for p in (runs_dir / "run").glob("step_*.pt")) == ["step_00000010.pt"]


def test_a_folder_moved_aside_in_another_pid_space_is_named_where_its_checkpoint_is_missing(data, tmp_path):
    """A `queue rm --checkpoints` killed in another container left RUNS/.NAME.removing-PID-SPACE,
    which no process here may settle: the worker stopped with "step_N.pt does not exist: give
    the --runs-dir it was trained with", and eval said the same, neither naming the folder the
    checkpoints were in. Both name it, and what to do."""
    from fibctl.flows.evaluation import evaluate

    runs_dir = tmp_path / "runs"
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, runs_dir), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    hidden = runs_dir / ".run.removing-4194305-0123456789ab"  # another PID space's: left alone
    (runs_dir / "run").rename(hidden)
    said = (f"a `fibctl queue rm --checkpoints` (process 4194305 of another machine or container) moved the run's "
            f"folder aside to {hidden}: once that command is not running, move it back to {runs_dir / 'run'}")
    with pytest.raises(WorkerError) as e:
        work(engine, opts(data, runs_dir), Quiet())
    assert str(e.value) == (f"run 'run' has checkpoint run/step_00000003.pt, but {runs_dir / 'run' / 'step_00000003.pt'}"
                            f" does not exist: {said}")
    with pytest.raises(FibctlError) as e:
        evaluate(engine, ["run"], [64], data_dir=data)
    assert str(e.value).endswith(f"step_00000003.pt does not exist; {said}")
    hidden.rename(runs_dir / "run")  # as the message says
    [outcome] = work(engine, opts(data, runs_dir), Quiet())
    assert outcome.status == "done"


def test_a_run_claimed_before_waits_for_its_folder_moved_aside_in_another_pid_space(data, tmp_path):
    """A run an earlier attempt trained (its checkpoint written, not yet recorded) whose folder a
    `queue rm --checkpoints` in another container moved aside: the worker found no checkpoint
    and trained it from step 0, the checkpoint left behind, unseen. It names the folder, and
    the run waits in the queue, as for a run whose recorded checkpoint is missing."""
    from fibctl import queue

    runs_dir = tmp_path / "runs"
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    first = queue.claim_next(engine, "w0")
    queue.release(engine, first.id, "killed before it recorded its checkpoint")
    hidden = runs_dir / ".run.removing-4194305-0123456789ab"  # another PID space's: left alone
    hidden.mkdir(parents=True)
    (hidden / "step_00000003.pt").write_bytes(b"x")
    with pytest.raises(WorkerError) as e:
        work(engine, opts(data, runs_dir), Quiet())
    assert str(e.value) == (f"run 'run' has no checkpoint in {runs_dir / 'run'}: a `fibctl queue rm --checkpoints` "
                            f"(process 4194305 of another machine or container) moved the run's folder aside to "
                            f"{hidden}: once that command is not running, move it back to {runs_dir / 'run'}")
    assert [p.name for p in runs_dir.iterdir()] == [hidden.name]
    assert sqlite3.connect(tmp_path / "r.db").execute("select status from runs").fetchone() == ("queued",)


def test_a_checkpoint_an_attempt_wrote_but_did_not_record_is_resumed(data, tmp_path):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "runs"), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    with engine.begin() as conn:  # killed between writing its first checkpoint and recording it
        conn.exec_driver_sql("update runs set checkpoint_path = null")
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert outcome.status == "done"
    resumed = sqlite3.connect(tmp_path / "r.db").execute("select message from events where kind = 'resumed'")
    assert [m for (m,) in resumed] == [f"resumed from step 3: {tmp_path / 'runs' / 'run' / 'step_00000003.pt'}"]


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(data, tmp_path):
    """It failed the run, and a retry failed it again, until the file was deleted by hand."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "runs"), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    newest = tmp_path / "runs" / "run" / "step_00000013.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    warned = []
    display = Quiet()
    display.warn = warned.append
    [outcome] = work(engine, opts(data, tmp_path / "runs"), display)
    assert outcome.status == "done"
    assert not newest.exists() and newest.with_name("step_00000013.pt.damaged").is_file()
    db = sqlite3.connect(tmp_path / "r.db")
    [(damaged,)] = db.execute("select message from events where kind = 'damaged'")
    assert damaged.startswith(f"checkpoint {newest} is damaged") and "moved aside as step_00000013.pt.damaged, " \
        "resuming from step 10" in damaged
    assert warned == [f"run: {damaged}"]
    resumed = db.execute("select message from events where kind = 'resumed'")
    assert [m for (m,) in resumed] == [f"resumed from step 10: {tmp_path / 'runs' / 'run' / 'step_00000010.pt'}"]


@pytest.mark.parametrize("part", ["sampler", "optimizer", "sampler position", "sampler keys", "numpy position"])
def test_a_checkpoint_of_the_run_with_a_part_missing_is_named_damaged(part, data, tmp_path):
    """Its config hash is the run's, so only its parts can tell: a KeyError reached the error column.
    A numpy generator's state edited by hand: numpy's set_state took a position past its
    624 keys (draws from memory beyond them, or a segfault), keys not a tensor an AttributeError."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "runs"), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    newest = tmp_path / "runs" / "run" / "step_00000013.pt"
    state = torch.load(newest, weights_only=True)
    if part == "sampler":
        del state["sampler"]
    elif part == "sampler position":
        state["sampler"]["numpy"]["pos"] = 625
    elif part == "sampler keys":
        state["sampler"]["numpy"]["keys"] = state["sampler"]["numpy"]["keys"].tolist()
    elif part == "numpy position":  # the global generator's, beside the sampler's
        state["rng"]["numpy"]["pos"] = -1
    else:  # present but empty
        state["optimizer"] = {}
    torch.save(state, newest)
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert outcome.status == "done"
    [(damaged,)] = sqlite3.connect(tmp_path / "r.db").execute("select message from events where kind = 'damaged'")
    assert damaged.startswith(f"checkpoint {newest} is damaged ("), damaged


# ----------------------------------------------------------------------------- 6: runs folder from anywhere


def test_a_relative_runs_dir_resumes_from_another_directory(data, tmp_path, monkeypatch):
    (tmp_path / "A").mkdir()
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    monkeypatch.chdir(tmp_path / "A")
    stop = threading.Event()
    [first] = work(engine, opts(data, Path("runs")), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    assert (first.status, first.step) == ("released", 13)
    assert runs(tmp_path / "r.db")[0][5] == "run/step_00000013.pt"
    monkeypatch.chdir(tmp_path)
    [second] = work(engine, opts(data, Path("A/runs")), Quiet())
    assert second.status == "done" and not (tmp_path / "runs").exists()
    kinds = sqlite3.connect(tmp_path / "r.db").execute("select message from events where kind = 'resumed'").fetchall()
    assert kinds == [("resumed from step 13: A/runs/run/step_00000013.pt",)]


def test_a_runs_dir_without_the_recorded_checkpoint_is_refused_not_restarted(data, tmp_path):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "runs"), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    before = runs(tmp_path / "r.db")
    with pytest.raises(WorkerError, match="run 'run' has checkpoint run/step_00000003.pt, but .*elsewhere.* "
                                          "does not exist: give the --runs-dir it was trained with"):
        work(engine, opts(data, tmp_path / "elsewhere"), Quiet())
    assert runs(tmp_path / "r.db") == before and not (tmp_path / "elsewhere" / "run").exists()


def _evaluations(db: Path) -> list:
    return sqlite3.connect(db).execute("select * from evaluations order by id").fetchall()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("recorded_dir", [None, "new"])
def test_an_absolute_path_recorded_elsewhere_is_refused_and_its_folder_left_alone(recorded_dir, data, tmp_path,
                                                                                  monkeypatch):
    """An older fibctl's absolute path, or one a database another user wrote names: the worker
    resumed there, writing checkpoints into that folder and deleting its older ones, and eval
    read it (and wrote its logs beside it). Taken only where it is the run's own folder in the
    runs folder given."""
    from fibctl.flows.evaluation import evaluate
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "old"), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    legacy = str(tmp_path / "old" / "run" / "step_00000003.pt")
    with engine.begin() as conn:
        conn.exec_driver_sql("update runs set checkpoint_path = ?, runs_dir = ?",
                             (legacy, recorded_dir and str(tmp_path / recorded_dir)))
    before, rows = _files(tmp_path / "old" / "run"), runs(tmp_path / "r.db")
    refused = (f"run 'run' records checkpoint {legacy}, outside its folder {tmp_path / 'new' / 'run'}; "
               f"refused: give --runs-dir {tmp_path / 'old'} if it trained there")
    with pytest.raises(WorkerError) as e:
        work(engine, opts(data, tmp_path / "new"), Quiet())
    assert str(e.value) == refused
    monkeypatch.chdir(tmp_path)  # eval's default without a recorded folder: ./runs
    with pytest.raises(FibctlError, match="outside its folder"):
        evaluate(engine, ["run"], [64], data_dir=data, runs_dir=tmp_path / "new" if recorded_dir else None)
    assert _files(tmp_path / "old" / "run") == before and runs(tmp_path / "r.db") == rows
    assert not (tmp_path / "new" / "run").exists()
    # given the folder it names, through a link to it too, it is the run's own: resumed there
    (tmp_path / "link").symlink_to(tmp_path / "old")
    [outcome] = work(engine, opts(data, tmp_path / "link"), Quiet())
    assert outcome.status == "done" and outcome.checkpoint.parent == tmp_path / "link" / "run"
    assert runs(tmp_path / "r.db")[0][5] == "run/step_00000030.pt"
    assert len(evaluate(engine, ["run"], [64], data_dir=data)) == 2


def test_eval_log_to_refuses_a_run_folder_that_is_a_link(data, tmp_path, monkeypatch):
    """Read through the link, eval's logs were written wherever it pointed."""
    from fibctl.flows.evaluation import evaluate
    from fibctl.train import loggers

    class Sink:  # a stand-in back-end: what TensorBoard would write
        def __init__(self, run_dir, name, config):
            (Path(run_dir) / "tensorboard").mkdir()

        def __getattr__(self, name):  # log_step, log_eval, close, ...: nothing more written
            return lambda *a, **k: None
    monkeypatch.setitem(loggers.SINKS, "tensorboard", Sink)
    monkeypatch.setattr(loggers, "check_loggers", lambda names: tuple(names))
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    work(engine, opts(data, tmp_path / "runs"), Quiet())
    (tmp_path / "runs" / "run").rename(tmp_path / "elsewhere")
    (tmp_path / "runs" / "run").symlink_to(tmp_path / "elsewhere")
    before, evaluated = _files(tmp_path / "elsewhere"), _evaluations(tmp_path / "r.db")
    with pytest.raises(WorkerError, match=f"--log-to: run folder {tmp_path / 'runs' / 'run'} is a link; "):
        evaluate(engine, ["run"], [64], data_dir=data, log_to=["tensorboard"])
    assert _files(tmp_path / "elsewhere") == before and _evaluations(tmp_path / "r.db") == evaluated
    assert len(evaluate(engine, ["run"], [64], data_dir=data)) == 2  # read through it: the user's own link


def test_eval_finds_checkpoints_in_the_folder_the_run_trained_in(data, tmp_path, monkeypatch):
    from fibctl.flows.evaluation import evaluate
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    work(engine, opts(data, tmp_path / "runs"), Quiet())
    monkeypatch.chdir(tmp_path / "runs")  # no --runs-dir: the recorded folder, whatever the directory
    assert len(evaluate(engine, ["run"], [64], data_dir=data)) == 2
    with pytest.raises(FibctlError, match="give the --runs-dir it was trained in"):
        evaluate(engine, ["run"], [64], data_dir=data, runs_dir=tmp_path / "elsewhere")


# ----------------------------------------------------------------------------- 11: the worker's own failures


def test_wrong_data_leaves_every_run_queued_as_it_was(data, tmp_path, capsys, monkeypatch):
    other = write_data(tmp_path / "other", vocab=1024, train_tokens=4_000, heldout_tokens=1_024)
    queued_db(tmp_path / "r.db", *(micro_run(f"r{i}", **SHORT) for i in range(3)))
    before = runs(tmp_path / "r.db")
    code, err = cli(["worker", "--db", str(tmp_path / "r.db"), "--data", str(other),
                     "--runs-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and "vocab 512 but the tokenizer" in err and len(err.strip().splitlines()) == 1, err
    assert runs(tmp_path / "r.db") == before


def test_an_unwritable_runs_dir_is_refused_before_any_claim(data, tmp_path, capsys, monkeypatch):
    queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    (tmp_path / "afile").write_text("x")
    before = runs(tmp_path / "r.db")
    code, err = cli(["worker", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "afile")], capsys, monkeypatch)
    assert code == 2 and "cannot hold checkpoints" in err, err
    assert runs(tmp_path / "r.db") == before and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")])
def test_a_full_disk_stops_the_worker_and_fails_no_run(error, data, tmp_path, capsys, monkeypatch):
    """A checkpoint that could not be written failed the run, and the worker went on to fail
    every queued run the same way, each leaving a partial temporary file."""
    queued_db(tmp_path / "r.db", micro_run("a", **SHORT), micro_run("b", **SHORT))

    def full(state, f):
        f.write(b"partial")
        raise error
    monkeypatch.setattr(ckpt.torch, "save", full)
    code, err = cli(["worker", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "runs"), "--plain"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot write checkpoint {tmp_path / 'runs' / 'a' / 'step_00000010.pt'}: " in err and "bytes free" in err
    assert [r[:2] for r in runs(tmp_path / "r.db")] == [("a", "queued"), ("b", "queued")]
    assert list((tmp_path / "runs" / "a").iterdir()) == [] and not (tmp_path / "runs" / "b").exists()


def test_a_file_in_the_run_folders_place_stops_the_worker_and_fails_no_run(data, tmp_path, capsys, monkeypatch):
    queued_db(tmp_path / "r.db", micro_run("a", **SHORT))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a").write_text("mine")
    code, err = cli(["worker", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "runs"), "--plain"], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot write checkpoint {tmp_path / 'runs' / 'a' / 'step_00000010.pt'}: File exists" in err
    assert [r[:2] for r in runs(tmp_path / "r.db")] == [("a", "queued")]
    assert (tmp_path / "runs" / "a").read_text() == "mine"


def test_worker_exits_1_when_a_run_failed_and_retry_all_failed_requeues(data, tmp_path, capsys, monkeypatch):
    queued_db(tmp_path / "r.db", micro_run("nan", lr=1e6, **SHORT), micro_run("ok", **SHORT))
    db = str(tmp_path / "r.db")
    code, _ = cli(["worker", "--db", db, "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--plain"],
                  capsys, monkeypatch)
    assert code == 1
    assert [(n, s) for n, s, *_ in runs(db)] == [("nan", "failed"), ("ok", "done")]
    assert "gave a loss of nan" in sqlite3.connect(db).execute("select error from runs where name = 'nan'").fetchone()[0]
    code, out = cli(["queue", "retry", "--all-failed", "--db", db], capsys, monkeypatch, "out")
    assert code == 0 and "queued 1 failed run(s) again: nan" in out
    assert [(n, s) for n, s, *_ in runs(db)] == [("nan", "queued"), ("ok", "done")]
    code, err = cli(["queue", "retry", "--db", db], capsys, monkeypatch)
    assert code == 2 and "name a run, or pass --all-failed" in err


def test_a_run_that_raises_records_the_step_it_failed_at(data, tmp_path, monkeypatch):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))

    def boom(self):
        if self.step == 7:
            raise RuntimeError("simulated fault")
        return original(self)
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", boom)
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert (outcome.status, outcome.step) == ("failed", 7)
    assert runs(tmp_path / "r.db")[0][4].startswith("at step 7: RuntimeError: simulated fault")


@pytest.mark.parametrize("stop_at", [None, 9], ids=["checkpoint-due", "stopped"])
def test_a_run_removed_while_it_trains_gets_no_checkpoint_and_its_folder_stays_gone(data, tmp_path, stop_at):
    """`queue cancel` and `queue rm --checkpoints` after the trainer's last heartbeat, with no
    evaluation due before its next checkpoint (full_eval_interval not dividing the checkpoint
    interval), or a stop asked: it wrote that checkpoint, making the folder again, which then
    refused the name queued anew. It checks the run is still its own first."""
    import shutil

    from fibctl import queue

    runs_dir = tmp_path / "runs"
    engine = queued_db(tmp_path / "r.db", micro_run("gone", steps=30, log_interval=7, eval_interval=50,
                                                   checkpoint_interval=10, full_eval_interval=20))
    stop = threading.Event()

    def removed_meanwhile(self):
        if self.step == 8:  # after its heartbeat at step 7
            queue.cancel(engine, "gone")
            queue.remove(engine, "gone")
            shutil.rmtree(runs_dir / "gone", ignore_errors=True)
            if stop_at:
                stop.set()
        return original(self)
    original = Trainer.train_step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "train_step", removed_meanwhile)
        [outcome] = work(engine, opts(data, runs_dir), Quiet(), stop=stop)
    assert outcome.status == "lost"
    assert not (runs_dir / "gone").exists()
    queued_db(tmp_path / "r.db", micro_run("gone", **SHORT))  # the name queued again trains
    [outcome] = work(engine, opts(data, runs_dir), Quiet())
    assert outcome.status == "done"


def test_a_run_cancelled_and_removed_while_it_trains_is_lost_and_the_worker_goes_on(data, tmp_path, monkeypatch):
    """`queue cancel` then `queue rm` before the worker's next heartbeat: its next write failed
    on the missing row, and so did marking the run failed; the worker died with a traceback
    and left the rest of the queue untrained."""
    from fibctl import queue

    engine = queued_db(tmp_path / "r.db", micro_run("gone", **LONG), micro_run("next", **SHORT))

    def removed_meanwhile(self):
        if self.config.name == "gone" and self.step == 3:
            queue.cancel(engine, "gone")
            queue.remove(engine, "gone")
        return original(self)
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", removed_meanwhile)
    outcomes = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert [(o.name, o.status) for o in outcomes] == [("gone", "lost"), ("next", "done")]
    assert "removed" in outcomes[0].error
    assert [r[:2] for r in runs(tmp_path / "r.db")] == [("next", "done")]


@pytest.mark.parametrize("fault", [None, "raise"])
def test_a_run_taken_over_before_its_worker_settles_it_is_left_to_its_new_owner(fault, data, tmp_path, monkeypatch):
    """A worker that stalled past another's heartbeat timeout: the run was reclaimed after its
    last heartbeat. Marking it done (or failed) would end the new owner's training."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))

    def taken_over(self):
        result = original(self)
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE runs SET worker = 'thief:1'")
        if fault:
            raise RuntimeError("late fault")
        return result
    original = Trainer.run
    monkeypatch.setattr(Trainer, "run", taken_over)
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert outcome.status == "lost"
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT status, worker, error, final_step FROM runs").one()
    assert row == ("running", "thief:1", None, None)  # its checkpoint, recorded while it was its own, stays


def test_a_second_ctrl_c_puts_the_run_back_in_the_queue_at_once(data, tmp_path, monkeypatch):
    """The second Ctrl-C (KeyboardInterrupt, mid-step) stops without a checkpoint: the run
    goes back to the queue now, attempts untouched, instead of staying `running` until its
    heartbeat is stale; the next claim resumes its last checkpoint."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))

    def interrupted(self):
        if self.step == 7:
            raise KeyboardInterrupt
        return original(self)
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", interrupted)
    display = Quiet()
    with pytest.raises(KeyboardInterrupt):
        work(engine, opts(data, tmp_path / "runs"), display)
    [(name, status, attempts, started_at, error, checkpoint)] = runs(tmp_path / "r.db")
    assert (status, attempts, error) == ("queued", 0, None)
    [outcome] = display.outcomes
    assert (outcome.status, outcome.step) == ("released", 7) and "aborted" in outcome.error
    released = sqlite3.connect(tmp_path / "r.db").execute(
        "select message from events where kind = 'released'").fetchone()[0]
    assert released.startswith("aborted at step 7 by a second signal")


# ----------------------------------------------------------------------------- 10: a database that refuses writes


def test_a_write_waits_out_a_held_lock(tmp_path, monkeypatch):
    from fibctl.db import engine as db_engine
    monkeypatch.setattr(db_engine, "BUSY_TIMEOUT_MS", 50)
    monkeypatch.setattr(store, "RETRY_DELAYS_S", (0.2, 0.4, 0.8))
    engine = queued_db(tmp_path / "r.db", micro_run("run"))
    holder = sqlite3.connect(tmp_path / "r.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    threading.Timer(0.5, holder.rollback).start()
    started = time.perf_counter()
    store.RunRecorder(engine, 1).log_step(1, 2.0, 1e-3)
    assert time.perf_counter() - started >= 0.4
    assert sqlite3.connect(tmp_path / "r.db").execute("select count(*) from train_steps").fetchone() == (1,)
    holder.execute("BEGIN IMMEDIATE")  # held past every retry: one error naming the cause
    with pytest.raises(store.DatabaseUnavailable) as refused:
        store.RunRecorder(engine, 1).log_step(2, 2.0, 1e-3)
    # the database named: a worker's log line said only "the database"
    assert str(refused.value) == (f"the database {tmp_path / 'r.db'} refused writes 4 times over 1.4 s "
                                  "(database is locked)")
    holder.rollback()


def test_a_database_that_keeps_refusing_writes_checkpoints_and_requeues_the_run(data, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "RETRY_DELAYS_S", (0.01, 0.01))
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    reference = Trainer(micro_run("run", **LONG), load_manifest(data), tmp_path / "ref", NullReporter())
    reference.run()
    full = threading.Event()

    @event.listens_for(engine, "before_cursor_execute")
    def disk_full(conn, cursor, statement, *args):
        if full.is_set() and statement.startswith(("INSERT", "UPDATE", "DELETE")):
            raise sqlite3.OperationalError("database or disk is full")

    display = Quiet(lambda p: p.step == 12 and full.set())
    with pytest.raises(FibctlError) as e:
        work(engine, opts(data, tmp_path / "runs"), display)
    # not "released" (it was not): the display said so where the run stayed marked running
    assert [(o.status, o.error) for o in display.outcomes] == [("lost", UNRELEASED)]
    # step 15's train step was refused: not checkpointed, as a resume would train on past its row
    assert "database or disk is full" in str(e.value) and ("step 15's rows were not all written, so it was not "
                                                           "checkpointed: the run resumes from its checkpoint "
                                                           "step_00000010.pt") in str(e.value)
    assert "it stays marked running" in str(e.value)  # the disk is still full: it cannot be requeued
    full.clear()
    with engine.begin() as conn:  # the heartbeat went stale meanwhile
        conn.exec_driver_sql("update runs set heartbeat_at = '2000-01-01 00:00:00'")
    [outcome] = work(engine, opts(data, tmp_path / "runs", heartbeat_timeout_s=1), Quiet())
    assert outcome.status == "done"
    assert [s for (s,) in sqlite3.connect(tmp_path / "r.db").execute("select step from train_steps order by step")] \
        == list(range(5, 31, 5))  # every logged step's row, the refused one written again
    weights = ckpt.load_checkpoint(tmp_path / "runs" / "run" / "step_00000030.pt")["model"]
    for k, v in reference.model.state_dict().items():
        assert torch.equal(weights[k], v), k


def lock_against(engine, statement: str, times: int) -> None:
    """The database reports itself locked to the first `times` statements starting `statement`."""
    refusals = []

    @event.listens_for(engine, "before_cursor_execute")
    def locked(conn, cursor, text, *args):
        if text.startswith(statement) and len(refusals) < times:
            refusals.append(text)
            raise sqlite3.OperationalError("database is locked")


def test_a_lock_that_clears_before_the_release_requeues_the_run(data, tmp_path, monkeypatch):
    monkeypatch.setattr(store, "RETRY_DELAYS_S", (0.01, 0.01, 0.5))
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    lock_against(engine, "INSERT INTO train_steps", times=4)
    with pytest.raises(FibctlError, match="step 5's rows were not all written, so it was not checkpointed: the run "
                                          "starts again from step 0; it is queued again"):
        work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert runs(tmp_path / "r.db")[0][:3] == ("run", "queued", 0)  # released: the attempt not counted
    assert not (tmp_path / "runs" / "run").exists() or not list((tmp_path / "runs" / "run").glob("*.pt"))


def test_a_refused_final_evaluation_is_written_when_the_run_trains_again(data, tmp_path, monkeypatch):
    """The final step's evaluation refused (a lock held past every retry): that step is not
    checkpointed, or the run would resume past it and finish "done" with no final results."""
    monkeypatch.setattr(store, "RETRY_DELAYS_S", (0.01, 0.01))
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    lock_against(engine, "INSERT INTO evaluations", times=3)
    with pytest.raises(FibctlError, match="step 10's rows were not all written"):
        work(engine, opts(data, tmp_path / "runs"), Quiet())
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    db = sqlite3.connect(tmp_path / "r.db")
    assert outcome.status == "done"
    assert db.execute("select count(*) from evaluations where step = 10").fetchone() == (len(HELDOUT),)
    assert db.execute("select count(*) from position_losses where step = 10").fetchone()[0] > 0


def test_queue_ls_answers_while_a_worker_holds_the_write_lock(tmp_path, capsys, monkeypatch):
    queued_db(tmp_path / "r.db", micro_run("run"))
    holder = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE runs SET status = 'running'")  # not committed: readers see the last commit
    started = time.perf_counter()
    code, out = cli(["queue", "ls", "--db", str(tmp_path / "r.db")], capsys, monkeypatch, "out")
    assert code == 0 and "1 queued" in out and time.perf_counter() - started < 5
    holder.rollback()


def test_a_run_name_that_would_leave_the_runs_folder_is_refused(data, tmp_path):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    with engine.begin() as conn:  # not through a matrix, which refuses such names: an imported row, say
        conn.exec_driver_sql("update runs set name = '../escaped'")
    [outcome] = work(engine, opts(data, tmp_path / "runs"), Quiet())
    assert outcome.status == "failed" and "run name '../escaped' is not allowed" in outcome.error
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "runs").exists()


def test_a_run_folder_that_is_a_link_is_refused_and_nothing_lands_where_it_points(data, tmp_path, capsys,
                                                                                  monkeypatch):
    """Checkpoints were written through a link in the run's place, outside --runs-dir (which
    `queue rm --checkpoints` already refused to follow)."""
    queued_db(tmp_path / "r.db", micro_run("run", **SHORT))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "run").symlink_to(tmp_path / "elsewhere")
    before = runs(tmp_path / "r.db")
    code, err = cli(["train", "run", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "runs"), "--plain"], capsys, monkeypatch)
    assert code == 2 and err.strip().splitlines() == [
        f"error: run folder {tmp_path / 'runs' / 'run'} is a link; a run's checkpoints are written only "
        "inside --runs-dir: remove the link"], err
    assert runs(tmp_path / "r.db") == before and not list((tmp_path / "elsewhere").iterdir())


def test_a_run_folder_replaced_by_a_link_after_a_checkpoint_is_refused_too(data, tmp_path, capsys, monkeypatch):
    """With a checkpoint recorded, the link was followed: new checkpoints landed where it
    pointed and the oldest there were deleted."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path / "runs"), Quiet(lambda p: p.step == 3 and stop.set()), stop=stop)
    (tmp_path / "runs" / "run").rename(tmp_path / "elsewhere")
    (tmp_path / "runs" / "run").symlink_to(tmp_path / "elsewhere")
    before = runs(tmp_path / "r.db")
    code, err = cli(["train", "run", "--db", str(tmp_path / "r.db"), "--data", str(data),
                     "--runs-dir", str(tmp_path / "runs"), "--plain"], capsys, monkeypatch)
    assert code == 2 and "is a link" in err and len(err.strip().splitlines()) == 1, err
    assert runs(tmp_path / "r.db") == before
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["step_00000003.pt"]


def test_a_temporary_file_that_is_a_link_is_replaced_not_written_through(tmp_path):
    """open(tmp, "wb") followed a link in the temporary file's place: the checkpoint
    overwrote the file it pointed to, outside the runs folder."""
    (tmp_path / "precious").write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step_00000004.pt.tmp").symlink_to(tmp_path / "precious")
    path = ckpt.save_checkpoint(tmp_path / "run", 4, {"step": 4, "model": {}}, keep=2)
    assert (tmp_path / "precious").read_text() == "keep"
    assert not path.is_symlink() and ckpt.load_checkpoint(path)["step"] == 4


def test_a_command_that_cannot_get_the_write_lock_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    from fibctl.db import engine as db_engine
    queued_db(tmp_path / "r.db", micro_run("run"))
    monkeypatch.setattr(db_engine, "BUSY_TIMEOUT_MS", 100)
    holder = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    code, err = cli(["queue", "cancel", "run", "--db", str(tmp_path / "r.db")], capsys, monkeypatch)
    holder.rollback()
    assert code == 2 and "r.db is locked by another process: waited 0.1 s" in err, err
    assert len(err.strip().splitlines()) == 1
    assert runs(tmp_path / "r.db")[0][1] == "queued"


def test_a_reader_locked_out_says_it_waited_to_read_not_for_a_write_lock(tmp_path, capsys, monkeypatch):
    """A reader never takes the write lock: only another process's exclusive lock stops it."""
    from fibctl.db import engine as db_engine
    queued_db(tmp_path / "r.db", micro_run("run")).dispose()
    monkeypatch.setattr(db_engine, "BUSY_TIMEOUT_MS", 100)
    holder = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")  # a write under it keeps readers out too
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("UPDATE runs SET status = status")
    code, err = cli(["queue", "ls", "--db", str(tmp_path / "r.db")], capsys, monkeypatch)
    holder.rollback()
    holder.close()
    assert code == 2 and "r.db is locked by another process: waited 0.1 s to read it;" in err, err
    assert "write lock" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_database_error_mid_command_is_one_line_without_the_statement(tmp_path, capsys, monkeypatch, wrapped):
    """Raised as it is, or wrapped by pandas mid-query (its DatabaseError, an OSError)."""
    import pandas as pd
    from sqlalchemy.exc import OperationalError

    from fibctl import queue

    def full(engine, name):
        error = OperationalError("UPDATE runs SET status=? -- secret parameters", ("x",),
                                 sqlite3.OperationalError("database or disk is full"))
        if not wrapped:
            raise error
        raise pd.errors.DatabaseError("Execution failed on sql 'UPDATE runs SET status=?': ...") from error
    queued_db(tmp_path / "r.db", micro_run("run"))
    monkeypatch.setattr(queue, "cancel", full)
    code, err = cli(["queue", "cancel", "run", "--db", str(tmp_path / "r.db")], capsys, monkeypatch)
    assert code == 2 and err.strip() == "error: the database refused the operation: database or disk is full", err
