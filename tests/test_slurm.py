"""fibctl slurm: workers as the tasks of a SLURM job (submitit), on a real one-node cluster.

The end-to-end tests need a SLURM cluster on this machine: `.ci/slurm` starts one and `.ci/run`
then sets FIBCTL_TEST_SLURM=1; without it they skip, saying so. The refusals need no cluster.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fibctl.data.streams import load_manifest
from fibctl.train.checkpoint import load_checkpoint
from fibctl.train.trainer import Trainer
from train_helpers import NullReporter, assert_close, micro_run, one_process, queued_db, write_data

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


def test_without_submitit_or_sbatch_submit_is_one_line_and_submits_nothing(data, tmp_path, monkeypatch, capsys):
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
    # no sbatch on the PATH (fibctl's main in this process: the PATH is read when a tool is called)
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    one_line_error(cli_done(monkeypatch, capsys, *args), "no `sbatch` on this machine")
    one_line_error(cli_done(monkeypatch, capsys, "slurm", "status", "--db", str(db)), "no `squeue` on this machine")
    assert runs(db) == [("a", "queued", None, None)]
    assert not (tmp_path / "jobs").exists()


def test_a_slurm_message_of_bytes_that_are_not_utf8_is_one_line(tmp_path, monkeypatch, capsys):
    """squeue quoting a config file of other bytes (SLURM_CONF naming a binary file) failed
    `slurm status` with a UnicodeDecodeError traceback."""
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4)).dispose()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text("#!/bin/sh\nprintf 'squeue: error: Parse error in file x line 1: \\367\\n' >&2\n"
                                 "exit 1\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_))
    one_line_error(cli_done(monkeypatch, capsys, "slurm", "status", "--db", str(db)),
                   "squeue failed: squeue: error: Parse error in file x line 1: \ufffd")


def test_a_squeue_that_does_not_answer_is_one_line_not_an_empty_list(tmp_path, monkeypatch, capsys):
    """squeue retries a missing SLURM_CONF for 60 s; past fibctl's timeout its silence was read
    as no jobs: `slurm status` listed none and exited 0."""
    from fibctl.flows import slurm

    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4)).dispose()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text("#!/bin/sh\necho 'squeue: error: cannot stat file /x, retrying' >&2\nexec sleep 30\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")  # sleep
    monkeypatch.setattr(slurm, "TOOL_TIMEOUT_S", 1, raising=False)  # without it (before): 30 s
    one_line_error(cli_done(monkeypatch, capsys, "slurm", "status", "--db", str(db)),
                   "squeue failed: no answer in 1 s (squeue: error: cannot stat file /x, retrying)")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, data):
    """A queue of one text run, and the folders and databases the refusals are given."""
    root = tmp_path_factory.mktemp("inputs")
    queued_db(root / "r.db", micro_run("a", steps=4))
    (root / "empty").mkdir()
    sqlite3.connect(root / "foreign.db").execute("create table t (x)")
    write_data(root / "vocab600", vocab=600, train_tokens=2_000, heldout_tokens=500)
    short = write_data(root / "short", train_tokens=2_000, heldout_tokens=500)
    (short / "train.bin").write_bytes((short / "train.bin").read_bytes()[:-2])
    queued_db(root / "done.db", micro_run("b", steps=4))
    sqlite3.connect(root / "done.db", isolation_level=None).execute("update runs set status = 'done'")
    return dict(root=root, db=root / "r.db", data=data)


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """fibctl in this process (its main: a refusal is one line and exit 2): status, stdout, stderr."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def cli_done(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """`cli`, as the CompletedProcess a process would have given."""
    code, out, err = cli(monkeypatch, capsys, *args)
    return subprocess.CompletedProcess(["fibctl", *args], code, out, err)


# what a worker on a node would refuse, and what sbatch would: {root} is the `inputs` folder
BAD_OPTIONS = [
    (["--folder", "{root}/r.db/jobs"], ["--folder", "r.db is a file, not a folder"]),
    (["--threads", "0"], ["--threads", "got 0"]),
    (["--threads", "999999"], ["--threads", "got 999999"]),
    (["--cpus-per-task", "2", "--threads", "4"], ["--threads 4", "--cpus-per-task 2"]),
    (["--max-runs", "0"], ["--max-runs (0)"]),
    (["--max-attempts", "0"], ["--max-attempts (0)"]),
    (["--heartbeat-timeout", "nan"], ["--heartbeat-timeout nan"]),
    (["--heartbeat-timeout", "inf"], ["--heartbeat-timeout inf"]),
    (["--heartbeat-timeout", "0"], ["--heartbeat-timeout 0"]),
    (["--data", "{root}/missing"], ["--data", "missing", "trains on text"]),
    (["--data", "{root}/empty"], ["--data", "no data manifest"]),
    (["--data", "{root}/short"], ["--data", "train.bin", "not the size"]),
    (["--data", "{root}/vocab600"], ["--data", "vocab 512", "600"]),
    (["--runs-dir", "{root}/r.db"], ["--runs-dir", "not a folder"]),
    (["--runs-dir", "{root}/r.db/runs"], ["--runs-dir", "not a folder"]),
    (["--runs-dir", "/proc/x"], ["--runs-dir /proc/x", "/proc is on proc"]),  # os.access: root may write there
    (["--runs-dir", "/sys/x/y"], ["--runs-dir /sys/x/y", "/sys is on sysfs"]),
    (["--db", "{root}/none.db"], ["no database", "none.db"]),
    (["--db", "{root}/foreign.db"], ["foreign.db", "not a fibctl database"]),
    (["--nodes", "0"], ["--nodes 0"]),
    (["--nodes", "2"], ["--nodes 2", "SQLite"]),
    (["--gpus-per-node", "-1"], ["--gpus-per-node -1"]),
    (["--tasks-per-node", "0"], ["--tasks-per-node 0"]),
    (["--gpus-per-node", "4", "--tasks-per-node", "2"], ["--tasks-per-node 2", "--gpus-per-node 4"]),
    (["--cpus-per-task", "0"], ["--cpus-per-task 0"]),
    (["--time", "4h"], ["--time", "HH:MM:SS"]),
    # the time goes into the script as given: a line break after it broke its #SBATCH line, and
    # digits of another script, which int() reads, SLURM does not
    (["--time", "04:00:00\n"], ["--time", "HH:MM:SS"]),
    (["--time", "\u0660\u0664:\u0660\u0660:\u0660\u0660"], ["--time", "HH:MM:SS"]),
    (["--time", "00:01:00"], ["--time", "too short"]),
    (["--max-requeues", "-1"], ["--max-requeues -1"]),
    (["--folder", ""], ["--folder is empty"]),  # Path(''): the job's logs in the current folder
    (["--partition", "gpu\n#SBATCH --x"], ["--partition"]),
    # written into the script's #SBATCH lines: a line after the break was a command of the script
    (["--folder", "{root}/jobs\ntouch x"], ["--folder", "jobs\\ntouch x", "a control or bidi character"]),
    (["--folder", "{root}/jobs\u202etxt"], ["--folder", "jobs\\u202etxt", "a control or bidi character"]),
    # SLURM expands its log file names (%x: the job's name; a backslash escapes) where submitit
    # made the folders: the job failed before its first line, leaving no log
    (["--folder", "{root}/jobs%x"], ["--folder", "jobs%x", "'%' or '\\'"]),
    (["--folder", "{root}/jo\\bs"], ["--folder", "jo\\bs", "'%' or '\\'"]),
    (["--time", "99999999-00:00:00"], ["--time", "at most 365-00:00:00"]),  # SLURM read it as INVALID
    (["--db", "{root}/done.db"], ["no queued runs", "done.db"]),  # a dry run too, as docs/cluster.md says
    # --ddp: the job is one torchrun group (a micro run accumulates 2 micro-batches)
    (["--nproc", "2"], ["--nproc 2 goes with --ddp"]),
    (["--ddp"], ["--ddp on a CPU-only cluster", "--nproc N"]),
    (["--ddp", "--nproc", "0"], ["--nproc 0 must be >= 1"]),
    (["--ddp", "--nproc", "2", "--gpus-per-node", "2"], ["--ddp --nproc 2 with --gpus-per-node 2", "drop --nproc"]),
    (["--ddp", "--gpus-per-node", "2", "--tasks-per-node", "2"], ["--ddp --tasks-per-node 2 with --gpus-per-node 2"]),
    (["--ddp", "--nproc", "2", "--cpus-per-task", "1"], ["--cpus-per-task 1 with --ddp --nproc 2", "at least 2"]),
    (["--ddp", "--nproc", "2", "--cpus-per-task", "2", "--threads", "2"],
     ["--threads 2 with --nproc 2: 4 CPUs a task, above --cpus-per-task 2"]),
    (["--ddp", "--nproc", "3"], ["--ddp, a group of 3 process(es): run 'a' accumulates 2 micro-batches per step, "
                                 "which 3 processes cannot share evenly"]),
    (["--ddp", "--nproc", "1", "--tasks-per-node", "3"], ["a group of 3 process(es)", "3 processes"]),
    # the rendezvous's port: only a group has one, and only a port a user may listen on
    (["--rdzv-port", "29400"], ["--rdzv-port 29400 goes with --ddp"]),
    (["--ddp", "--nproc", "1", "--rdzv-port", "80"], ["--rdzv-port 80: a TCP port from 1024 to 65535"]),
    (["--ddp", "--nproc", "1", "--rdzv-port", "65536"], ["--rdzv-port 65536: a TCP port from 1024 to 65535"]),
]


@pytest.mark.parametrize("extra, words", BAD_OPTIONS, ids=[" ".join(extra) for extra, _ in BAD_OPTIONS])
def test_bad_options_are_one_line_before_anything_is_submitted(inputs, tmp_path, monkeypatch, capsys, extra, words):
    """Checked on this host before the job exists, with or without --dry-run: otherwise every
    task of the job would fail on its node, a traceback in its log. Without sbatch on the PATH
    a missed check would say `no sbatch` instead."""
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    args = ["slurm", "submit", "--db", str(inputs["db"]), "--data", str(inputs["data"]),
            "--runs-dir", str(tmp_path / "runs"), "--folder", str(tmp_path / "jobs"),
            *(a.format(root=inputs["root"]) for a in extra)]
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    for dry_run in (["--dry-run"], []):
        code, out, err = cli(monkeypatch, capsys, *args, *dry_run)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), (dry_run, out, err)
        assert all(w in lines[0] for w in words), (dry_run, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no runs folder, no job folder
    assert runs(inputs["db"]) == [("a", "queued", None, None)]


def test_what_a_worker_accepts_is_accepted(inputs, tmp_path, monkeypatch, capsys):
    """The checks refuse no more than a worker would: threads up to --cpus-per-task, not this
    host's CPUs; no data folder for a queue of probe runs (they make their own data)."""
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    from fibctl.probe.cells import probe_runs

    base = ["slurm", "submit", "--runs-dir", str(tmp_path / "new" / "runs"), "--dry-run"]
    threads = str((os.cpu_count() or 1) + 1)
    code, out, err = cli(monkeypatch, capsys, *base, "--db", str(inputs["db"]), "--data", str(inputs["data"]),
                         "--cpus-per-task", threads, "--threads", threads)
    assert code == 0 and f"--cpus-per-task={threads}" in out, err
    queued_db(tmp_path / "probe.db", *probe_runs(depths=(2,), inits=("uniform",), seeds=(0,), steps=10))
    code, out, err = cli(monkeypatch, capsys, *base, "--db", str(tmp_path / "probe.db"),
                         "--data", str(tmp_path / "no-data"))
    assert code == 0 and "#SBATCH" in out, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.db"]  # a dry run makes no folder


def test_only_reasons_that_never_clear_cancel_a_job():
    """A job waiting for nodes that are down or reserved, for a busy cluster or for a limit
    on the user's running jobs starts in time: only a request above a fixed limit is refused."""
    from fibctl.flows.slurm import never_clears

    never = ["PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints",
             "QOSMaxNodePerJobLimit", "AssocMaxWallDurationPerJobLimit", "QOSMaxGRESPerJob"]
    waits = ["None", "Priority", "Resources", "ReqNodeNotAvail", "PartitionDown", "NodeDown", "JobHeldUser",
             "QOSMaxJobsPerUserLimit", "AssocMaxJobsLimit", "QOSGrpNodeLimit", "BeginTime", "Dependency"]
    assert [r for r in never + waits if never_clears(r)] == never


@pytest.mark.parametrize("shown, seconds", [("10:00", 600), ("00:10:00", 600), ("1:02:03", 3723),
                                             ("2-00:00:00", 172800), ("UNLIMITED", None), ("INVALID", None)])
def test_time_limits_as_slurms_tools_show_them(shown, seconds):
    """squeue's %l drops the hours under one (10:00 is ten minutes), scontrol's MaxTime keeps them."""
    from fibctl.flows.slurm import shown_seconds

    assert shown_seconds(shown) == seconds


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(data, tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    monkeypatch.chdir(tmp_path)
    done = cli_done(monkeypatch, capsys, "slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir",
                    "rel-runs", "--tasks-per-node", "2", "--time", "01:30:00", "--partition", "cpu", "--account",
                    "lab", "--folder", str(tmp_path / "jobs"), "--dry-run")
    assert done.returncode == 0, done.stderr
    script = done.stdout
    for line in ["#!/bin/bash", "#SBATCH --job-name=fibctl-worker", "#SBATCH --ntasks-per-node=2",
                 "#SBATCH --nodes=1", "#SBATCH --time=01:30:00", "#SBATCH --signal=USR2@120",
                 "#SBATCH --partition=cpu", "#SBATCH --account=lab",
                 f"export FIBCTL_DATA={data}", f"export FIBCTL_RUNS_DIR={tmp_path / 'rel-runs'}"]:
        assert line in script.splitlines(), (line, script)
    assert "srun" in script and "submitit.core._submit" in script and "gpus" not in script
    gpu = cli_done(monkeypatch, capsys, "slurm", "submit", "--db", str(db), "--data", str(data), "--gpus-per-node",
                   "4", "--nodes", "1", "--dry-run")
    assert gpu.returncode == 0 and "#SBATCH --gpus-per-node=4" in gpu.stdout and "--ntasks-per-node=4" in gpu.stdout
    assert not (tmp_path / "jobs").exists() and runs(db) == [("a", "queued", None, None)]


def test_a_ddp_dry_run_shows_each_task_s_torchrun_of_the_one_group(data, tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    from fibctl.probe.cells import probe_runs

    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    base = ["slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
            "--folder", str(tmp_path / "jobs"), "--dry-run", "--ddp"]
    cpu = cli_done(monkeypatch, capsys, *base, "--nproc", "1", "--tasks-per-node", "2", "--max-runs", "5")
    assert cpu.returncode == 0, cpu.stderr
    lines = cpu.stdout.splitlines()
    for line in ["#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=1", "#SBATCH --signal=USR2@120",
                 "# one DDP group of 2 process(es): each of the job's 2 task(s) starts torchrun on its node,",
                 "# FIRST_NODE the job's first host, PORT 20000 + the job id % 10000 (--rdzv-port):",
                 "#   torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=FIRST_NODE:PORT "
                 "--rdzv-id=$SLURM_JOB_ID -m fibctl worker --ddp --plain --device cpu --data $FIBCTL_DATA "
                 "--runs-dir $FIBCTL_RUNS_DIR --heartbeat-timeout 600.0 --max-attempts 3 --max-runs 5"]:
        assert line in lines, (line, cpu.stdout)
    # a node's GPUs: one task a node, one process a GPU
    gpu = cli_done(monkeypatch, capsys, *base, "--gpus-per-node", "2")
    assert gpu.returncode == 0, gpu.stderr
    for line in ["#SBATCH --gpus-per-node=2", "#SBATCH --ntasks-per-node=1"]:
        assert line in gpu.stdout.splitlines(), (line, gpu.stdout)
    assert "--nproc-per-node=2" in gpu.stdout and "--device cuda" in gpu.stdout and "cpus-per-task" not in gpu.stdout
    # a port of the user's choice: in the torchrun line itself, no job id's port
    port = cli_done(monkeypatch, capsys, *base, "--nproc", "1", "--rdzv-port", "29400")
    assert port.returncode == 0, port.stderr
    assert "# FIRST_NODE the job's first host (--rdzv-port):" in port.stdout.splitlines(), port.stdout
    assert " --rdzv-endpoint=FIRST_NODE:29400 " in port.stdout and "PORT" not in port.stdout, port.stdout
    # a probe run trains in one process: a group would put it back in the queue and stop
    queued_db(tmp_path / "probe.db", *probe_runs(depths=(2,), inits=("uniform",), seeds=(0,), steps=10))
    probe = cli_done(monkeypatch, capsys, *base[:2], "--db", str(tmp_path / "probe.db"), *base[4:], "--nproc", "1")
    one_line_error(probe, "--ddp, a group of 1 process(es)", "is a probe run")
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "runs").exists()


def test_a_ddp_job_s_rendezvous_is_its_first_host_at_a_port_from_its_id(monkeypatch):
    from fibctl.errors import FibctlError
    from fibctl.flows.slurm import JOB_TASK, in_job, rendezvous_endpoint

    assert rendezvous_endpoint(["gpu07", "gpu08"], "1234567") == "gpu07:24567"
    assert rendezvous_endpoint(["vm"], "3") == "vm:20003"
    assert rendezvous_endpoint(["gpu07", "gpu08"], "1234567", 29400) == "gpu07:29400"  # --rdzv-port
    # the ranks' note of their task: as the task sets it, else a line saying what is wrong
    display = object()
    assert in_job(None, display) == (None, display)
    monkeypatch.setenv(JOB_TASK, "12 1 0")
    _, noted = in_job(None, display)
    assert (noted.job_id, noted.task, noted.restart) == ("12", 1, 0)
    monkeypatch.setenv(JOB_TASK, "12 x")
    with pytest.raises(FibctlError, match="FIBCTL_SLURM_TASK='12 x' is not a job id, task and restart"):
        in_job(None, display)


@pytest.mark.parametrize("stopped_by, how", [
    (signal.SIGUSR2, "this SLURM job requeues itself and resumes"),  # a task other than 0's USR2
    (None, "this SLURM job requeues itself and resumes"),  # task 0's USR2: submitit's checkpoint()
    (signal.SIGTERM, "a new job (fibctl slurm submit) or any worker resumes"),  # scancel
    ("not in a job", "run the same command to resume")])
def test_rank_0_of_a_stopped_ddp_job_says_how_its_run_goes_on(tmp_path, monkeypatch, capsys, stopped_by, how):
    """"Run the same command" was rank 0's hint in a job's log too, where the job requeues
    itself: the task marks the stop with why, and rank 0 says what follows from it."""
    from fibctl.cli.train import _resume_hint
    from fibctl.flows.slurm import GroupTask, WorkerSettings
    from fibctl.flows.torchrun import ENVIRONMENT, JOB_TASK, STOP_MARK
    from fibctl.flows.worker import Outcome

    for name in (*ENVIRONMENT, JOB_TASK, STOP_MARK):  # as rank 0, which reports the runs
        monkeypatch.delenv(name, raising=False)
    if stopped_by != "not in a job":
        task = GroupTask(WorkerSettings("sqlite:///r.db", tmp_path, tmp_path), 0, 1, tmp_path)
        task._stop, mark = threading.Event(), tmp_path / "stopping.0"
        with subprocess.Popen(["sleep", "30"]) as group:  # no ranks: the stop goes to it
            task._group = (group, str(mark))
            task._halt(*([stopped_by, None] if stopped_by else []))
            assert group.wait(10) == -signal.SIGTERM
        monkeypatch.setenv(JOB_TASK, "12 0 0")
        monkeypatch.setenv(STOP_MARK, str(mark))
    _resume_hint([Outcome("long", "released", 57)])
    assert capsys.readouterr().err == f"hint: queued again; {how} long from step 57\n"


def test_a_dry_run_leaves_an_older_database_at_its_revision(data, tmp_path, monkeypatch, capsys):
    """--dry-run upgraded the database's schema (a write) before printing the script."""
    pytest.importorskip("submitit", reason="fibctl slurm needs submitit (pip install -e '.[slurm]')")
    from alembic import command
    from sqlalchemy import create_engine

    from fibctl.db.engine import alembic_config, current_revision

    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4))
    engine = create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "-1")
    before = current_revision(engine)
    monkeypatch.chdir(tmp_path)
    done = cli_done(monkeypatch, capsys, "slurm", "submit", "--db", str(db), "--data", str(data), "--folder",
                    str(tmp_path / "jobs"), "--dry-run")
    one_line_error(done, "fibctl db upgrade")
    assert current_revision(engine) == before


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


@needs_cluster
def test_a_job_sbatch_refuses_is_one_line_and_leaves_no_files(inputs, tmp_path):
    """sbatch's own two lines went to stderr above fibctl's, and submitit's script and pickle
    of the job that never was stayed in the job folder."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "earlier").write_text("kept\n")
    for folder, extra, reason in ((tmp_path / "jobs", ["--partition", "nosuch"], "invalid partition"),
                                  (tmp_path / "new-jobs", ["--gpus-per-node", "99999999"], "")):
        done = fibctl("slurm", "submit", "--db", str(inputs["db"]), "--data", str(inputs["data"]),
                      "--runs-dir", str(tmp_path / "runs"), "--folder", str(folder), *extra)
        one_line_error(done, "sbatch refused the job: ", reason)
        assert "Batch job submission failed" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["earlier"]
    assert not (tmp_path / "new-jobs").exists()
    assert runs(inputs["db"]) == [("a", "queued", None, None)]


# SLURM's generic PartitionConfig: the line names the option, from the node's CPUs (scontrol)
NEVER = [(["--nodes", "2"], "PartitionNodeLimit", "--nodes"),  # one node: a server database, not SQLite
         (["--cpus-per-task", "9999"], "PartitionConfig",
          r"--cpus-per-task 9999 is above the \d+ CPUs of the partition's largest node: give at most that"),
         (["--tasks-per-node", "9999"], "PartitionConfig",
          r"9999 tasks a node of 1 CPU\(s\) each \(--tasks-per-node or --gpus-per-node, --cpus-per-task\) are 9999 "
          r"CPUs, above the \d+ CPUs of the partition's largest node")]


@needs_cluster
@pytest.mark.parametrize("extra, reason, option", NEVER, ids=[" ".join(e) for e, _, _ in NEVER])
def test_a_job_slurm_would_never_start_is_cancelled_and_refused_in_one_line(data, tmp_path, extra, reason, option):
    """sbatch queues a job its partition can never run (EnforcePartLimits=NO, SLURM's default):
    `submit` said it was submitted, and it pended forever."""
    from conftest import NO_PG, PG_SERVER, pg_database

    if "--nodes" in extra and not PG_SERVER:
        pytest.skip(NO_PG)
    with pg_database() if "--nodes" in extra else contextlib.nullcontext(str(tmp_path / "r.db")) as db:
        queued_db(db, micro_run("a", steps=4)).dispose()
        done = fibctl("slurm", "submit", "--db", db, "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                      "--folder", str(tmp_path / "jobs"), "--time", "00:10:00", *extra)
    jobs = re.findall(r"SLURM job (\d+)", done.stdout + done.stderr)
    try:
        one_line_error(done, "can never start in partition ", reason, "the job was cancelled")
        assert re.search(option, done.stderr), done.stderr
        assert [squeue_state(job) for job in jobs] == ["CANCELLED"]
    finally:  # not left pending forever when the test fails
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    assert not (tmp_path / "jobs").exists()  # nothing of the job that never was


@contextlib.contextmanager
def made_partition(*settings: str):
    """A partition of this cluster's one node with `settings` (scontrol's), made for the test
    (scontrol, as SLURM's administrator) and deleted with its jobs afterwards: the cluster's
    own partition has no limit."""
    if os.geteuid() != 0:
        pytest.skip("making a partition (scontrol create) needs SLURM's administrator, root here")
    name = f"fibctl_short_{os.getpid()}_{time.monotonic_ns() % 10**6}"
    node = socket.gethostname().split(".")[0]
    made = subprocess.run(["scontrol", "create", f"PartitionName={name}", f"Nodes={node}", *settings,
                           "State=UP"], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    try:
        yield name
    finally:
        subprocess.run(["scancel", "--partition", name], capture_output=True, timeout=30)
        for _ in range(20):  # a job SLURM is still ending holds on to its partition
            if subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True,
                              timeout=30).returncode == 0:
                break
            time.sleep(0.5)


@pytest.fixture
def short_partition():
    """A partition whose MaxTime is 5 minutes."""
    with made_partition("MaxTime=00:05:00") as name:
        yield name


@needs_cluster
@pytest.mark.parametrize("limit", ["00:10:00", "00:05:30"])  # SLURM takes the latter as 6 minutes
def test_a_time_above_the_partitions_max_time_is_refused_naming_that_max_time(data, tmp_path, short_partition, limit):
    """sbatch queues a job longer than its partition's MaxTime, to pend forever with reason
    PartitionTimeLimit: the job was cancelled, but the line did not say what the limit was."""
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4)).dispose()
    done = fibctl("slurm", "submit", "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                  "--folder", str(tmp_path / "jobs"), "--partition", short_partition, "--time", limit)
    jobs = re.findall(r"SLURM job (\d+)", done.stdout + done.stderr)
    try:
        one_line_error(done, f"can never start in partition {short_partition}: PartitionTimeLimit",
                       f"--time {limit} is above the partition's MaxTime 00:05:00", "the job was cancelled")
        assert [squeue_state(job) for job in jobs] == ["CANCELLED"]
    finally:
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
    assert not (tmp_path / "jobs").exists() and runs(db) == [("a", "queued", None, None)]
    # SLURM's first word for such a job is its generic PartitionConfig, kept where it schedules
    # seldom: the time is named then too, as scontrol gives the partition's MaxTime
    from fibctl.flows.slurm import never_message

    assert "--time 00:10:00 is above the partition's MaxTime 00:05:00" in never_message(
        "1", "PartitionConfig", short_partition, "00:10:00")


@needs_cluster
def test_a_partition_config_reason_names_the_option_asking_too_much():
    """SLURM's first word for a job beyond its partition may be its generic PartitionConfig, kept
    where the cluster schedules seldom, whatever the cause: the line listed every option it
    might be. It names the one asking more than the partition's nodes have, or than its
    MaxCPUsPerNode allows, from what scontrol says of the job; the list where neither is it."""
    from fibctl.flows.slurm import never_message

    with made_partition("MaxCPUsPerNode=1") as partition:
        said = {}
        for extra in (["--cpus-per-task", "2"], ["--ntasks-per-node", "2", "--cpus-per-task", "2"], ["--nodes", "2"],
                      []):
            job = held_job("--partition", partition, *extra)
            try:
                said[" ".join(extra)] = never_message(job, "PartitionConfig", partition, "00:10:00").split(": ", 1)[1]
            finally:
                subprocess.run(["scancel", job], timeout=30)
    assert said == {
        "--cpus-per-task 2": "PartitionConfig (--cpus-per-task 2 is above the partition's MaxCPUsPerNode 1: give at "
                             "most that)",
        "--ntasks-per-node 2 --cpus-per-task 2": "PartitionConfig (2 tasks a node of 2 CPU(s) each (--tasks-per-node "
                                                 "or --gpus-per-node, --cpus-per-task) are 4 CPUs, above the "
                                                 "partition's MaxCPUsPerNode 1)",
        "--nodes 2": "PartitionConfig (--nodes 2 is above the partition's 1 node(s): give at most that)",
        "": "PartitionConfig (more than the partition or its nodes allow: --nodes, --cpus-per-task, --gpus-per-node, "
            "--tasks-per-node)"}


@needs_cluster
def test_a_time_at_the_partitions_max_time_runs(data, tmp_path, short_partition):
    """No more is refused than SLURM refuses: a --time equal to MaxTime starts and trains."""
    db = tmp_path / "r.db"
    queued_db(db, micro_run("a", steps=4)).dispose()
    job = submit(db, data, tmp_path, "--partition", short_partition, "--time", "00:05:00")
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    assert [r[1] for r in runs(db)] == ["done"]


@needs_cluster
def test_status_says_which_job_can_never_start_and_why(inputs, short_partition):
    """A job pending forever (the partition's MaxTime lowered after it was submitted, or one
    submitted by hand) was listed as PENDING and nothing more."""
    job = subprocess.run(["sbatch", "--parsable", "--job-name", "fibctl-worker", "--partition", short_partition,
                          "--time", "00:10:00", "--chdir", "/", "--output", "/dev/null", "--wrap", "true"],
                         capture_output=True, text=True, timeout=30)
    assert job.returncode == 0, job.stderr
    job = job.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "PartitionTimeLimit" not in subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True, timeout=30).stdout:
            time.sleep(0.5)
        status = fibctl("slurm", "status", "--db", str(inputs["db"]))
    finally:
        subprocess.run(["scancel", job], timeout=30)
    assert status.returncode == 0, status.stderr
    said = " ".join(status.stdout.split())  # the line may wrap
    assert (f"SLURM job {job} can never start in partition {short_partition}: PartitionTimeLimit (--time 00:10:00 "
            f"is above the partition's MaxTime 00:05:00: give at most that); cancel it: scancel {job}") in said, \
        status.stdout


def held_job(*extra: str) -> str:
    """A job named as fibctl's, held: it never runs (the caller cancels it)."""
    done = subprocess.run(["sbatch", "--parsable", "--hold", "--job-name", "fibctl-worker", "--chdir", "/",
                           "--output", "/dev/null", *extra, "--wrap", "true"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


@needs_cluster
def test_status_lists_this_users_jobs_only(inputs):
    """On a shared cluster `slurm status` listed every user's fibctl-worker jobs (squeue and
    sacct were asked for the name only), and joined them with this database's runs."""
    if os.geteuid() != 0:
        pytest.skip("a job of another user is submitted with sbatch --uid, which needs root")
    other = held_job("--uid", "nobody")
    mine = held_job()
    try:
        status = fibctl("slurm", "status", "--db", str(inputs["db"]))
    finally:
        subprocess.run(["scancel", other, mine], timeout=30)
    assert status.returncode == 0, status.stderr
    assert any(f" {mine} " in line for line in status.stdout.splitlines()), status.stdout
    assert not any(f" {other} " in line for line in status.stdout.splitlines()), status.stdout


@needs_cluster
@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_a_job_given_a_password_keeps_its_files_to_this_user(data, tmp_path, where):
    """The pickled task holds the database URL: with a password in it, the job folder and
    every file in it (the pickle, and the logs the job writes) were readable by anyone; a
    password in the URL's query (libpq's ?password=) was neither noticed nor masked in the log."""
    from conftest import NO_PG, PG_SERVER, pg_database
    from sqlalchemy.engine import make_url

    from fibctl import queue
    from fibctl.db.engine import connect

    if not PG_SERVER:
        pytest.skip(NO_PG)
    with pg_database() as url:
        url = make_url(url)
        secret = url.password or "s3cret-unused"  # the test server trusts its clients: any will do
        url = (url.set(password=secret) if where == "userinfo"
               else url.set(password=None).update_query_dict({"password": secret}))
        url = url.render_as_string(hide_password=False)
        engine = connect(url)
        queue.add_runs(engine, [micro_run("a", steps=4)])
        engine.dispose()
        job = fibctl("slurm", "submit", "--db", url, "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                     "--folder", str(tmp_path / "jobs"), "--time", "00:10:00")
        assert job.returncode == 0, job.stderr
        job = job.stdout.split()[3].rstrip(":")
        assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    files = [tmp_path / "jobs", *(tmp_path / "jobs" / job).iterdir()]
    assert any(p.name.endswith("_submitted.pkl") for p in files) and any(p.name.endswith("_log.out") for p in files)
    assert {p.name: oct(p.stat().st_mode & 0o077) for p in files} == {p.name: "0o0" for p in files}
    logs = "".join(p.read_text() for p in files if p.name.endswith("_log.out"))
    assert "***" in logs and secret not in logs, logs


LONG = dict(steps=200, eval_interval=1000, checkpoint_interval=1000)


def preempt_midway(db: Path, runs: int, job: str, tmp_path: Path, scancel: tuple = ("--signal=USR2",)) -> list[int]:
    """SLURM's preemption signal (USR2) to every task of the job (or `scancel` with other
    options; none: cancel it), once each of its `runs` runs has logged step 20 or later; the
    steps each had reached."""
    deadline = time.monotonic() + 60
    steps: list[int] = []
    while time.monotonic() < deadline:
        steps = [m for (m,) in sqlite3.connect(db).execute(
            "select max(step) from train_steps group by run_id")]
        if len(steps) == runs and min(steps) >= 20:
            break
        time.sleep(0.2)
    assert len(steps) == runs and 20 <= min(steps) and max(steps) < LONG["steps"], (steps, job_log(tmp_path, job))
    subprocess.run(["scancel", *scancel, job], check=True, timeout=30)
    return steps


def released_at(db: Path, names: list[str] = ("long",)) -> list[int]:
    """The step each run's one `released` event names ("released at step N; ..."), in order."""
    con = sqlite3.connect(db)
    messages = [con.execute("select e.message from events e join runs r on r.id = e.run_id where r.name = ? "
                            "and e.kind = 'released'", (name,)).fetchall() for name in names]
    assert all(len(m) == 1 for m in messages), messages
    return [int(m[0][0].split()[3].rstrip(";")) for m in messages]


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
    steps = preempt_midway(db, 2, job, tmp_path)
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    kinds = [k for (k,) in sqlite3.connect(db).execute("select kind from events order by id")]
    assert kinds.count("released") == 2 and kinds.count("resumed") == 2 and kinds.count("claimed") == 4, kinds
    for (message,) in sqlite3.connect(db).execute("select message from events where kind = 'released'"):
        assert min(steps) <= int(message.split()[3].rstrip(";")) < LONG["steps"], message
    restarts = sorted((raw if isinstance(raw, dict) else __import__("json").loads(raw))["restart"]
                      for _, _, raw in events(db, "slurm"))
    assert restarts == [0, 0, 1, 1]  # the same job, requeued by submitit, trained the runs' second parts
    assert [r[1] for r in runs(db)] == ["done", "done"]
    assert "hint:" not in job_log(tmp_path, job)  # a task's worker says nothing of what to run next
    expected = reference.model.state_dict()
    for name in names:
        path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = ?", (name,)).fetchone()[0]
        final = load_checkpoint(tmp_path / "runs" / path)["model"]
        assert final.keys() == expected.keys()
        for k in final:
            assert torch.equal(final[k], expected[k]), (name, k)


@needs_cluster
def test_a_cancelled_two_task_job_releases_its_runs_at_the_step_reached_and_a_worker_finishes_them(data, tmp_path):
    """scancel JOBID: SIGTERM to every task; each worker finishes its step, checkpoints and
    puts its run back in the queue, and the job ends, not requeued."""
    db = tmp_path / "r.db"
    names = ["long_a", "long_b"]
    queued_db(db, *(micro_run(n, **LONG) for n in names))
    job = submit(db, data, tmp_path, "--tasks-per-node", "2")
    steps = preempt_midway(db, 2, job, tmp_path, scancel=())
    assert wait_for(job, 60) == "CANCELLED", job_log(tmp_path, job)
    log = job_log(tmp_path, job)
    assert [r[1] for r in runs(db)] == ["queued", "queued"] and "hint:" not in log, log
    for name, stopped in zip(names, released_at(db, names)):
        assert min(steps) <= stopped < LONG["steps"], log
        path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = ?", (name,)).fetchone()[0]
        assert load_checkpoint(tmp_path / "runs" / path)["step"] == stopped, log
    assert [k for (k,) in sqlite3.connect(db).execute("select kind from events")].count("slurm") == 2  # no requeue
    done = fibctl("worker", "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                  "--threads", "1", "--plain", timeout=300)
    assert done.returncode == 0 and [r[1] for r in runs(db)] == ["done", "done"], done.stderr
    torch.set_num_threads(1)
    reference = Trainer(micro_run("ref", **LONG), load_manifest(data), tmp_path / "ref", NullReporter())
    assert reference.run().status == "done"
    for name in names:
        path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = ?", (name,)).fetchone()[0]
        final = load_checkpoint(tmp_path / "runs" / path)["model"]
        assert all(torch.equal(final[k], v) for k, v in reference.model.state_dict().items()), name


def slurm_events(db: Path) -> list[tuple[str, str, dict]]:
    return [(name, message, raw if isinstance(raw, dict) else json.loads(raw))
            for name, message, raw in events(db, "slurm")]


DDP = ("--ddp", "--nproc", "1", "--tasks-per-node", "2")  # one group of 2 tasks x 1 gloo process


@needs_cluster
def test_a_ddp_job_is_one_group_over_its_tasks_and_trains_each_run_once_as_one_process_would(data, tmp_path):
    """Two tasks on the one node stand for two nodes: each starts torchrun with --nnodes 2, and
    the two meet at the job's c10d rendezvous (the path of several nodes)."""
    torch.set_num_threads(1)
    db = tmp_path / "r.db"
    short = dict(steps=8, eval_interval=8, checkpoint_interval=8)
    configs = [micro_run("a", **short), micro_run("b", "learned", **short)]
    queued_db(db, *configs)
    job = submit(db, data, tmp_path, *DDP)
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    host = socket.gethostname()
    rows = sqlite3.connect(db).execute("select name, status, attempts, device, worker from runs order by id").fetchall()
    assert [r[:3] for r in rows] == [("a", "done", 1), ("b", "done", 1)], job_log(tmp_path, job)
    assert all(r[3].endswith(" x 2 ranks") and r[4].endswith(":ddp2") for r in rows), rows
    assert sorted(name for name, _, _ in events(db, "claimed")) == ["a", "b"]  # each claimed once
    noted = slurm_events(db)
    assert sorted(name for name, _, _ in noted) == ["a", "b"], noted  # one event a run: rank 0's
    for name, message, info in noted:
        assert info["job_id"] == job and info["host"] == host and info["task"] in (0, 1), info
        assert f"SLURM job {job} task {info['task']} on {host}" in message
        assert next(r[4] for r in rows if r[0] == name) == f"{host}:{info['pid']}:ddp2"  # rank 0 trained it
    # both tasks started torchrun as one of the group's 2 "nodes", at the job's rendezvous
    endpoint = f"--rdzv-endpoint={host.split('.')[0]}:{20000 + int(job) % 10000}"
    for task in (0, 1):
        log = (tmp_path / "jobs" / job / f"{job}_{task}_log.out").read_text()
        assert f"task {task}/2 of SLURM job {job}" in log and "--nnodes=2 --nproc-per-node=1" in log, log
        assert endpoint in log and f"--rdzv-id={job}" in log, log
    for config in configs:  # the gradients of 2 ranks summed in another order: within 1e-5 (fp32)
        path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = ?",
                                           (config.name,)).fetchone()[0]
        reference, _ = one_process(config, data, tmp_path / f"one_{config.name}")
        assert_close(load_checkpoint(tmp_path / "runs" / path)["model"], reference, 1e-5)


@needs_cluster
def test_a_preempted_ddp_job_stops_its_group_requeues_and_finishes_the_run_as_one_process_would(data, tmp_path):
    """USR2 reaches every process of a task here (proctrack/linuxproc): torchrun and its ranks
    would end by it; the task alone acts on it, stopping its ranks, and task 0 requeues the job."""
    torch.set_num_threads(1)
    db = tmp_path / "r.db"
    config = micro_run("long", **LONG)
    queued_db(db, config)
    job = submit(db, data, tmp_path, *DDP)
    steps = preempt_midway(db, 1, job, tmp_path)
    assert wait_for(job, 110) == "COMPLETED", job_log(tmp_path, job)
    kinds = [k for (k,) in sqlite3.connect(db).execute("select kind from events order by id")]
    assert kinds.count("released") == 1 and kinds.count("resumed") == 1 and kinds.count("claimed") == 2, kinds
    (message,) = sqlite3.connect(db).execute("select message from events where kind = 'released'").fetchone()
    stopped = int(message.split()[3].rstrip(";"))
    assert steps[0] <= stopped < LONG["steps"], message
    # rank 0's hint in the job's log says the job requeues itself, not "run the same command"
    assert (f"hint: queued again; this SLURM job requeues itself and resumes long from step {stopped}"
            in job_log(tmp_path, job)), job_log(tmp_path, job)
    assert sorted(info["restart"] for _, _, info in slurm_events(db)) == [0, 1]  # the same job, requeued
    assert [r[1] for r in runs(db)] == ["done"]
    path = sqlite3.connect(db).execute("select checkpoint_path from runs").fetchone()[0]
    reference, _ = one_process(config, data, tmp_path / "one")
    assert_close(load_checkpoint(tmp_path / "runs" / path)["model"], reference, 1e-5)




@needs_cluster
def test_a_cancelled_ddp_job_stops_its_group_at_one_step_and_a_new_job_resumes_from_it(data, tmp_path):
    """scancel's SIGTERM reaches torchrun and each rank here (proctrack/linuxproc) as well as
    the task, which passes it on, and torchrun passes its own on: a rank signalled two or three
    times must still take it for one stop, checkpointing at the step it stopped after."""
    torch.set_num_threads(1)
    db = tmp_path / "r.db"
    config = micro_run("long", **LONG)  # no checkpoint of its own before step 200
    queued_db(db, config)
    job = submit(db, data, tmp_path, *DDP)
    steps = preempt_midway(db, 1, job, tmp_path, scancel=())  # cancelled: SIGTERM to each process
    assert wait_for(job, 60) == "CANCELLED", job_log(tmp_path, job)
    log = job_log(tmp_path, job)
    assert [r[1] for r in runs(db)] == ["queued"], log
    (stopped,) = released_at(db)
    assert steps[0] <= stopped < LONG["steps"], log
    path = sqlite3.connect(db).execute("select checkpoint_path from runs").fetchone()[0]
    assert path is not None and load_checkpoint(tmp_path / "runs" / path)["step"] == stopped, log
    assert "aborted; it resumes" not in log and "run the same command" not in log, log
    # rank 0's hint says how the run goes on: not "run the same command", nor a requeue
    assert f"hint: queued again; a new job (fibctl slurm submit) or any worker resumes long from step {stopped}" \
        in log, log
    with socket.socket() as free:  # the new job at a port of the user's choice (--rdzv-port)
        free.bind(("", 0))
        port = free.getsockname()[1]
    again = submit(db, data, tmp_path, *DDP, "--rdzv-port", str(port))
    assert wait_for(again, 110) == "COMPLETED", job_log(tmp_path, again)
    assert f"--rdzv-endpoint={socket.gethostname().split('.')[0]}:{port} " in job_log(tmp_path, again)
    resumed = [m for _, m, _ in events(db, "resumed")]
    assert len(resumed) == 1 and f"step {stopped}" in resumed[0], resumed
    assert [r[1] for r in runs(db)] == ["done"]
    path = sqlite3.connect(db).execute("select checkpoint_path from runs").fetchone()[0]
    reference, _ = one_process(config, data, tmp_path / "one")
    assert_close(load_checkpoint(tmp_path / "runs" / path)["model"], reference, 1e-5)


def test_a_task_s_log_line_shows_the_loss_as_the_progress_line_does(monkeypatch, capsys):
    """A SLURM task's log gave a step's loss to 4 decimals, `fibctl train` and `status` to 3."""
    from fibctl.cli.train import progress_line
    from fibctl.flows import slurm
    from fibctl.train.trainer import Progress

    monkeypatch.setattr(slurm, "note_job", lambda *args: None)
    step = Progress(50, 100, 3.25, 4321.0, 60.0)
    slurm.JobDisplay(None, "7", 0, 0, every=50).start("dense", 100)(step)
    logged = capsys.readouterr().out.splitlines()[-1]
    assert logged == "task 0: dense step 50/100 loss 3.250 4,321 tok/s", logged
    assert " loss 3.250 " in progress_line("dense", step)
