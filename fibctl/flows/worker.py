"""Workers: claim queued runs and train them, one process per GPU.

A worker claims a run (fibctl.queue), trains it with `Trainer`, records the outcome on the
run's row and claims the next, until the queue is empty, `max_runs` is reached or it is
asked to stop. A stop request (SIGTERM, Ctrl-C) finishes the step in progress, writes a
checkpoint and returns the run to the queue; a second one aborts at once, without a
checkpoint, and returns the run to the queue too (where the database cannot be reached, a
later claim takes it back once its heartbeat is stale); it resumes from its last
checkpoint. A `StopRequest` remembers the signal, for the command's exit code (128 + its
number). A diverged run (NaN or infinite loss) or one that raises is marked failed and the
worker moves on.

A failure that is the worker's, not the run's (`WorkerError`: data that does not fit, a runs
folder without the run's checkpoint, with another run's or with one the database does not
account for, a database that keeps refusing writes), puts the run back in the queue and
stops the worker with that one line: one wrong option must not fail a whole queue. The
data and runs folder are checked before any claim, and the data again against each claimed
run (its windows, its held-out sets) before anything of it is written; a run claimed by name
is checked before the claim.

One run can also span several processes (`train_distributed`, under torchrun; `launch_ddp`
starts torchrun): rank 0 claims the run and does everything the single process does with
the database and checkpoints, the other ranks only train (fibctl.train.distributed). When a
rank dies, the others stop and rank 0 puts the run back in the queue. `work_distributed` is
the worker loop of such a group: rank 0 claims queued runs one after another.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from fibctl import queue
from fibctl.data.streams import DataManifest, load_manifest
from fibctl.db.store import DatabaseUnavailable, RunRecorder
from fibctl.errors import FibctlError, WorkerError, shown_path
from fibctl.flops import peak_flops
from fibctl.flows.removal import aside_hint, settle_aside
from fibctl.matrix import queue_again
from fibctl.names import check_name
from fibctl.provenance import provenance
from fibctl.config import RunConfig
from fibctl.train import checkpoint as ckpt
from fibctl.train import loggers
from fibctl.train.distributed import Group, PeerLost, Silent, as_peer_lost, check_split, join, peer_failure
from fibctl.device import check_compile, describe, resolve_device, setup_process
from fibctl.flows.torchrun import in_slurm_job, start_group, stop_group, stop_marked
from fibctl.probe.trainer import ProbeTrainer
from fibctl.train.trainer import Progress, Recorded, Trainer, TrainResult, check_data, no_checkpoint_loads


@dataclass
class Outcome:
    name: str
    status: str  # done | failed | released | lost (cancelled, taken over or removed meanwhile, or
    #              given up where the database could not be reached to put it back)
    step: int | None  # None: it failed while starting (building the model, resuming), before any step
    error: str | None = None
    checkpoint: Path | None = None
    hint: str | None = None  # what to do next, for the user: a diverged run's way on

    @property
    def at(self) -> str:
        return "while starting" if self.step is None else f"at step {self.step}"


class Display(Protocol):
    """How a worker shows a run: `start` returns the per-step callback, `finish` the outcome."""

    def start(self, name: str, steps: int) -> Callable[[Progress], None]: ...

    def warn(self, message: str) -> None: ...  # one line, e.g. a deviation from the run's recipe

    def note(self, message: str) -> None: ...  # one line of what happened, e.g. where the run resumed

    def finish(self, outcome: Outcome) -> None: ...


@dataclass
class WorkerOptions:
    data_dir: Path
    runs_dir: Path
    device: str | None = None  # auto: CUDA if present, else CPU
    threads: int | None = None  # CPU intra-op threads; default 1 on CPU
    heartbeat_timeout_s: float = 600
    max_attempts: int = 3
    max_runs: int | None = None
    log_to: tuple[str, ...] = ()  # metric back-ends beside the database (fibctl.train.loggers)
    compile: bool = False  # training steps through torch.compile


def worker_name(device: torch.device) -> str:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES") if device.type == "cuda" else None
    return f"{socket.gethostname()}:{os.getpid()}" + (f":gpu{gpu}" if gpu else "")


def check_environment(opts: WorkerOptions, device: torch.device) -> DataManifest | None:
    """Refuse, before claiming anything, a data folder whose manifest or streams are unusable
    or a runs folder that cannot be written, a --log-to back-end that is not installed, or
    --compile where torch.compile cannot run, or a FIBCTL_PEAK_TFLOPS that is not a number: such
    a worker would fail every run it claims.
    A data folder that does not exist is no data: the worker trains probe runs (they make
    their own) and puts back, with one line, the first run that needs text."""
    loggers.check_loggers(opts.log_to)
    peak_flops(device)  # FIBCTL_PEAK_TFLOPS, if set, is a number
    if opts.compile:
        try:
            check_compile(device)
        except FibctlError as e:
            raise WorkerError(str(e)) from None
    manifest = None  # no folder: probe runs make their own data; a run that needs text says so
    if opts.data_dir.exists():
        try:
            manifest = load_manifest(opts.data_dir)  # read once: every run this worker trains uses it
            for split in manifest.splits:
                manifest.stream(split)
        except FibctlError as e:
            raise WorkerError(str(e)) from None
    try:  # where it will be made: a run refused after this check leaves no folder behind
        made = next(p for p in (opts.runs_dir, *opts.runs_dir.parents) if p.exists())
        tempfile.TemporaryFile(dir=made).close()
    except OSError as e:
        raise WorkerError(f"--runs-dir {shown_path(opts.runs_dir)} cannot hold checkpoints: "
                          f"{e.strerror or e}") from None
    return manifest


class StopRequest(threading.Event):
    """A stop event that remembers the signal that set it (None: not set by a signal), so
    that the command can exit with 128 + its number, as a shell or SLURM expects of a
    process a signal ended."""

    def __init__(self):
        super().__init__()
        self.signal: int | None = None


@contextmanager
def stop_on_signals(stop: threading.Event, *, rank: bool = False):
    """SIGINT/SIGTERM set `stop` (graceful); a second one raises KeyboardInterrupt.

    A torchrun `rank` keeps noting them after the loop: torchrun sends SIGTERM to the group
    when one rank ends, and rank 0, its loop over, is then only reporting (the one line saying
    why the run is queued again), which the default handler would cut short.

    A rank of a SLURM job's group takes every SIGTERM for one stop: scancel's reaches each
    process of a task (proctrack/linuxproc, cgroup), so the rank has it from SLURM, from its
    task and from torchrun at once, and SLURM itself forces the end (SIGKILL, KillWait later)."""
    repeated = rank and in_slurm_job()

    def handler(signum, _frame):
        if stop.is_set():
            if repeated and signum == signal.SIGTERM:
                return
            raise KeyboardInterrupt
        if isinstance(stop, StopRequest):
            stop.signal = signum
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, _noted(stop) if rank else h)


def _noted(stop: threading.Event):
    def note(signum, _frame):  # the process is on its way out: it exits once it has reported
        stop.set()
    return note


def work(engine: Engine, opts: WorkerOptions, display: Display,
         stop: threading.Event | None = None) -> list[Outcome]:
    """Claim and train runs until none is queued, `max_runs` were trained, or `stop` is set."""
    stop = stop or threading.Event()
    device = setup_process(opts.device, opts.threads)
    manifest = check_environment(opts, device)
    name = worker_name(device)
    outcomes: list[Outcome] = []
    trained = 0  # what --max-runs counts: runs failed as they were claimed never trained
    with stop_on_signals(stop):
        while not stop.is_set() and (opts.max_runs is None or trained < opts.max_runs):
            claimed = queue.claim_next(engine, name, socket.gethostname(), describe(device),
                                       opts.heartbeat_timeout_s, opts.max_attempts,
                                       on_failed=_failed_at_claim(display, outcomes))
            if claimed is None:
                break
            outcomes.append(train_claimed(engine, claimed, opts, manifest, device, name, display, stop))
            trained += 1
    return outcomes


def _failed_at_claim(display: Display, outcomes: list[Outcome]) -> Callable[[str, str], None]:
    """claim_next's `on_failed`: a run failed as it was claimed (its stored config damaged) is
    one of the worker's outcomes, shown and summed up like a run that failed in training."""
    def failed(name: str, error: str) -> None:
        outcome = Outcome(name, "failed", None, error)
        display.finish(outcome)
        outcomes.append(outcome)
    return failed


def train_named(engine: Engine, run_name: str, opts: WorkerOptions, display: Display,
                stop: threading.Event | None = None) -> Outcome:
    """Train one run by name: queued, failed, cancelled or abandoned runs are (re)claimed."""
    stop = stop or threading.Event()
    device = setup_process(opts.device, opts.threads)
    manifest = check_environment(opts, device)
    name = worker_name(device)
    with stop_on_signals(stop):
        claimed = queue.claim_named(engine, run_name, name, socket.gethostname(), describe(device),
                              opts.heartbeat_timeout_s,
                              check=lambda cfg: check_data(cfg, manifest, opts.data_dir))
        return train_claimed(engine, claimed, opts, manifest, device, name, display, stop)


COLLECTIVE_TIMEOUT_S = 300  # at least: rank 0 evaluates while the others wait
END = "end"  # rank 0 to the others: nothing more to train


def train_distributed(connect: Callable[[], Engine], run_name: str, opts: WorkerOptions, display: Display,
                      stop: threading.Event | None = None) -> Outcome:
    """This process's part of one run trained by a torchrun group (`launched()` is true).
    Rank 0 connects to the database (`connect`), claims the run, tells the others what to
    train or that there is nothing to; every rank trains its share of each step."""
    def claim(engine: Engine, worker: str, describe_as: str, manifest: DataManifest, world: int):
        return queue.claim_named(engine, run_name, worker, socket.gethostname(), describe_as,
                                 opts.heartbeat_timeout_s,
                                 check=lambda cfg: check_group_run(cfg, manifest, world, opts.data_dir))

    return _distributed(connect, claim, dataclasses.replace(opts, max_runs=1), display, stop)[0]


def work_distributed(connect: Callable[[], Engine], opts: WorkerOptions, display: Display,
                     stop: threading.Event | None = None) -> list[Outcome]:
    """`fibctl worker --ddp` in one rank of a torchrun group: rank 0 claims queued runs one at a
    time, as `work` does, and the whole group trains each, until none is queued, `max_runs`
    were trained or a rank is asked to stop. A claimed run whose grad_accum the group cannot
    share, or whose data does not fit, goes back to the queue and stops the group (WorkerError)."""
    failed: list[Outcome] = []

    def claim(engine: Engine, worker: str, describe_as: str, manifest: DataManifest, world: int):
        claimed = queue.claim_next(engine, worker, socket.gethostname(), describe_as,
                                   opts.heartbeat_timeout_s, opts.max_attempts,
                                   on_failed=_failed_at_claim(display, failed))
        if claimed is not None:
            try:
                check_group_run(claimed.config, manifest, world, opts.data_dir)
            except FibctlError as e:
                queue.unclaim(engine, claimed.id, str(e))
                raise WorkerError(f"{e}; it is queued again") from None
        return claimed

    trained = _distributed(connect, claim, opts, display, stop)
    return failed + trained  # rank 0's: the other ranks claim nothing


def check_group_run(config: RunConfig, manifest: DataManifest | None, world: int,
                    data_dir: Path | None = None) -> None:
    """A run a group of `world` processes can train: not a probe run (those train in one
    process), data that fits, and grad_accum micro-batches the ranks can share."""
    if config.probe is not None:
        raise WorkerError(f"run {config.name!r} is a probe run: it trains in one process "
                          "(fibctl worker, or fibctl train without --nproc)")
    check_data(config, manifest, data_dir)
    check_split(config.train.grad_accum, world, config.name)


def _distributed(connect: Callable[[], Engine], claim: Callable, opts: WorkerOptions, display: Display,
                 stop: threading.Event | None) -> list[Outcome]:
    """Join the group; then, per run, rank 0 claims it (`claim`) and broadcasts what to train
    (or END, or None when it failed: its own error says why), and every rank trains it. The
    ranks agree after each run whether any of them was asked to stop."""
    stop = stop or threading.Event()
    # a rank silent for longer than a heartbeat would leave the run abandoned: the others stop
    # (a rank that dies closes its connections, and the others stop at once)
    group, device = join(opts.device, opts.threads, max(opts.heartbeat_timeout_s, COLLECTIVE_TIMEOUT_S))
    outcomes: list[Outcome] = []
    lead = _Lead(connect, claim, opts, display, stop, group, device) if group.main else None
    try:
        with stop_on_signals(stop, rank=True):
            while opts.max_runs is None or len(outcomes) < opts.max_runs:
                try:
                    if outcomes and group.any(stop.is_set(), device=device)[0]:
                        break
                    outcome = lead.next() if lead else _follow(opts, stop, group, device)
                except PeerLost:
                    if stopped_with_the_group(stop):  # what the stop asked for, not a failure
                        break
                    raise
                if outcome is None:
                    break
                outcomes.append(outcome)
    finally:
        group.close()
    return outcomes


class _Lead:
    """Rank 0: the database, the claims and everything the single process records."""

    def __init__(self, connect, claim, opts: WorkerOptions, display: Display, stop: threading.Event,
                 group: Group, device: torch.device):
        self.connect, self.claim, self.opts, self.display, self.stop = connect, claim, opts, display, stop
        self.group, self.device = group, device
        self.name = f"{worker_name(device)}:ddp{group.world}"
        self.engine: Engine | None = None
        self.manifest: DataManifest | None = None

    def next(self) -> Outcome | None:
        try:
            if self.engine is None:  # once: the data and runs folder are checked before any claim
                self.engine = self.connect()
                self.manifest = check_environment(self.opts, self.device)
            claimed = self.claim(self.engine, self.name, _describe(self.device, self.group), self.manifest,
                                 self.group.world)
        except FibctlError:
            self.group.broadcast(None)
            raise
        if claimed is None:
            self.group.broadcast(END)
            return None
        try:
            run_dir = _run_dir(self.engine, claimed, self.opts)
            recorded = _recorded(self.engine, claimed)
        except FibctlError as e:  # the worker's fault: back to the queue; the run's: it fails
            if isinstance(e, WorkerError):
                queue.unclaim(self.engine, claimed.id, str(e))
            else:
                queue.fail(self.engine, claimed.id, str(e), self.name)
            self.group.broadcast(None)
            raise
        try:
            self.group.broadcast({"config": claimed.config.to_dict(), "run_dir": str(run_dir),
                                  "recorded": dataclasses.asdict(recorded)})
        except PeerLost as e:  # claimed, never trained: back to the queue now, not at a stale heartbeat
            queue.release(self.engine, claimed.id, f"released while starting: {e}", self.name)
            raise
        return train_claimed(self.engine, claimed, self.opts, self.manifest, self.device, self.name,
                             self.display, self.stop, self.group, recorded)


RANK_0_EXIT_S = 60  # at most, for a rank 0 that has closed the group to exit


def stopped_with_the_group(stop: threading.Event) -> bool:
    """Whether another rank's death is the group being stopped: its launcher marked the stop
    before signalling the ranks (a rank still starting dies of its SIGTERM, before this rank
    handles its own). Then this rank stops as asked too."""
    if stop_marked():
        stop.set()
        return True
    return False


def _follow(opts: WorkerOptions, stop: threading.Event, group: Group, device: torch.device) -> Outcome | None:
    """A rank other than 0: train what rank 0 says, report nothing."""
    task = group.broadcast(None)
    if task is None:  # rank 0 did not start the run: its own error line says why
        # End after rank 0 does: a rank ending first makes torchrun stop rank 0, perhaps before
        # its line (or as it exits: a SIGTERM then kills it) and report this rank's code. Rank 0
        # closing the group ends this broadcast; torchrun's SIGTERM once rank 0 has ended, the wait.
        with suppress(PeerLost):
            group.broadcast(None)
        stop.wait(RANK_0_EXIT_S)
        raise SystemExit(2)
    if task == END:
        return None
    config = RunConfig.from_dict(task["config"])
    trainer = None
    try:
        trainer = Trainer(config, load_manifest(opts.data_dir), Path(task["run_dir"]), Silent(),
                          device=device, stop=stop, compile=opts.compile, group=group)
        trainer.recorded = Recorded(**task["recorded"])  # rank 0's: every rank refuses the same checkpoints
        result = trainer.run()
    except Exception as e:
        if peer_failure(e) or isinstance(e, WorkerError):  # as rank 0 does (train_claimed)
            raise
        # the run's own error: rank 0 meets it too, marks the run failed and claims the next
        return Outcome(config.name, "failed", trainer.step if trainer else None, _error_line(e))
    status = {"stopped": "released", "diverged": "failed"}.get(result.status, result.status)
    return Outcome(config.name, status, result.step, result.error, result.checkpoint)


def _describe(device: torch.device, group: Group | None) -> str:
    """What `runs.device` records: `cpu (1 threads)`, or `cpu (1 threads) x 2 ranks`."""
    return describe(device) + (f" x {group.world} ranks" if group is not None else "")


def check_nproc(nproc: int | None, device: str | None) -> int:
    """N processes fit the machine (None: every CUDA device; on the CPU it must be given)."""
    resolved = resolve_device(device)
    available = torch.cuda.device_count() if resolved.type == "cuda" else (os.cpu_count() or 1)
    what = "CUDA devices" if resolved.type == "cuda" else "CPUs (gloo: one process per CPU)"
    if nproc is None:
        if resolved.type != "cuda":
            raise FibctlError("--ddp on the CPU (gloo): give the process count with --nproc N")
        nproc = available
    if nproc < 1:
        raise FibctlError(f"--nproc {nproc} must be >= 1")
    if nproc > available:
        raise FibctlError(f"--nproc {nproc}: this machine has {available} {what}")
    return nproc


def check_launch(opts: WorkerOptions, nproc: int | None) -> int:
    """Before torchrun starts N processes: N fits, and the data, runs folder, --log-to and
    --compile are usable here (each refusal one line, nothing claimed; found by the ranks
    instead, each would fail alike with its own lines through torchrun). Returns N."""
    nproc = check_nproc(nproc, opts.device)
    check_environment(opts, resolve_device(opts.device))
    return nproc


def check_ddp(engine: Engine, run_name: str, nproc: int, opts: WorkerOptions) -> None:
    """`check_launch` for one run: N divides the run's grad_accum, and the data fits the run."""
    config = queue.run_config(engine, run_name)
    if config.probe is not None:
        raise FibctlError(f"run {run_name!r} is a probe run: it trains in one process; drop --nproc")
    check_split(config.train.grad_accum, check_nproc(nproc, opts.device), run_name)
    check_data(config, check_environment(opts, resolve_device(opts.device)), opts.data_dir)


def launch_ddp(nproc: int, fibctl_args: list[str], env: dict[str, str] | None = None) -> int:
    """`torchrun --standalone --nproc-per-node N -m fibctl train ...` (or `worker --ddp ...`:
    `fibctl_args`), in its own session; its exit code. SIGINT/SIGTERM here go to every rank as
    SIGTERM (each finishes the step, rank 0 checkpoints and requeues the run, and torchrun ends
    with them); where the ranks cannot be listed (no /proc), to torchrun, which stops them the
    same way but reports the signal. After a stop request that every rank obeyed, the exit code
    is 128 + the signal received (130 after Ctrl-C, 143 after SIGTERM)."""
    marks = tempfile.TemporaryDirectory(prefix="fibctl-group-")
    mark = os.path.join(marks.name, "stopping")
    child = start_group(["--standalone", f"--nproc-per-node={nproc}"], fibctl_args, mark, env)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        stop_group(child, mark)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return stopped_code([child.wait()], received)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        marks.cleanup()


def train_claimed(engine: Engine, claimed: queue.ClaimedRun, opts: WorkerOptions, manifest: DataManifest,
                  device: torch.device, worker: str, display: Display, stop: threading.Event,
                  group: Group | None = None, recorded: Recorded | None = None) -> Outcome:
    recorder: RunRecorder | loggers.Tee = RunRecorder(engine, claimed.id, worker)
    trainer, tee = None, None
    try:
        # data that cannot train or evaluate this run is the worker's fault: back to the queue
        # (WorkerError below) before a logger or checkpoint writes anything of it
        data = check_data(claimed.config, manifest, opts.data_dir)
        run_dir = _run_dir(engine, claimed, opts)
        recorded = recorded or _recorded(engine, claimed)
        if opts.log_to:  # copies of the metrics beside the database, under the run's folder
            tee = recorder = loggers.Tee(recorder, loggers.open_sinks(opts.log_to, run_dir, claimed.name,
                                                                      claimed.config.to_dict(),
                                                                      data.heldout if data else ()),
                                         light_tokens=claimed.config.train.eval_tokens)
        on_checkpoint = lambda result: _record(recorder, opts, claimed.name, result)  # noqa: E731
        if claimed.config.probe is not None:  # trains in one process, eagerly (its width changes every step)
            if opts.compile:
                display.warn(f"{claimed.name}: a probe run trains eagerly; --compile does not apply")
            trainer = ProbeTrainer(claimed.config, run_dir, recorder, device=device, stop=stop,
                                   on_checkpoint=on_checkpoint)
        else:
            trainer = Trainer(claimed.config, data, run_dir, recorder, device=device, stop=stop,
                              on_checkpoint=on_checkpoint, compile=opts.compile, group=group)
        trainer.recorded = recorded  # a checkpoint ahead of it is refused (WorkerError: back to the queue)
        if group is None:
            trainer.recount = lambda: _recorded(engine, claimed)
        counts = trainer.model.param_counts()
        recorder.update_run(device=_describe(device, group),
                            **provenance(manifest) | {"data_hash": trainer.data_hash},
                            params_total=counts["total"], params_non_embedding=counts["non_embedding"],
                            optimizer=trainer.optimizer_name, runs_dir=str(opts.runs_dir.resolve()))
        if trainer.optimizer_warning:
            display.warn(f"{claimed.name}: {trainer.optimizer_warning}")
        trainer.on_warning = lambda message: display.warn(f"{claimed.name}: {message}")
        trainer.on_resumed = lambda step, path: display.note(f"{claimed.name}: resumed from step {step} ({shown_path(path)})")
        if isinstance(trainer, Trainer):  # a probe run draws no windows: no sampler recorded
            trainer.on_sampler = lambda kind: recorder.update_run(sampler=kind)
        trainer.on_progress = display.start(claimed.name, claimed.config.train.steps)
        outcome = _settle(engine, claimed, recorder, opts, trainer.run(), worker)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, without the checkpoint the first one asked for
        step = trainer.step if trainer else None
        at = "while starting" if step is None else f"at step {step}"
        try:  # back to the queue now, rather than running until its heartbeat is stale
            queue.release(engine, claimed.id, f"aborted {at} by a second signal; it resumes from its "
                          "last checkpoint", worker)
            display.finish(Outcome(claimed.name, "released", step, "aborted; it resumes from its last checkpoint"))
        except Exception:  # noqa: BLE001 (the database may be why the user pressed it twice: the heartbeat hands it on)
            pass
        raise
    except DatabaseUnavailable as e:
        error, released = _requeue_after_database_failure(engine, claimed, trainer, e, worker)
        # the progress display ends here; the error the worker stops with says why
        display.finish(Outcome(claimed.name, "released", trainer.step if trainer else None) if released else
                       Outcome(claimed.name, "lost", trainer.step if trainer else None, UNRELEASED))
        raise error from None
    except WorkerError as e:
        queue.unclaim(engine, claimed.id, str(e), worker)
        raise
    except Exception as e:  # a run that raises must not take the worker down with it
        step = trainer.step if trainer else None  # None: resuming or building it failed
        at = "while starting" if step is None else f"at step {step}"
        if group is not None and peer_failure(e):  # not the run's fault: back to the queue
            lost = as_peer_lost(e)
            if stopped_with_the_group(stop):  # a rank the group's stop ended first
                queue.release(engine, claimed.id, f"released {at}: stopped by a signal", worker)
                outcome = Outcome(claimed.name, "released", step, "stopped; it resumes from its last checkpoint")
                display.finish(outcome)
                return outcome
            queue.release(engine, claimed.id, f"released {at}: {lost}", worker)
            display.finish(Outcome(claimed.name, "released", step))
            raise FibctlError(f"run {claimed.name!r}: {lost}; it is queued again") from None
        if isinstance(e, IntegrityError) and queue.removed(engine, claimed.id):  # nothing left to record
            outcome = Outcome(claimed.name, "lost", step, "the run was removed from the database")
        elif queue.fail(engine, claimed.id, f"{at}: {_error_text(e)}", worker):
            outcome = Outcome(claimed.name, "failed", step, _error_line(e))
        else:  # cancelled or taken over meanwhile: the row is no longer ours to fail
            outcome = Outcome(claimed.name, "lost", step, _error_line(e))
    finally:
        if tee is not None:
            tee.close()
    display.finish(outcome)
    return outcome


def _run_dir(engine: Engine, claimed: queue.ClaimedRun, opts: WorkerOptions) -> Path:
    """The run's checkpoint folder: its own under --runs-dir, the only one it trains in (a
    path an older fibctl recorded elsewhere is refused). A recorded checkpoint that is not
    there is the runs folder's fault, unless the folder holds an older one: training from
    step 0 instead would silently discard the run's progress."""
    check_name("run", claimed.name)
    own = opts.runs_dir / claimed.name
    # a `queue rm --checkpoints` killed before its commit moved the run's own folder aside;
    # one killed after it left a removed run's (this name queued again), its rows gone
    owned = bool(claimed.checkpoint_path) or queue.claimed_before(engine, claimed.id)
    try:
        settle_aside(opts.runs_dir, claimed.name, owned)
    except FibctlError as e:  # the runs folder's fault, not the run's: back to the queue
        raise WorkerError(str(e)) from None
    _refuse_link(own)
    if not claimed.checkpoint_path:
        left = ckpt.latest_checkpoint(own)
        # only an earlier attempt of this row (killed before it recorded its checkpoint) may
        # have left it: otherwise it is a removed run's or another database's, and resuming
        # from it would mark the run trained with none of its steps or evaluations recorded
        if left is not None and not queue.claimed_before(engine, claimed.id):
            raise WorkerError(f"run {claimed.name!r} has no checkpoint in the database, but {shown_path(left)} exists "
                              f"(a run of that name removed and queued again, or another database's): "
                              f"move {shown_path(own)} away to train the run from step 0")
        # one an earlier attempt wrote but did not record may be in a folder a `queue rm` moved
        # aside and settle_aside left: training from step 0 would leave it behind, unseen
        if left is None and owned and (hint := aside_hint(opts.runs_dir, claimed.name)):
            raise WorkerError(f"run {claimed.name!r} has no checkpoint in {shown_path(own)}: {hint}")
        return own
    path = ckpt.resolve_path(claimed.checkpoint_path, opts.runs_dir, claimed.name)  # in `own`, or refused
    # one moved aside (or deleted) as damaged: the run resumes from the newest left in its folder
    if not path.is_file() and ckpt.latest_checkpoint(path.parent) is None:
        if any(path.parent.glob(f"step_*.pt{ckpt.DAMAGED}")):  # the run's fault, not the folder's: it fails
            raise FibctlError(no_checkpoint_loads(claimed.name, f"the checkpoints in {shown_path(path.parent)} were "
                                                                "damaged"))
        hint = aside_hint(opts.runs_dir, claimed.name, claimed.checkpoint_path)
        raise WorkerError(f"run {claimed.name!r} has checkpoint {shown_path(claimed.checkpoint_path)}, but "
                          f"{shown_path(path)} does not exist: {hint or 'give the --runs-dir it was trained with'}")
    return own


def _recorded(engine: Engine, claimed: queue.ClaimedRun) -> Recorded:
    """What the database holds of the run: the trainer resumes from no checkpoint ahead of it
    (one written before a `queue retry --from-start`, or past the rows a database restored
    from an older copy holds), which would finish the run with its history missing."""
    return Recorded(*queue.recorded_progress(engine, claimed.id))


def _refuse_link(own: Path) -> None:
    if own.is_symlink():  # its checkpoints would land (and old ones be deleted) wherever the link points
        raise WorkerError(f"run folder {shown_path(own)} is a link; a run's checkpoints are written only inside "
                          "--runs-dir: remove the link")


def _requeue_after_database_failure(engine: Engine, claimed: queue.ClaimedRun, trainer: Trainer | None,
                                    e: DatabaseUnavailable, worker: str) -> tuple[FibctlError, bool]:
    """Checkpoint the step in progress if the database got its every row, put the run back in
    the queue; the error to stop with, and whether the run could be put back. A step whose
    rows were refused is not checkpointed: a resume would train on past them, and the run
    finish with them missing (its final evaluation, say); the run resumes from its last
    checkpoint instead, redoing the steps."""
    saved = ""
    if trainer is not None and trainer.step > 0:
        path = ckpt.checkpoint_path(trainer.run_dir, trainer.step)
        if path.is_file() or trainer.complete_step == trainer.step:  # written after the step's rows
            saved = f"; checkpointed step {trainer.step} to {path if path.is_file() else trainer.write_checkpoint()}"
        else:
            older = ckpt.list_checkpoints(trainer.run_dir)
            saved = (f"; step {trainer.step}'s rows were not all written, so it was not checkpointed: the run "
                     + (f"resumes from its checkpoint {older[-1].name}" if older else "starts again from step 0"))
    try:
        queue.release(engine, claimed.id, f"released: {e}", worker)
    except DatabaseUnavailable:
        return FibctlError(f"run {claimed.name!r}: {e}{saved}; {UNRELEASED}"), False
    return FibctlError(f"run {claimed.name!r}: {e}{saved}; it is queued again"), True


# a run given up while the database cannot be reached: it cannot be put back in the queue
UNRELEASED = "it stays marked running until its heartbeat is stale, then the next worker resumes it"


def _settle(engine: Engine, claimed: queue.ClaimedRun, recorder: RunRecorder, opts: WorkerOptions,
            result: TrainResult, worker: str) -> Outcome:
    """Record the loop's result on the run's row and move it to its next state, if the row is
    still this worker's: cancelled, or taken over after a stall past another worker's heartbeat
    timeout, it is no longer ours to change."""
    lost = Outcome(claimed.name, "lost", result.step, result.error, result.checkpoint)
    if result.status == "lost":
        return lost
    _record(recorder, opts, claimed.name, result)
    if result.status == "done":
        recorder.update_run(final_step=result.step)
        if not queue.finish(engine, claimed.id, worker):
            return lost
        return Outcome(claimed.name, "done", result.step, None, result.checkpoint)
    if result.status == "stopped":
        if not queue.release(engine, claimed.id, f"stopped at step {result.step}; resumes from {shown_path(result.checkpoint)}",
                             worker):
            return lost
        return Outcome(claimed.name, "released", result.step, None, result.checkpoint)
    if not queue.fail(engine, claimed.id, result.error, worker):
        return lost
    hint = None
    if result.status == "diverged":  # resumed bit-exactly, a retry would diverge again at the same step
        hint = ("a retry repeats the same steps; train it again as a new run at a lower learning rate: "
                + queue_again(claimed.config, "_lowlr", lr="LOWER"))
    return Outcome(claimed.name, "failed", result.step, result.error, result.checkpoint, hint)


def _record(recorder: RunRecorder, opts: WorkerOptions, name: str, result: TrainResult) -> None:
    stored = ckpt.stored_path(result.checkpoint, name) if result.checkpoint else None
    recorder.update_run(tokens_trained=result.tokens_trained, wall_seconds=result.wall_seconds,
                        checkpoint_path=stored)


def _error_line(e: Exception) -> str:
    """The outcome line of a run that raised: fibctl's own errors are written for the user as
    they are; anything else is named by its class, which says what went wrong."""
    return str(e) if isinstance(e, FibctlError) else f"{type(e).__name__}: {e}"


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)[-6:])


# ----------------------------------------------------------------------------- one process per GPU


def parse_gpus(spec: str) -> list[int]:
    """`all` -> every visible CUDA device; `0,2,3` -> those. A machine without CUDA is refused
    (a silent CPU worker would train a GPU study for weeks): `--device cpu` says so explicitly."""
    if not spec.strip():
        raise FibctlError("--gpus is empty; give `all` or a comma-separated list like 0,2,3")
    count = torch.cuda.device_count()
    if spec == "all":
        if not count:
            raise FibctlError("--gpus all: this machine has no CUDA device (torch "
                              f"{torch.__version__}); to train on the CPU, drop --gpus or pass --device cpu")
        return list(range(count))
    try:
        gpus = [int(g) for g in spec.split(",") if g.strip()]
    except ValueError:
        raise FibctlError(f"--gpus {spec!r}: expected `all` or a comma-separated list like 0,2,3") from None
    bad = [g for g in gpus if not 0 <= g < count]
    if bad or not gpus or len(set(gpus)) != len(gpus):
        raise FibctlError(f"--gpus {spec!r}: this machine has {count} CUDA device(s)"
                          + (f"; {bad} not among them" if bad else ""))
    return gpus


def launch_per_gpu(gpus: list[int], worker_args: list[str], on_start: Callable[[int, int], None] | None = None,
                   env: dict[str, str] | None = None) -> int:
    """One `fibctl worker` process per GPU, each seeing only its device; waits for all.
    `env` is added to each child's environment (the database URL goes there, not on a
    command line every user of the machine can read).

    SIGINT/SIGTERM here are forwarded to every child as SIGTERM (each checkpoints and
    releases its run). Returns the worst child exit code, or after such a stop that every
    child obeyed, 128 + the signal received.
    """
    received: list[int] = []
    children = []
    for gpu in gpus:
        child_env = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": str(gpu)}
        # own session: a terminal's Ctrl-C reaches the children once, through the forwarding below
        children.append(subprocess.Popen([sys.executable, "-m", "fibctl", "worker", "--device", "cuda:0",
                                          "--plain", *worker_args], env=child_env, start_new_session=True))
        if on_start:
            on_start(gpu, children[-1].pid)

    def forward(signum, _frame):
        received.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [child.wait() for child in children]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return stopped_code(codes, received)


def stopped_code(codes: list[int], received: list[int]) -> int:
    """A launcher's exit code: 128 + the first signal it received and passed on as SIGTERM,
    when every process it started ended as asked (0: a torchrun group, or a worker with
    nothing left to train; 143: a worker that stopped); otherwise the worst code. A process
    the signal ended before it could handle it (Popen's -N) counts as 128 + N, as a shell reads it."""
    codes = [128 - code if code < 0 else code for code in codes]
    if received and all(code in (0, 128 + signal.SIGTERM) for code in codes):
        return 128 + received[0]
    return max(codes, key=abs, default=0)
