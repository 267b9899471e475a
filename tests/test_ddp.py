"""One run over several processes (torchrun, DistributedDataParallel, gloo on the CPU): the
same run as one process, rank 0 alone in the database and the runs folder, bad --nproc refused."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fibctl.config import RunConfig
from fibctl.data.streams import load_manifest
from fibctl.errors import FibctlError
from fibctl.train.checkpoint import load_checkpoint
from fibctl.train.distributed import PeerLost
from fibctl.flows.torchrun import ENVIRONMENT
from fibctl.train.trainer import Trainer
from cli_helpers import refused
from train_helpers import Losses, assert_close, micro_run, one_process, queued_db, write_data

torch.set_num_threads(1)
needs_two_cpus = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="gloo runs one process per CPU; this has 1")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


def fibctl(*args, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def final_checkpoint(db: Path, runs: Path) -> dict:
    path = sqlite3.connect(db).execute("select checkpoint_path from runs where name = 'run'").fetchone()[0]
    return load_checkpoint(runs / path)


@needs_two_cpus
def test_two_ranks_train_the_run_one_process_trains(data, tmp_path):
    # learned: theta is a parameter like any other, averaged by DDP; micro accumulates 2 micro-batches
    config = micro_run("run", "learned")
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    queued_db(db, config).dispose()
    done = fibctl("train", "run", "--nproc", "2", "--db", str(db), "--data", str(data), "--runs-dir", str(runs),
                  "--plain", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "find_unused_parameters" not in done.stderr  # its rungs stay: no search for unused ones
    reference, losses = one_process(config, data, tmp_path / "one")
    state = final_checkpoint(db, runs)
    assert state["step"] == 30
    assert_close(state["model"], reference, 1e-5)
    q = sqlite3.connect(db).execute
    assert q("select status, attempts, device from runs").fetchone()[:2] == ("done", 1)
    assert "x 2 ranks" in q("select device from runs").fetchone()[0]
    # rank 0 alone writes: each log line, evaluation and checkpoint once
    logged = dict(q("select step, loss from train_steps order by step").fetchall())
    assert sorted(logged) == [5, 10, 15, 20, 25, 30]
    for step, loss in logged.items():  # the loss of the whole step, gathered from both ranks
        assert abs(loss - losses[step]) < 1e-5, step
    assert q("select count(*) from evaluations").fetchone() == (6,)  # steps 10, 20, 30 x 2 held-out sets
    assert q("select count(*) from events where kind = 'claimed'").fetchone() == (1,)
    assert sorted(p.name for p in (runs / "run").iterdir()) == ["step_00000020.pt", "step_00000030.pt"]


@needs_two_cpus
def test_a_learned_layer_that_keeps_no_rung_trains_on_two_ranks_as_in_one_process(data, tmp_path):
    # a window of 60 in a 64-token model keeps no rung: theta reaches no loss, and one process
    # leaves its gradient empty; DDP failed the run at step 2 ("parameters that were not used")
    config = RunConfig.resolve("run", "test", "micro", schedule="learned", window=60, seed=42, steps=4)
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    queued_db(db, config).dispose()
    done = fibctl("train", "run", "--nproc", "2", "--db", str(db), "--data", str(data), "--runs-dir", str(runs),
                  "--plain", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    assert sqlite3.connect(db).execute("select status from runs").fetchone() == ("done",)
    reference, _ = one_process(config, data, tmp_path / "one")
    assert_close(final_checkpoint(db, runs)["model"], reference, 1e-5)


@pytest.mark.parametrize("nproc, words", [
    ("2", "accumulates 3 micro-batches per step, which 2 processes cannot share evenly"),
    ("0", "--nproc 0 must be >= 1"),
    (str((os.cpu_count() or 1) + 1), "CPUs (gloo: one process per CPU)"),
    ("1 under torchrun", "--nproc under torchrun: torchrun already started the processes; drop --nproc"),
])
def test_an_nproc_that_does_not_fit_is_one_line_exit_2_and_the_run_stays_queued(data, tmp_path, monkeypatch, capsys,
                                                                               nproc, words):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run", grad_accum=3)).dispose()
    monkeypatch.chdir(tmp_path)
    if nproc.endswith(" under torchrun"):  # a rank's environment: the group exists already
        nproc = nproc.split()[0]
        for name, value in zip(ENVIRONMENT, ("0", "1", "0", "127.0.0.1", "29500")):
            monkeypatch.setenv(name, value)
    assert words in refused(monkeypatch, capsys, "train", "run", "--nproc", nproc, "--db", str(db), "--data",
                            str(data), "--device", "cpu", "--runs-dir", str(tmp_path / "runs"))
    assert sqlite3.connect(db).execute("select status, attempts from runs").fetchall() == [("queued", 0)]
    assert not (tmp_path / "runs").exists()


def test_train_with_part_of_torchrun_s_environment_is_one_line_exit_2_and_the_run_stays_queued(data, tmp_path):
    # a rank started by hand (RANK and WORLD_SIZE, no rendezvous): it trained the run alone,
    # as one process, where `worker --ddp` refuses the same environment
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT} | {"RANK": "1", "WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-m", "fibctl", "train", "run", "--db", str(db), "--data", str(data),
                           "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "torchrun's environment is incomplete (LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set)" in done.stderr
    assert "unset RANK, WORLD_SIZE to train in one process" in done.stderr
    assert sqlite3.connect(db).execute("select status, attempts from runs").fetchall() == [("queued", 0)]
    assert not (tmp_path / "runs").exists()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        out += children
        frontier = children
    return out


def rank_pid(pid: int, rank: int) -> int:
    for child in descendants(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and any(e.startswith(b"LOCAL_RANK=") for e in environ):
            return child  # torchrun sets both for its workers only
    raise AssertionError(f"no rank {rank} below {pid}")


def start(db: Path, runs: Path, data: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fibctl", "train", "run", "--nproc", "2", "--db", str(db),
                             "--data", str(data), "--runs-dir", str(runs), "--plain", *extra],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@needs_two_cpus
def test_a_dead_rank_stops_the_group_and_a_killed_group_resumes_equal_to_an_uninterrupted_run(data, tmp_path):
    config = micro_run("run", steps=50, checkpoint_interval=10, eval_interval=50)  # killed past step 10
    uninterrupted, killed_rank, killed_group = (tmp_path / name for name in ("whole", "rank", "group"))
    for folder in (uninterrupted, killed_rank, killed_group):
        folder.mkdir()
        queued_db(folder / "r.db", config).dispose()
    # torchrun's own command line, as docs/cluster.md gives it
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "fibctl", "train", "run", "--db", str(uninterrupted / "r.db"), "--data", str(data),
                             "--runs-dir", str(uninterrupted / "runs"), "--plain"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.wait(timeout=240) == 0, proc.communicate()
    reference = final_checkpoint(uninterrupted / "r.db", uninterrupted / "runs")["model"]

    # rank 1 dies alone: rank 0 stops at once, puts the run back in the queue; no hang
    proc = start(killed_rank / "r.db", killed_rank / "runs", data, tmp_path)
    wait_for(killed_rank / "runs" / "run" / "step_00000010.pt", proc)
    os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0
    q = sqlite3.connect(killed_rank / "r.db").execute
    assert q("select status from runs").fetchone() == ("queued",), err[-3000:]
    assert "died or stopped answering" in q("select message from events where kind = 'released'").fetchone()[0]
    assert "is queued again" in err

    # the whole group killed: the run stays `running` until its heartbeat is stale
    proc = start(killed_group / "r.db", killed_group / "runs", data, tmp_path)
    wait_for(killed_group / "runs" / "run" / "step_00000010.pt", proc)
    group = [proc.pid, *descendants(proc.pid)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # all frozen first: a launcher killed before its ranks
        for pid in group:                         # sent them SIGTERM, and rank 0 once requeued the run
            os.kill(pid, sig)
    proc.communicate(timeout=30)
    assert sqlite3.connect(killed_group / "r.db").execute("select status from runs").fetchone() == ("running",)
    time.sleep(1.5)

    # both resume from their last checkpoint and end bit-exact with the uninterrupted run: two
    # ranks sum each gradient element in one order, whatever DDP's buckets
    for folder in (killed_rank, killed_group):
        proc = start(folder / "r.db", folder / "runs", data, tmp_path, "--heartbeat-timeout", "1")
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        q = sqlite3.connect(folder / "r.db").execute
        assert q("select status, final_step from runs").fetchone() == ("done", 50)
        assert q("select count(*) from events where kind = 'resumed'").fetchone() == (1,)
        state = final_checkpoint(folder / "r.db", folder / "runs")["model"]
        for k in reference:
            assert torch.equal(state[k], reference[k]), k


@needs_two_cpus
def test_a_rank_that_resumes_from_another_step_stops_the_group_and_the_run_stays_queued(data, tmp_path):
    """A node that does not see rank 0's runs folder (no shared filesystem) found no checkpoint
    and trained from step 0 beside a rank 0 at step 10: weights out of step, silently."""
    from fibctl.flows.worker import WorkerOptions, work
    import threading
    from train_helpers import Quiet

    db, runs = tmp_path / "r.db", tmp_path / "runs"
    engine = queued_db(db, micro_run("run"))
    stop = threading.Event()
    work(engine, WorkerOptions(data_dir=data, runs_dir=runs), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    engine.dispose()
    rank = tmp_path / "rank.py"  # rank 1 on a node of its own: the runs folder is empty there
    rank.write_text("import os, sys\n"
                    "from fibctl.train import checkpoint\n"
                    "if os.environ['RANK'] == '1':\n"
                    "    checkpoint.list_checkpoints = lambda run_dir: []\n"
                    "from fibctl.cli import main\n"
                    "sys.argv = ['fibctl', *sys.argv[1:]]\n"
                    "main()\n")
    # fibctl's own torchrun (what --nproc starts): the group's exit code is rank 0's
    done = subprocess.run([sys.executable, "-m", "fibctl.flows.torchrun", "--standalone", "--nproc-per-node", "2",
                           str(rank), "train", "run", "--db", str(db), "--data", str(data), "--runs-dir", str(runs),
                           "--plain"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the ranks resumed 'run' from different checkpoints (rank 0 from step 13, rank 1 from step 0)" in done.stderr
    q = sqlite3.connect(db).execute
    assert q("select status, checkpoint_path from runs").fetchone() == ("queued", "run/step_00000013.pt")
    assert q("select count(*) from train_steps where step > 13").fetchone() == (0,)


@needs_two_cpus
@pytest.mark.parametrize("command", [("train", "run", "--nproc", "2"),
                                     ("worker", "--ddp", "--nproc", "2", "--device", "cpu")])
def test_sigterm_stops_every_rank_at_one_step_checkpoints_and_requeues(data, tmp_path, command):
    queued_db(tmp_path / "r.db", micro_run("run", steps=200, checkpoint_interval=10, eval_interval=200)).dispose()
    proc = subprocess.Popen([sys.executable, "-m", "fibctl", *command, "--db", str(tmp_path / "r.db"), "--data",
                             str(data), "--runs-dir", str(tmp_path / "runs"), "--plain"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "runs" / "run" / "step_00000020.pt", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    status, path = sqlite3.connect(tmp_path / "r.db").execute("select status, checkpoint_path from runs").fetchone()
    assert status == "queued" and "released at step" in out
    assert load_checkpoint(tmp_path / "runs" / path)["step"] >= 20
    # how training goes on, as one process says it: once (rank 0's), not once per rank
    assert err.count("hint: queued again; run the same command to resume run from step") == 1, err[-3000:]


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_two_cpus
def test_a_killed_launcher_stops_the_group_which_checkpoints_and_requeues(data, tmp_path):
    # torchrun runs in its own session: killed alone (SIGKILL, or a closed terminal's SIGHUP), the
    # launcher left the group training unattended, its lines to a closed terminal failing the run
    queued_db(tmp_path / "r.db", micro_run("run", steps=5000, checkpoint_interval=10, eval_interval=5000)).dispose()
    proc = subprocess.Popen([sys.executable, "-m", "fibctl", "train", "run", "--nproc", "2", "--db",
                             str(tmp_path / "r.db"), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                             "--plain"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(tmp_path / "runs" / "run" / "step_00000020.pt", proc)
    group = descendants(proc.pid)
    try:
        proc.kill()
        proc.wait()
        deadline = time.time() + 120  # a hang guard: the group stops within a step
        while any(running(pid) for pid in group):
            assert time.time() < deadline, "the group went on training without its launcher"
            time.sleep(0.1)
    finally:
        for pid in group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    q = sqlite3.connect(tmp_path / "r.db").execute
    status, path = q("select status, checkpoint_path from runs").fetchone()
    assert status == "queued" and load_checkpoint(tmp_path / "runs" / path)["step"] >= 20
    assert q("select count(*) from events where kind = 'stopped'").fetchone() == (1,)  # not aborted


def test_every_collective_that_fails_says_a_peer_was_lost(monkeypatch):
    """A rank's sum, vote or broadcast that fails (the other rank gone: gloo's connection
    closed) is PeerLost, which stops this rank with one line, never a traceback."""
    from fibctl.train.distributed import Group, PeerLost

    def closed(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", closed)
    group = Group(rank=1, world=2, local_rank=1)
    for collective in (lambda: group.sum(torch.zeros(1)), lambda: group.any(True, device=torch.device("cpu")),
                       lambda: group.broadcast("x")):
        with pytest.raises(PeerLost, match="died or stopped answering"):
            collective()


def test_a_rank_whose_launcher_ended_before_it_could_watch_it_stops_at_once(tmp_path):
    """The launcher's end is signalled to its child only once the child asks (prctl): one that
    ended just before, the child now another process's, is seen by its parent's pid."""
    from fibctl.flows.torchrun import LAUNCHER

    watched = subprocess.run([sys.executable, "-c", "from fibctl.flows.torchrun import end_with_launcher\n"
                              "end_with_launcher()\nprint('trained on')"], capture_output=True, text=True,
                             env={**os.environ, LAUNCHER: str(os.getpid() + 999_999)}, timeout=120)
    assert (watched.returncode, watched.stdout) == (128 + signal.SIGTERM, "")
    unwatched = subprocess.run([sys.executable, "-c", "from fibctl.flows.torchrun import end_with_launcher\n"
                                "end_with_launcher()\nprint('trained on')"], capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != LAUNCHER}, timeout=120)
    assert (unwatched.returncode, unwatched.stdout) == (0, "trained on\n")


@pytest.mark.parametrize("value", ["abc", "", "-5", "0", " 7\n"])
def test_a_launcher_pid_set_by_hand_that_is_not_a_process_id_is_one_line(value):
    """FIBCTL_LAUNCHER_PID is fibctl's own (launch_ddp sets it); one set by hand to a word was
    int()'s traceback, and a negative one or " 7\n" (which int() takes) a silent exit 143."""
    from fibctl.flows.torchrun import LAUNCHER

    started = subprocess.run([sys.executable, "-m", "fibctl.flows.torchrun", "--standalone", "-m", "fibctl"],
                             capture_output=True, text=True, env={**os.environ, LAUNCHER: value}, timeout=120)
    assert started.returncode == 2 and started.stdout == ""
    assert started.stderr.startswith(f"error: {LAUNCHER}={value!r} is not a process id")
    assert started.stderr.count("\n") == 1


def test_an_error_of_the_gradient_exchange_is_a_lost_peer_and_others_are_the_run_s():
    from fibctl.train.distributed import PeerLost, as_peer_lost, peer_failure

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5")
    assert peer_failure(gloo) and peer_failure(torch.distributed.DistBackendError("NCCL error"))
    assert "died or stopped answering" in str(as_peer_lost(gloo)) and isinstance(as_peer_lost(gloo), PeerLost)
    assert not peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not peer_failure(ValueError("connection closed"))  # only errors torch raises from a collective


def test_a_lost_peer_is_named_by_the_first_sentence_of_gloo_s_error_without_its_source_file():
    # the released event and the error line ran to 200 characters of it, cut mid-word
    from fibctl.train.distributed import as_peer_lost

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:59017. This is typically caused by a remote worker crashing. Check the logs "
                        "of the remote worker for the root cause.\nException raised from ...")
    assert str(as_peer_lost(gloo)) == ("another rank of the group died or stopped answering (Connection closed by peer "
                                       "[127.0.0.1]:59017)")
    assert str(as_peer_lost(RuntimeError(""))).endswith("(RuntimeError)")


@needs_two_cpus
def test_worker_ddp_claims_each_queued_run_once_and_trains_it_on_both_ranks(data, tmp_path):
    configs = [micro_run("a", steps=10), micro_run("b", "learned", steps=10), micro_run("c", steps=10)]
    db, runs = tmp_path / "r.db", tmp_path / "runs"
    queued_db(db, *configs).dispose()
    args = ("worker", "--ddp", "--nproc", "2", "--device", "cpu", "--db", str(db), "--data", str(data),
            "--runs-dir", str(runs), "--plain")
    done = fibctl(*args, "--max-runs", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker: 2 run(s): a done, b done" in done.stdout  # rank 0 alone reports
    q = sqlite3.connect(db).execute
    assert q("select name, status from runs order by name").fetchall() == [("a", "done"), ("b", "done"),
                                                                           ("c", "queued")]
    done = fibctl(*args, cwd=tmp_path)  # the rest of the queue, then the group ends
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker: 1 run(s): c done" in done.stdout
    rows = q("select status, attempts, device, worker from runs").fetchall()
    assert all(r[:2] == ("done", 1) and r[2].endswith("x 2 ranks") and r[3].endswith(":ddp2") for r in rows), rows
    assert q("select count(*) from events where kind = 'claimed'").fetchone() == (3,)
    # equal to one process training the learned run (theta averaged like any parameter)
    path = q("select checkpoint_path from runs where name = 'b'").fetchone()[0]
    reference, _ = one_process(configs[1], data, tmp_path / "one")
    assert_close(load_checkpoint(runs / path)["model"], reference, 1e-5)


@needs_two_cpus
def test_worker_ddp_puts_back_a_run_the_group_cannot_share_and_stops(data, tmp_path):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("odd", steps=10, grad_accum=3), micro_run("next", steps=10)).dispose()
    done = fibctl("worker", "--ddp", "--nproc", "2", "--device", "cpu", "--db", str(db), "--data", str(data),
                  "--runs-dir", str(tmp_path / "runs"), "--plain", cwd=tmp_path)
    # one line, rank 0's, exit 2 (torchrun's failure report and rank 1's own line were printed too)
    assert done.returncode == 2 and "3 micro-batches per step, which 2 processes" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    q = sqlite3.connect(db).execute
    assert q("select name, status, attempts from runs order by id").fetchall() == [("odd", "queued", 0),
                                                                                  ("next", "queued", 0)]
    assert q("select count(*) from events where kind = 'unclaimed'").fetchone() == (1,)


@needs_two_cpus
@pytest.mark.parametrize("delay", [0.5, 2.5, 5.0])  # the launcher, torchrun or the ranks importing; training
def test_ctrl_c_at_any_moment_of_a_group_s_start_exits_130_quietly_and_the_run_stays_queued(data, tmp_path, delay):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run", steps=400)).dispose()
    proc = subprocess.Popen([sys.executable, "-m", "fibctl", "worker", "--ddp", "--nproc", "2", "--device", "cpu",
                             "--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--plain"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # 130 as a shell reads it: a KeyboardInterrupt that passed through code Python compiled
    # from a string (a dataclass being defined, say) ends the process by SIGINT whatever exit
    # code fibctl gives, and Popen says -2 (fibctl.__main__ holds a Ctrl-C past the windows it can)
    assert (128 - proc.returncode if proc.returncode < 0 else proc.returncode) == 130, err[-3000:]
    assert "Traceback" not in err and " dumped" not in err, err[-3000:]
    assert sqlite3.connect(db).execute("select status from runs").fetchall() == [("queued",)]


def test_a_rank_stopped_while_it_imports_torch_ends_by_the_signal_as_torchrun_expects():
    """The ranks of a group stopped as it starts get a SIGTERM each, often while they import
    torch. fibctl's own SIGTERM handler raised SystemExit inside the import, and once a rank
    aborted from torch's C++ (exit 134, a stack dump: the Ctrl-C test above, one run in many).
    A rank has recorded nothing before its group's loop: SIGTERM's default ends it."""
    script = ("import os, signal, sys, threading, time\n"
              "from fibctl.cli import ends_through_python\n"
              "ends_through_python()  # as fibctl.cli.main does\n"
              "def stop():\n"
              "    while 'torch' not in sys.modules:\n"
              "        time.sleep(0.001)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "threading.Thread(target=stop, daemon=True).start()\n"
              "import torch\n"
              "time.sleep(60)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **TORCHRUN_ENV})
    assert done.returncode == -signal.SIGTERM and not done.stderr, (done.returncode, done.stderr[-2000:])


def test_a_group_s_exit_code_is_rank_0_s_and_a_signal_s_as_a_shell_reads_it():
    from fibctl.flows.torchrun import exit_code
    from fibctl.flows.worker import stopped_code

    assert exit_code({0: 2, 1: 2}) == 2 and exit_code({1: 1, 0: 2}) == 2 and exit_code({3: 1, 1: -9}) == 137
    # a failed run: rank 1 exited 1 first, and torchrun's SIGTERM caught rank 0 as it exited
    assert exit_code({0: -signal.SIGTERM, 1: 1}) == 1 and exit_code({0: -signal.SIGTERM}) == 128 + signal.SIGTERM
    assert stopped_code([-signal.SIGTERM], [signal.SIGINT]) == 130  # torchrun ended before its handler was set
    assert stopped_code([-signal.SIGKILL], []) == 128 + signal.SIGKILL


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.mark.parametrize("args, env, words", [
    (["--ddp"], {}, "--ddp on the CPU (gloo): give the process count with --nproc N"),
    (["--ddp", "--nproc", str((os.cpu_count() or 1) + 1)], {}, "CPUs (gloo: one process per CPU)"),
    (["--nproc", "2"], {}, "--nproc goes with --ddp"),
    (["--ddp", "--gpus", "all"], {}, "--ddp and --gpus: choose one"),
    (["--ddp", "--nproc", "1"], {"RANK": "0", "WORLD_SIZE": "2"},
     "torchrun's environment is incomplete (LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set)"),
    ([], TORCHRUN_ENV, "fibctl worker under torchrun: add --ddp"),
    (["--ddp", "--nproc", "2"], TORCHRUN_ENV, "--nproc under torchrun"),
    # a rank started by hand: int('abc') and a world of 0 were tracebacks, rank 2 of 2 waited for its group
    *[(["--ddp"], {**TORCHRUN_ENV, name: value}, f"{name}={value!r}") for name, value in
      (("RANK", "abc"), ("WORLD_SIZE", "0"), ("RANK", "2"), ("LOCAL_RANK", "-1"),
       ("MASTER_PORT", "notaport"), ("MASTER_PORT", "70000"))],  # the port's were torch's ValueError
    (["--ddp", "--nproc", "1", "--compile"], {"CXX": "/no-such-g++"}, "--compile: torch.compile cannot run on cpu"),
])
def test_worker_ddp_bad_input_is_one_line_exit_2_and_the_runs_stay_queued(data, tmp_path, monkeypatch, capsys, args,
                                                                         env, words):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    worker = ["worker", *args, "--db", str(db), "--data", str(data), "--device", "cpu", "--runs-dir",
              str(tmp_path / "runs")]
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    if not env:  # options alone: fibctl's main in this process
        monkeypatch.chdir(tmp_path)
        assert words in refused(monkeypatch, capsys, *worker)
    else:  # a process started with this environment (a regression here must not join a group in pytest's)
        done = subprocess.run([sys.executable, "-m", "fibctl", *worker], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, **env}, timeout=300)
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert sqlite3.connect(db).execute("select status, attempts from runs").fetchall() == [("queued", 0)]


def test_train_nproc_with_compile_and_no_compiler_is_one_line_before_torchrun(data, tmp_path):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    done = subprocess.run([sys.executable, "-m", "fibctl", "train", "run", "--nproc", "1", "--compile", "--db",
                           str(db), "--data", str(data), "--device", "cpu", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "CXX": str(tmp_path / "no-such-g++")}, timeout=300)
    assert done.returncode == 2 and "--compile: torch.compile cannot run on cpu" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "torchrun" not in done.stderr.lower()
    assert sqlite3.connect(db).execute("select status, attempts from runs").fetchall() == [("queued", 0)]


class RankOneOfTwo:
    """A rank other than 0 whose collectives are scripted, for the moments of a race that a real
    group reaches only by chance. It computes every micro-batch, so `sum` is the identity."""

    rank, world, main = 1, 1, False

    def __init__(self, diverged_at: int | None = None):
        self.diverged_at, self.votes = diverged_at, 0

    def micro_batches(self, grad_accum):
        return range(grad_accum)

    def sum(self, t):
        return t

    def broadcast(self, obj):
        return obj

    def any(self, *flags, device):
        if len(flags) == 3:  # the end of a step: lost, stopping, unscored
            self.votes += 1
            return [flags[0], flags[1], flags[2] or self.votes == self.diverged_at]
        return list(flags)


def scripted_rank(config, data, run_dir, group) -> Trainer:
    """A trainer built as one process (no DDP wrapper to join a group), then made `group`'s rank."""
    from train_helpers import NullReporter

    trainer = Trainer(config, load_manifest(data), run_dir, NullReporter())
    trainer.group, trainer.main = group, group.main
    return trainer


def test_a_rank_told_that_rank_0_s_held_out_loss_was_not_finite_stops_at_that_step_as_diverged(data, tmp_path):
    """Rank 0 alone evaluates: the others learn of a NaN held-out loss only from the vote."""
    trainer = scripted_rank(micro_run("run", steps=6), data, tmp_path / "runs" / "run", RankOneOfTwo(diverged_at=3))
    result = trainer.run()
    assert (result.status, result.step, result.error) == ("diverged", 2, "step 3 gave a held-out loss that is not finite")


def test_a_rank_finding_a_checkpoint_that_rank_0_moved_aside_resumes_from_the_one_before(data, tmp_path, monkeypatch):
    """Rank 0 found step 4 damaged and moved it aside while this rank was opening it: this rank
    resumes from step 2, as rank 0 does, instead of failing on a file that is gone."""
    from fibctl.train import checkpoint as ckpt

    run_dir = tmp_path / "runs" / "run"
    config = micro_run("run", steps=4, checkpoint_interval=2)
    assert Trainer(config, load_manifest(data), run_dir, Losses()).run().status == "done"
    load = ckpt.load_checkpoint

    def moved_aside_meanwhile(path):
        if path.name == "step_00000004.pt":
            ckpt.set_aside(path)
        return load(path)

    monkeypatch.setattr(ckpt, "load_checkpoint", moved_aside_meanwhile)
    trainer = scripted_rank(config, data, run_dir, RankOneOfTwo())
    assert (trainer.resume(), trainer.step) == (run_dir / "step_00000002.pt", 2)
    # rank 0 itself, or one process, that cannot open a checkpoint which is there is stopped
    trainer = Trainer(config, load_manifest(data), run_dir, Losses())

    def unsafe(path):
        raise FibctlError(f"checkpoint {path} was refused")

    monkeypatch.setattr(ckpt, "load_checkpoint", unsafe)
    with pytest.raises(FibctlError, match="refused"):
        trainer.resume()


def test_a_gradient_exchange_failing_in_a_step_is_a_lost_peer_and_one_process_s_error_stays_its_own(
        data, tmp_path, monkeypatch):
    from fibctl.train.distributed import PeerLost

    def exchange_failed():
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer")

    trainer = scripted_rank(micro_run("run", steps=4), data, tmp_path / "a", RankOneOfTwo())
    monkeypatch.setattr(trainer, "train_step", exchange_failed)
    with pytest.raises(PeerLost, match="died or stopped answering"):
        trainer.run()
    alone = Trainer(micro_run("run", steps=4), load_manifest(data), tmp_path / "b", Losses())
    monkeypatch.setattr(alone, "train_step", exchange_failed)
    with pytest.raises(RuntimeError, match="Connection closed"):
        alone.run()


class _RankZero:
    """Rank 0 of a group whose other rank dies as rank 0 sends it the run it claimed: a rank
    still starting when the launcher stopped the group (SIGTERM's default ended it)."""

    rank, world, local_rank, main = 0, 2, 0, True

    def __init__(self, mark: Path | None):
        self.mark = mark  # the launcher's: the group is being stopped

    def broadcast(self, obj):
        if isinstance(obj, dict):  # the run to train
            if self.mark:
                self.mark.touch()
            raise PeerLost("another rank of the group died or stopped answering (Connection reset by peer)")
        return obj

    def any(self, *flags, device):
        return list(flags)

    def close(self):
        pass


@pytest.mark.parametrize("signalled", [True, False])
def test_a_rank_the_group_s_stop_ended_first_is_the_stop_not_a_failure(data, tmp_path, monkeypatch, signalled):
    """Ctrl-C as a group starts: the launcher sends every rank a SIGTERM, and a rank still
    starting dies of it before rank 0 handles its own. Rank 0 read that death as a failure
    (exit 2, the claimed run left running until its heartbeat was stale); the launcher marks
    the stop first, and it is the stop. A rank that dies alone (torchrun's SIGTERM follows)
    is still a failure; either way the run goes back to the queue at once."""
    import threading

    from fibctl.db.engine import connect
    from fibctl.flows import worker
    from train_helpers import Quiet

    from fibctl.flows.torchrun import STOP_MARK

    stop = threading.Event()  # this rank's own SIGTERM not handled yet
    monkeypatch.setenv(STOP_MARK, str(tmp_path / "stopping"))
    group = _RankZero(tmp_path / "stopping" if signalled else None)
    monkeypatch.setattr(worker, "join", lambda *a: (group, torch.device("cpu")))
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    opts = worker.WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs", device="cpu")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # a rank keeps its own
    try:
        if signalled:
            assert worker.work_distributed(lambda: connect(str(db)), opts, Quiet(), stop) == []
        else:
            with pytest.raises(PeerLost):
                worker.work_distributed(lambda: connect(str(db)), opts, Quiet(), stop)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert sqlite3.connect(db).execute("select status from runs").fetchall() == [("queued",)]


def _rank_measuring_its_own_fastest_path(rank: int, port: int, data: Path, run_dir: Path, out: Path) -> None:
    """A rank of a 2-rank gloo group whose `auto` measures another path fastest than the other
    rank's (rank 0: mask, rank 1: gather), as two GPUs' timings may; it notes the path each of
    its training forwards ran."""
    import json

    from fibctl import attention
    from fibctl.train import trainer as trainer_module
    from fibctl.train.distributed import join
    from train_helpers import NullReporter

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    fastest = "mask" if rank == 0 else "gather"
    attention._measure = lambda impl, *a: 0.0 if impl == fastest else 1.0
    trainer_module.default_impl = lambda device: "auto"  # the CUDA default, here on the CPU
    ran = []
    for impl in ("_gather", "_masked"):
        def noted(*a, _impl=impl, _real=getattr(attention, impl)):
            if torch.is_grad_enabled():  # a training forward (rank 0's evaluations run without grad)
                ran.append(_impl)
            return _real(*a)
        setattr(attention, impl, noted)
    group, device = join("cpu", 1, 60)
    try:
        result = Trainer(micro_run("run", "stagger", steps=3), load_manifest(data), run_dir, NullReporter(),
                         device=device, group=group).run()
        (out / f"rank{rank}.json").write_text(json.dumps({"status": result.status, "ran": sorted(set(ran))}))
    finally:
        group.close()


@needs_two_cpus
def test_every_rank_takes_rank_0_s_choice_of_attention_path_where_their_measurements_disagree(data, tmp_path):
    """On CUDA each rank measured `auto` alone: ranks could train on different paths, their
    timings and records disagreeing. Rank 0's choice is the group's."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(_rank_measuring_its_own_fastest_path, args=(port, data, tmp_path / "run", tmp_path), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"status": "done", "ran": ["_masked"]}
