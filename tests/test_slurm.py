"""fibctl slurm: workers as the tasks of a SLURM job (submitit), on a real one-node cluster.

The end-to-end tests need a SLURM cluster on this machine: `.ci/slurm` starts one and `.ci/run`
then sets FIBCTL_TEST_SLURM=1; without it they skip, saying so. The refusals need no cluster.
"""

from __future__ import annotations

import importlib.util

import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fibctl.data.streams import load_manifest
from fibctl.train.checkpoint import load_checkpoint
from fibctl.train.trainer import Trainer
from train_helpers import NullReporter, micro_run, queued_db, write_data

ENV = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}
CLUSTER = os.environ.get("FIBCTL_TEST_SLURM")
needs_cluster = pytest.mark.skipif(
    not CLUSTER, reason="no SLURM cluster: FIBCTL_TEST_SLURM is not set (.ci/run starts one with .ci/slurm)")


def fibctl(*args, env=ENV, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def runs(db: Path) -> list[tuple]:
    return sqlite3.connect(db).execute("select name, status, worker, host from runs order by id").fetchall()


def events(db: Path, kind: str) -> list[tuple]:
    return sqlite3.connect(db).execute(
        "select r.name, e.message, e.data from events e join runs r on r.id = e.run_id where e.kind = ? "
        "order by e.id", (kind,)).fetchall()


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    for w in words:
        assert w in lines[0], lines[0]


# ----------------------------------------------------------------------------- refusals, no cluster needed


def test_without_submitit_or_sbatch_submit_is_one_line_and_submits_nothing(data, tmp_path):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    args = ["slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
            "--folder", str(tmp_path / "jobs")]
    # submitit not importable (a None entry in sys.modules makes `import submitit` fail)
    probe = ("import sys; sys.modules['submitit'] = None; sys.argv = ['fibctl', *sys.argv[1:]]; "
             "from fibctl.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=ENV, timeout=120)
    one_line_error(done, "submitit", ".[slurm]")
    if importlib.util.find_spec("submitit") is None:
        pytest.skip("the rest needs submitit (pip install -e '.[slurm]')")
    # no sbatch on the PATH (the Python executable is called by its full path)
    bare = tmp_path / "bin"
    bare.mkdir()
    done = fibctl(*args, env={**ENV, "PATH": str(bare)})
    one_line_error(done, "sbatch")
    one_line_error(fibctl("slurm", "status", "--db", str(db), env={**ENV, "PATH": str(bare)}), "squeue")
    assert runs(db) == [("a", "queued", None, None)]
    assert not (tmp_path / "jobs").exists()


def test_bad_options_are_one_line_each(data, tmp_path):
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    base = ["slurm", "submit", "--db", str(db), "--data", str(data), "--dry-run"]
    for extra, words in [(["--time", "4h"], ["--time", "HH:MM:SS"]),
                         (["--time", "00:01:00"], ["too short"]),
                         (["--nodes", "0"], ["--nodes"]),
                         (["--gpus-per-node", "4", "--tasks-per-node", "2"], ["--tasks-per-node"]),
                         (["--partition", "gpu\n#SBATCH --x"], ["--partition"]),
                         (["--nodes", "2"], ["SQLite"]),
                         (["--max-runs", "0"], ["--max-runs"]),
                         (["--max-requeues", "-1"], ["--max-requeues"])]:
        one_line_error(fibctl(*base, *extra), *words)
    one_line_error(fibctl("slurm", "submit", "--db", str(tmp_path / "none.db"), "--dry-run"), "none.db")


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(data, tmp_path):
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    done = fibctl("slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir", "rel-runs",
                  "--tasks-per-node", "2", "--time", "01:30:00", "--partition", "cpu", "--account", "lab",
                  "--folder", str(tmp_path / "jobs"), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for line in ["#!/bin/bash", "#SBATCH --job-name=fibctl-worker", "#SBATCH --ntasks-per-node=2",
                 "#SBATCH --nodes=1", "#SBATCH --time=01:30:00", "#SBATCH --signal=USR2@120",
                 "#SBATCH --partition=cpu", "#SBATCH --account=lab",
                 f"export FIBCTL_DATA={data}", f"export FIBCTL_RUNS_DIR={tmp_path / 'rel-runs'}"]:
        assert line in script.splitlines(), (line, script)
    assert "srun" in script and "submitit.core._submit" in script and "gpus" not in script
    gpu = fibctl("slurm", "submit", "--db", str(db), "--data", str(data), "--gpus-per-node", "4", "--nodes", "1",
                 "--dry-run", cwd=tmp_path)
    assert gpu.returncode == 0 and "#SBATCH --gpus-per-node=4" in gpu.stdout and "--ntasks-per-node=4" in gpu.stdout
    assert not (tmp_path / "jobs").exists() and runs(db) == [("a", "queued", None, None)]


# ----------------------------------------------------------------------------- a real one-node cluster


def squeue_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True, text=True,
                         timeout=30).stdout.split()
    return out[0] if out else "GONE"


def wait_for(job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = squeue_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"SLURM job {job} still {squeue_state(job)} after {timeout:.0f} s")


def submit(db: Path, data: Path, tmp_path: Path, *extra: str) -> str:
    done = fibctl("slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                  "--folder", str(tmp_path / "jobs"), "--time", "00:10:00", *extra)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("submitted SLURM job "), done.stdout
    return done.stdout.split()[3].rstrip(":")


def job_log(tmp_path: Path, job: str) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted((tmp_path / "jobs" / job).glob("*_log.*")))


@needs_cluster
def test_a_two_task_job_trains_every_run_exactly_once_and_records_host_and_job(data, tmp_path):
    db = tmp_path / "r.db"
    names = [f"r{i}" for i in range(5)]
    queued_db(db, *(micro_run(n, steps=8, eval_interval=8, checkpoint_interval=8) for n in names))
    job = submit(db, data, tmp_path, "--tasks-per-node", "2")
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    host = socket.gethostname()
    rows = runs(db)
    assert [(n, s, h) for n, s, _, h in rows] == [(n, "done", host) for n in names], job_log(tmp_path, job)
    claimed = [name for name, _, _ in events(db, "claimed")]
    assert sorted(claimed) == names  # each run claimed exactly once
    noted = events(db, "slurm")
    assert sorted(name for name, _, _ in noted) == names
    tasks = set()
    for name, message, raw in noted:
        info = raw if isinstance(raw, dict) else __import__("json").loads(raw)
        assert info["job_id"] == job and info["host"] == host and f"SLURM job {job} task" in message
        worker = next(w for n, _, w, _ in rows if n == name)
        assert worker == f"{host}:{info['pid']}"  # the event names the worker that trained the run
        tasks.add(info["task"])
    assert tasks == {0, 1}, noted  # both tasks trained
    # fibctl slurm status joins SLURM's view of the job with the runs it trained
    status = fibctl("slurm", "status", "--db", str(db))
    assert status.returncode == 0, status.stderr
    line = next(l for l in status.stdout.splitlines() if f" {job} " in l)
    assert "COMPLETED" in line and "5 done" in line, status.stdout


LONG = dict(steps=400, eval_interval=1000, checkpoint_interval=1000)


@needs_cluster
def test_a_preempted_two_task_job_releases_its_runs_requeues_and_finishes_them_bit_exact(data, tmp_path):
    db = tmp_path / "r.db"
    names = ["long_a", "long_b"]
    queued_db(db, *(micro_run(n, **LONG) for n in names))
    # an uninterrupted run of the same config, first, in this process (1 thread, as the workers)
    torch.set_num_threads(1)
    reference = Trainer(micro_run("ref", **LONG), load_manifest(data), tmp_path / "ref", NullReporter())
    assert reference.run().status == "done"
    job = submit(db, data, tmp_path, "--tasks-per-node", "2")
    # wait until both tasks' workers are part-way through, then send SLURM's preemption signal
    # to every task of the job (task 0's is submitit's handler, task 1's the worker's own)
    deadline = time.monotonic() + 60
    steps: list[int] = []
    while time.monotonic() < deadline:
        steps = [m for (m,) in sqlite3.connect(db).execute(
            "select max(step) from train_steps group by run_id")]
        if len(steps) == 2 and min(steps) >= 20:
            break
        time.sleep(0.2)
    assert len(steps) == 2 and 20 <= min(steps) and max(steps) < LONG["steps"], (steps, job_log(tmp_path, job))
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    kinds = [k for (k,) in sqlite3.connect(db).execute("select kind from events order by id")]
    assert kinds.count("released") == 2 and kinds.count("resumed") == 2 and kinds.count("claimed") == 4, kinds
    for (message,) in sqlite3.connect(db).execute("select message from events where kind = 'released'"):
        assert min(steps) <= int(message.split()[3].rstrip(";")) < LONG["steps"], message
    restarts = sorted((raw if isinstance(raw, dict) else __import__("json").loads(raw))["restart"]
                      for _, _, raw in events(db, "slurm"))
    assert restarts == [0, 0, 1, 1]  # the same job, requeued by submitit, trained the runs' second parts
    assert [r[1] for r in runs(db)] == ["done", "done"]
    expected = reference.model.state_dict()
    for name in names:
        path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = ?", (name,)).fetchone()[0]
        final = load_checkpoint(tmp_path / "runs" / path)["model"]
        assert final.keys() == expected.keys()
        for k in final:
            assert torch.equal(final[k], expected[k]), (name, k)
