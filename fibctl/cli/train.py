"""`fibctl train`, `fibctl worker`, `fibctl eval`: parse options, call fibctl.train and
fibctl.flows, show progress."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.cells import cell_len
from rich.table import Column
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fibctl.cli import OUTPUT_CLOSED, app, silence_closed_output, stopped_by_closed_output
from fibctl.cli.common import DEFAULT_DB, DbOption, console, data_dir_value, err_console, runs_dir_value
from fibctl.cli.common import plain as as_written  # `plain` is also the --plain option here
from fibctl.db.engine import connect
from fibctl.errors import FibctlError, shown_path
from fibctl.reports.tables import loss as loss_label, ppl  # as every table prints them
from fibctl.train.loggers import LOGGERS, check_loggers
from fibctl.units import duration

if TYPE_CHECKING:  # torch loads when a command trains or evaluates, not when the CLI starts
    from fibctl.flows.worker import Outcome
    from fibctl.train import trainer

DataOption = Annotated[Path, typer.Option("--data", envvar="FIBCTL_DATA", show_default=True,
                                          parser=data_dir_value, metavar="<path>",
                                          help="Prepared data directory (fibctl data prepare).")]
RunsDirOption = Annotated[Path, typer.Option("--runs-dir", envvar="FIBCTL_RUNS_DIR", show_default=True,
                                             parser=runs_dir_value, metavar="<path>",
                                             help="Where checkpoints go: one folder per run.")]
DeviceOption = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda, cuda:N; default: the first GPU if there is one, else the CPU.")]
ThreadsOption = Annotated[Optional[int], typer.Option(
    "--threads", help="CPU threads for torch (default 1 on CPU, so that workers can share a machine; "
    "one worker alone on an idle machine may be faster with more: measure).")]
PlainOption = Annotated[bool, typer.Option(
    "--plain", help="Plain log lines instead of a progress bar (automatic when not a terminal).")]
LogToOption = Annotated[Optional[list[str]], typer.Option(
    "--log-to", help=f"Also send the metrics to {' or '.join(LOGGERS)} (repeatable), under the run's folder; "
    "the database always gets them. Needs the extra: pip install -e '.[tensorboard]' or '.[wandb]'.")]
CompileOption = Annotated[bool, typer.Option(
    "--compile", help="Run the training steps through torch.compile (needs a C++ compiler on the CPU, triton on "
    "CUDA; the first steps wait for compilation). Equal to eager within float rounding, not bit for bit.")]
HeartbeatOption = Annotated[float, typer.Option(
    "--heartbeat-timeout", help="Seconds without a heartbeat after which a running run counts as abandoned "
    "(at least 1).")]
CheckpointsDirOption = Annotated[Optional[Path], typer.Option(  # eval's and sample's: they read checkpoints
    "--runs-dir", envvar="FIBCTL_RUNS_DIR", parser=runs_dir_value, metavar="<path>",
    help="Where the checkpoints are (default: the folder each run trained in).")]
DEFAULT_DATA, DEFAULT_RUNS = Path("data"), Path("runs")


class RunDisplay:
    """Per-run progress as one line (step, loss, lr, time per step, tokens/s, ETA): on a
    terminal redrawn each step after a bar; otherwise printed at the first step of this
    attempt, every `every` steps and the last. Either way a line per held-out set when the
    run evaluates, and one at the end with the time taken and the final perplexities. Each
    line is printed unwrapped (soft_wrap): in a log file, one event stays one line.

    Output whose reader has gone (`fibctl worker | head -1`, a `tee` that died) stops the
    work as a first Ctrl-C does: the run checkpoints and is queued again at once, rather than
    left `running` until its heartbeat is stale, and the command exits 141 (128 + SIGPIPE)."""

    def __init__(self, plain: bool, every: int = 10, stop=None):
        self.plain = plain or not console.is_terminal
        self.every, self.progress, self.stop = every, None, stop
        self.last: trainer.Progress | None = None

    def start(self, name: str, steps: int):
        self.last = None

        def evals(p: trainer.Progress, say) -> None:
            for dataset, loss in p.evals.items():
                say(f"{name} {p.step}/{p.steps} eval {dataset} loss {loss:.3f} ppl {_ppl(loss)}")

        if self.plain:
            def line(p: trainer.Progress) -> None:
                first, self.last = self.last is None, p  # a resumed run's first step says where it resumed
                if first or p.step % self.every == 0 or p.step == p.steps:
                    self.log(progress_line(name, p))
                evals(p, self.log)
            return line
        # the bar takes the room the line leaves at the terminal's width (none: no bar), so
        # that no number is cut
        from fibctl.train.trainer import Progress as Step  # torch: loaded by now, for the run

        widest = progress_line(name, Step(steps, steps, 10.0, 999e3, 0.0, 1e-4, 0.999)) + " ETA 99h59m"
        room = min(40, console.width - cell_len(widest) - 1)
        bar = [BarColumn(bar_width=room)] if room >= 5 else []
        # the run's name, as the database has it, is text: never markup
        self.progress = Progress(TextColumn("{task.description}", style="bold", markup=False), *bar,
                                 TextColumn("{task.fields[line]}", markup=False), console=console)
        self.progress.start()
        task = self.progress.add_task(as_written(name), total=steps, line="")

        def draw(p: trainer.Progress) -> None:
            self.last = p
            self.progress.update(task, completed=p.step, line=progress_line(name, p)[len(name) + 1:])
            evals(p, lambda text: self._print(self.progress.console, as_written(text), highlight=False))
        return draw

    def warn(self, message: str) -> None:  # on stderr, as warnings are: stdout is the run's log
        self._print(err_console, as_written(f"warning: {message}", "yellow"), highlight=False, soft_wrap=True)

    def finish(self, outcome: Outcome) -> None:
        if self.progress:
            self.progress.stop()
            self.progress = None
        style = {"done": "green", "released": "yellow", "failed": "red", "lost": "yellow"}[outcome.status]
        detail = f": {outcome.error}" if outcome.error else ""
        last = self.last if self.last is not None and self.last.step == outcome.step else None
        if last is not None and outcome.status == "done":  # how long, and what it scored at the end
            detail += f" in {duration(last.elapsed_s)}" + ("; final ppl " + ", ".join(
                f"{dataset} {_ppl(loss)}" for dataset, loss in last.evals.items()) if last.evals else "")
        where = f" ({shown_path(outcome.checkpoint)})" if outcome.checkpoint and outcome.status != "failed" else ""
        # folded at a terminal's width; one line in a file, for grep
        line = as_written(f"{outcome.name}: {outcome.status} {outcome.at}{detail}", style)
        self._print(console, line + as_written(where), highlight=False, soft_wrap=not console.is_terminal)
        if outcome.hint:
            self._print(err_console, as_written(f"hint: {outcome.hint}"), highlight=False,
                        soft_wrap=not err_console.is_terminal)

    def log(self, text: str) -> None:
        self._print(console, as_written(text), highlight=False, soft_wrap=True)

    note = log

    def _print(self, out, *args, **kwargs) -> None:
        try:
            out.print(*args, **kwargs)
        except OUTPUT_CLOSED:
            if self.stop is None:
                raise
            silence_closed_output(1 if out is console else 2)
            if not self.stop.is_set():
                self.stop.signal = signal.SIGPIPE
                self.stop.set()
                if out is console:
                    self.warn("the output's reader has gone: stopping; the run checkpoints and is queued again")


class EvalProgress:
    """Progress over `evaluate`'s measurements (a run at one length on one held-out set), as
    `start` and `result` hear of them. On a terminal a bar naming the measurement under way,
    with the count, the time taken and the time left at the pace so far; otherwise (a log
    file, --plain) a line per result with its perplexity, the count and the time left. The
    bar named the measurement just finished, its total unknown until then, and neither said
    how long an evaluation of hundreds of measurements had left."""

    def __init__(self, plain: bool):
        self.plain = plain or not console.is_terminal
        self.done, self.began, self.progress = 0, time.monotonic(), None

    def __enter__(self) -> EvalProgress:
        self.began = time.monotonic()
        if not self.plain:
            self.bar = BarColumn()
            # a name too long for the line folds, rather than the numbers after it being cut
            self.columns = (TextColumn("{task.description}", markup=False, table_column=Column(overflow="fold")),
                            self.bar, MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[left]}", markup=False))
            self.progress = Progress(*self.columns, console=console)
            self.progress.start()
            self.task = self.progress.add_task("evaluating", total=None, left="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def _left(self, total: int) -> str:
        if not self.done or self.done >= total:
            return ""
        return f"ETA {duration((time.monotonic() - self.began) / self.done * (total - self.done))}"

    def start(self, item: dict, total: int) -> None:
        if self.progress is None:
            return
        text = f"{item['run']} @ {item['eval_length']} {item['dataset']}"
        # the bar takes the room the text leaves (none: no bar), so that no number is cut
        widest = f"{text} {total}/{total} 0:00:00 ETA 99h59m"
        room = min(40, console.width - cell_len(widest) - 2)
        self.bar.bar_width = room
        self.progress.columns = tuple(c for c in self.columns if c is not self.bar or room >= 5)
        self.progress.update(self.task, total=total, description=as_written(text), left=self._left(total))

    def result(self, row: dict, total: int) -> None:
        self.done += 1
        eta = self._left(total)
        if self.progress is not None:
            self.progress.update(self.task, completed=self.done, total=total, left=eta)
            return
        console.print(as_written(f"{row['run']} length {row['eval_length']} {row['dataset']}: ppl {ppl(row['ppl'])} "
                                 f"({self.done}/{total}" + (f", {eta})" if eta else ")")),
                      highlight=False, soft_wrap=True)


def progress_line(name: str, p: trainer.Progress) -> str:
    """nanoGPT's log line, with the run's name (workers share a log): at a paper run's name
    and numbers it fits 80 columns."""
    # in ms below what rounds to 1000 ms: `.3g` wrote a step of 0.9997 s as '1e+03ms'
    step = f"{_3g(p.step_s * 1000)}ms" if p.step_s < 0.9995 else f"{p.step_s:.2f}s"
    eta = f" ETA {duration(p.eta_s)}" if p.eta_s is not None and p.step < p.steps else ""
    return (f"{name} {p.step}/{p.steps} loss {loss_label(p.loss)} lr {_lr(p.lr)} {step} {_si(p.tokens_per_s)} tok/s{eta}")


def _lr(lr: float) -> str:
    return f"{lr:.1e}".replace("e-0", "e-")


def _si(value: float) -> str:
    """3 significant figures, with k or M: 812, 11.3k, 22.0k, 512k, 1.25M."""
    for factor, unit in ((1e6, "M"), (1e3, "k")):
        if value >= factor * 0.9995:
            return f"{_3g(value / factor)}{unit}"
    return f"{value:.0f}"


def _3g(value: float) -> str:
    """3 significant figures, trailing zeros kept (22.0, not 22 beside 21.6: the line's
    numbers keep their width and precision from one log line to the next)."""
    return f"{value:#.3g}".rstrip(".")


def _ppl(loss: float) -> str:
    return ppl(math.exp(loss)) if loss < 700 else "inf"


def _passed_on(data: Path, runs_dir: Path, heartbeat_timeout: float, log_to: list[str], compile: bool,
               device: str | None, threads: int | None) -> list[str]:
    """The options `train` and `worker` give again to the fibctl processes they start
    (torchrun's ranks, one worker per GPU): each must read and write where this one would, and
    train as it would (one list for every launch: the per-GPU workers once lost --threads)."""
    args = ["--data", str(data), "--runs-dir", str(runs_dir), "--heartbeat-timeout", str(heartbeat_timeout)]
    args += [a for n in log_to for a in ("--log-to", n)] + (["--compile"] if compile else [])
    return args + (["--device", device] if device else []) + (["--threads", str(threads)] if threads else [])


@app.command("train")
def train_cmd(
    name: Annotated[str, typer.Argument(help="Run name, as in `fibctl queue ls`.")],
    db: DbOption = DEFAULT_DB,
    data: DataOption = DEFAULT_DATA,
    runs_dir: RunsDirOption = DEFAULT_RUNS,
    device: DeviceOption = None,
    threads: ThreadsOption = None,
    plain: PlainOption = False,
    heartbeat_timeout: HeartbeatOption = 600,
    log_to: LogToOption = None,
    compile: CompileOption = False,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", help="Train the run in N processes on this machine (torchrun, DistributedDataParallel; one "
        "per GPU on CUDA, gloo on the CPU); N must divide the run's grad_accum. Under torchrun itself, "
        "leave it out.")] = None,
) -> None:
    """Train one run of the database, resuming from its last checkpoint if it has one.

    Under torchrun (`torchrun --nproc-per-node N -m fibctl train NAME`) each process trains its
    share of every step and rank 0 alone writes to the database and the checkpoints.
    Ctrl-C or SIGTERM checkpoints and requeues the run, then exits 130 or 143 (128 + the
    signal); a failed run exits 1, and bad input (its data included) 2, the run left queued.

    Example: fibctl train fib_fixed_w8 --data data/demo --log-to tensorboard"""
    from fibctl.flows.worker import StopRequest, WorkerOptions, train_named
    from fibctl.queue import NOT_QUEUED, check_named
    from fibctl.flows.torchrun import ENVIRONMENT, launched, missing

    opts = WorkerOptions(data_dir=data, runs_dir=runs_dir, device=device, threads=threads,
                         heartbeat_timeout_s=_positive_timeout(heartbeat_timeout),
                         log_to=check_loggers(log_to or ()), compile=compile)
    # an unknown name is refused before the database is upgraded or switched to WAL mode
    known = check_named([name], NOT_QUEUED)
    if partial := missing():  # one process would claim the run alone, its group never formed
        raise FibctlError(f"torchrun's environment is incomplete ({', '.join(partial)} not set): start the ranks "
                          "with torchrun, or unset " + ", ".join(n for n in ENVIRONMENT if n not in partial)
                          + " to train in one process")
    if nproc is not None:
        from fibctl.flows.worker import check_ddp, launch_ddp

        if launched():
            raise FibctlError("--nproc under torchrun: torchrun already started the processes; drop --nproc")
        check_ddp(connect(db, must_exist=True, check=known), name, nproc, opts)
        passed = _passed_on(data, runs_dir, heartbeat_timeout, opts.log_to, compile, device, threads)
        args = ["train", name, *passed] + (["--plain"] if plain else [])
        raise typer.Exit(launch_ddp(nproc, args, env={"FIBCTL_DB": db}))
    stop = StopRequest()
    if launched():
        from fibctl.flows.worker import train_distributed

        outcome = train_distributed(lambda: connect(db, must_exist=True, check=known), name, opts,
                                    RunDisplay(plain, stop=stop), stop)
    else:
        outcome = train_named(connect(db, must_exist=True, check=known), name, opts, RunDisplay(plain, stop=stop), stop)
    _resume_hint([outcome])
    _next_steps([outcome], db, whole_queue=False)
    _exit_after_signal(stop)
    if outcome.status == "failed":
        raise typer.Exit(1)


@app.command("worker")
def worker_cmd(
    db: DbOption = DEFAULT_DB,
    data: DataOption = DEFAULT_DATA,
    runs_dir: RunsDirOption = DEFAULT_RUNS,
    gpus: Annotated[Optional[str], typer.Option(
        "--gpus", help="`all` or e.g. `0,2,3`: one worker process per GPU, each pinned to its device "
        "(refused on a machine without CUDA: use --device cpu).")] = None,
    max_runs: Annotated[Optional[int], typer.Option("--max-runs", help="Stop after this many runs.")] = None,
    max_attempts: Annotated[int, typer.Option("--max-attempts", help="Claims before an abandoned run fails.")] = 3,
    device: DeviceOption = None,
    threads: ThreadsOption = None,
    plain: PlainOption = False,
    heartbeat_timeout: HeartbeatOption = 600,
    log_to: LogToOption = None,
    compile: CompileOption = False,
    ddp: Annotated[bool, typer.Option(
        "--ddp", help="Train each claimed run on all of this node's GPUs at once (torchrun, "
        "DistributedDataParallel); rank 0 claims. Under torchrun (several nodes), each rank.")] = False,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", help="With --ddp: the process count (default: every GPU; required on the CPU, gloo). "
        "Each run's grad_accum must be a multiple of it.")] = None,
) -> None:
    """Claim queued runs and train them until the queue is empty.

    Ctrl-C checkpoints and requeues. Exits 1 when a run it trained failed, 2 (the runs left
    queued) when its data, runs folder or database is at fault, 130 after Ctrl-C and 143
    after SIGTERM (128 + the signal: the queue may not be finished).

    Example: fibctl worker --data data/demo --max-runs 2"""
    from fibctl.flows.worker import StopRequest, WorkerOptions, launch_per_gpu, parse_gpus, work
    from fibctl.flows.torchrun import launched, missing, reports

    check_worker_limits(heartbeat_timeout, max_attempts, max_runs)
    _check_ddp_options(ddp, nproc, gpus, launched(), missing())
    log_to = check_loggers(log_to or ())  # before any claim: a missing extra would fail every run
    if gpus is not None and device is not None:  # each per-GPU worker is given its device
        raise FibctlError("--gpus and --device: choose one (--gpus starts a worker on each GPU listed; "
                          "--device picks this worker's device, --device cpu a CPU worker)")
    shared = _passed_on(data, runs_dir, heartbeat_timeout, log_to, compile, device, threads)
    shared += ["--max-attempts", str(max_attempts)] + (["--max-runs", str(max_runs)] if max_runs else [])
    gpu_list = parse_gpus(gpus) if gpus is not None else []  # "" is refused there, not a CPU worker
    if gpu_list:
        code = launch_per_gpu(gpu_list, shared, lambda g, pid: console.print(f"worker for GPU {g}: pid {pid}"),
                              env={"FIBCTL_DB": db})
        raise typer.Exit(code)
    opts = WorkerOptions(data_dir=data, runs_dir=runs_dir, device=device, threads=threads,
                         heartbeat_timeout_s=heartbeat_timeout, max_attempts=max_attempts, max_runs=max_runs,
                         log_to=log_to, compile=compile)
    if ddp and not launched():  # this node's torchrun group, which runs the branch below
        from fibctl.flows.worker import check_launch, launch_ddp

        connect(db, must_exist=True).dispose()
        n = check_launch(opts, nproc)
        raise typer.Exit(launch_ddp(n, ["worker", "--ddp", *shared] + (["--plain"] if plain else []),
                                    env={"FIBCTL_DB": db}))
    stop = StopRequest()
    if ddp:
        from fibctl.flows.worker import work_distributed

        from fibctl.flows.slurm import in_job

        # a rank of a `slurm submit --ddp` job: each run gets its `slurm` event
        connect_db, display = in_job(lambda: connect(db, must_exist=True), RunDisplay(plain, stop=stop))
        outcomes = work_distributed(connect_db, opts, display, stop)
        if not reports():  # rank 0 reports the group's runs
            raise typer.Exit(1 if any(o.status == "failed" for o in outcomes) else 0)
    else:
        outcomes = work(connect(db, must_exist=True), opts, RunDisplay(plain, stop=stop), stop)
    _summary(outcomes, db, opts.heartbeat_timeout_s)
    _resume_hint(outcomes)
    _next_steps(outcomes, db, whole_queue=True)
    _exit_after_signal(stop)
    if any(o.status == "failed" for o in outcomes):
        raise typer.Exit(1)


def _summary(outcomes: list[Outcome], db: str, heartbeat_timeout_s: float) -> None:
    """The worker's last line: each run it took and how it ended; folded at a terminal's
    width, one line in a file (for grep). With nothing to take, the runs marked running
    elsewhere are said: a worker killed a moment ago leaves its run so until its heartbeat
    is stale, and "nothing queued" alone read as if it were lost."""
    said = ", ".join(f"{o.name} {o.status}" for o in outcomes) or "nothing queued"
    if not outcomes:
        from fibctl import queue
        from fibctl.db.engine import connect_readonly

        running = queue.status_counts(connect_readonly(db)).get("running", 0)
        if running:
            said += (f"; {running} run(s) marked running: another worker's, or one whose worker stopped "
                     f"(taken back once its heartbeat is {heartbeat_timeout_s:g} s old; see fibctl status)")
    console.print(as_written(f"worker: {len(outcomes)} run(s): {said}"), highlight=False,
                  soft_wrap=not console.is_terminal)


def _resume_hint(outcomes: list[Outcome]) -> None:
    """After a stop, how training goes on: "released" alone left a user who pressed Ctrl-C to
    guess. The same command line, whose --db and --data are the ones that trained it. In a
    torchrun group rank 0 says it, the launcher (`train --nproc`, `worker --ddp`) knowing
    nothing of the runs; it is the same command there too. Not in a SLURM job's group, whose
    task started it: there the job requeues itself (its task marked the stop so), or, ended
    by scancel, another job or a worker resumes the run."""
    from fibctl.flows.torchrun import REQUEUE, in_slurm_job, reports, stop_reason

    released = [o for o in outcomes if o.status == "released" and o.step is not None]
    if released and reports():
        # one aborted by a second Ctrl-C (its error says so) goes back to its last checkpoint
        said = ", ".join(f"{o.name} from " + ("its last checkpoint" if o.error else f"step {o.step}")
                         for o in released)
        how = "run the same command to resume"
        if in_slurm_job():
            how = ("this SLURM job requeues itself and resumes" if stop_reason() == REQUEUE else
                   "a new job (fibctl slurm submit) or any worker resumes")
        err_console.print(as_written(f"hint: queued again; {how} {said}"),
                          highlight=False, soft_wrap=not err_console.is_terminal)


def _next_steps(outcomes: list[Outcome], db: str, *, whole_queue: bool) -> None:
    """After training, what a user does next: "worker: 3 run(s): dense done, ..." ended the
    command, and one who came from nanoGPT was left to find eval, the reports and sample in
    the docs. Said once every run it trained is done and, for a worker, nothing is left to
    train (not after --max-runs, nor while another worker trains); the length is 4x the
    runs' training length where they share one, the study's question (Table 3). Probe runs,
    which have no text to measure or sample, are read by Table 2."""
    done = [o.name for o in outcomes if o.status == "done"]
    if not done or len(done) < len(outcomes):
        return
    from fibctl import queue
    from fibctl.db.engine import connect_readonly

    engine = connect_readonly(db)
    if whole_queue and any(queue.status_counts(engine).get(s) for s in ("queued", "running")):
        return
    rows = queue.matrices_and_lengths(engine, done)
    if any(matrix == "probe" for matrix, _ in rows):
        said = "`fibctl report table2` reads the probe's runs"
    else:
        lengths = {length for _, length in rows}
        length = 4 * lengths.pop() if len(lengths) == 1 else "LENGTH"
        which = "--all" if whole_queue else " ".join(done)
        said = (f"`fibctl eval {which} --length {length}` measures past the training length (4x), "
                f"then `fibctl report table3`; `fibctl sample {done[0]}` writes text")
    console.print(as_written(f"next: {said}"), highlight=False, soft_wrap=not console.is_terminal)


def _exit_after_signal(stop) -> None:
    """Exit 128 + the signal that stopped the command (the run checkpointed and requeued), as
    a shell or SLURM reads a process a signal ended. Not in a rank under torchrun: torchrun
    takes a rank's nonzero exit for a failure and stops the other ranks, rank 0 perhaps still
    requeueing; the command that launched the group (launch_ddp) exits so instead."""
    from fibctl.flows.torchrun import launched

    if stop.signal is not None and not launched():
        raise typer.Exit(128 + stop.signal)


def _check_ddp_options(ddp: bool, nproc: int | None, gpus: str | None, under_torchrun: bool,
                       missing: list[str]) -> None:
    """`worker --ddp` outside torchrun launches a group, inside it is one rank; a process with
    only part of torchrun's environment (`missing` the rest) is neither: a rank started by hand."""
    if nproc is not None and not ddp:
        raise FibctlError("--nproc goes with --ddp (one group of processes trains each run)")
    if ddp and gpus:
        raise FibctlError("--ddp and --gpus: choose one (--ddp: all GPUs train each run; --gpus: one run per GPU)")
    if under_torchrun and not ddp:
        raise FibctlError("fibctl worker under torchrun: add --ddp (without it each rank would claim runs of its own)")
    if under_torchrun and nproc is not None:
        raise FibctlError("--nproc under torchrun: torchrun already started the processes; drop --nproc")
    if ddp and missing:
        raise FibctlError(f"--ddp: torchrun's environment is incomplete ({', '.join(missing)} not set); start the "
                          "ranks with torchrun, or run fibctl worker --ddp outside torchrun to launch them")


def check_worker_limits(heartbeat_timeout: float, max_attempts: int, max_runs: int | None) -> None:
    """The limits a worker runs under (`fibctl worker`, and each task of `fibctl slurm submit`)."""
    _positive_timeout(heartbeat_timeout)
    bad = [f"--{option} ({value})" for option, value in (("max-attempts", max_attempts), ("max-runs", max_runs))
           if value is not None and value < 1]  # only what was given: an unset --max-runs is no limit
    if bad:
        raise FibctlError(f"{' and '.join(bad)} must be >= 1")


HEARTBEAT_TIMEOUT_LIMIT_S = 10**9  # about 32 years: beyond it the claim's date arithmetic overflows
# a worker heartbeats at each log line and evaluation: a timeout shorter than the time between
# them counts a live run as abandoned, and two workers train it. 0 or 1e-300 always does; the
# floor refuses those (a paper run wants minutes: the default is 600)
HEARTBEAT_TIMEOUT_LEAST_S = 1


def _positive_timeout(seconds: float) -> float:
    if not HEARTBEAT_TIMEOUT_LEAST_S <= seconds <= HEARTBEAT_TIMEOUT_LIMIT_S:  # also refuses nan and inf
        raise FibctlError(f"--heartbeat-timeout {seconds:g} must be a number of seconds of at least "
                          f"{HEARTBEAT_TIMEOUT_LEAST_S} and at most {HEARTBEAT_TIMEOUT_LIMIT_S:,}")
    return seconds


def _results_tables(df, speed: bool, width: int) -> list:
    """eval's measurements, a row each, then (with --speed) the inference speeds: no cell cut
    with '…' at the terminal's width (a plain table cut run names and perplexities at 60
    columns). Names fold within their column, numbers keep their width; tokens and step give
    way first, said in a line below (the same in every row: its value)."""
    from fibctl.cli.common import fitted_view

    headers = ["run", "step", "dataset", "length", "tokens", "loss", "ppl"]
    rows = [[r.run, str(r.step), r.dataset, str(r.eval_length), f"{r.tokens:,}", f"{r.loss:.4f}",
             ppl(r.ppl) if math.isfinite(r.ppl) else "inf"] for r in df.itertuples()]
    shown = [fitted_view(headers, rows, width=width, names=("run", "dataset"), optional=("tokens", "step"),
                         right=("step", "length", "tokens", "loss", "ppl"))]
    if speed:  # one measurement per run and length, whatever the held-out sets
        # the mean of the timed passes, as the study reported it, then its slowest and fastest pass
        headers = ["run", "step", "length", "batch", "tokens/s", "passes"]
        rows = [[r.run, str(r.step), str(r.eval_length), str(r.speed_batch), f"{r.tokens_per_s:,.0f}",
                 f"{r.tokens_per_s_min:,.0f}-{r.tokens_per_s_max:,.0f}"]
                for r in df.drop_duplicates(["run", "eval_length"]).itertuples()]
        shown.append(fitted_view(headers, rows, width=width, names=("run",), optional=("step",),
                                 right=headers[1:], title="inference speed"))
    return shown


@app.command("eval")
def eval_cmd(
    names: Annotated[Optional[list[str]], typer.Argument(help="Run names (or --all).")] = None,
    length: Annotated[list[int], typer.Option(
        "--length", help="Evaluation length in tokens; repeat for several (e.g. --length 1024 --length 4096).")] = ...,
    all_runs: Annotated[bool, typer.Option("--all", help="Every run that has a checkpoint.")] = False,
    dataset: Annotated[Optional[list[str]], typer.Option(
        "--dataset", help="Held-out set; repeat for several (default: all of the manifest's).")] = None,
    tokens: Annotated[Optional[int], typer.Option(
        "--tokens", help="Token budget per set and length (default: the run's final_eval_tokens).")] = None,
    positions: Annotated[bool, typer.Option(
        "--positions", help="Also record the mean loss at every position, over the windows of the "
        "run's position_tokens (default: all).")] = False,
    speed: Annotated[bool, typer.Option("--speed", help="Also record inference tokens/s as the study timed it: forward passes over a batch of 8 "
        "sequences, the mean of 5 after 2 untimed, and the slowest and fastest of the 5.")] = False,
    db: DbOption = DEFAULT_DB,
    data: DataOption = DEFAULT_DATA,
    runs_dir: CheckpointsDirOption = None,
    device: DeviceOption = None,
    threads: ThreadsOption = None,
    log_to: LogToOption = None,
) -> None:
    """Perplexity of trained runs at any length, from their final checkpoints, into the database.

    Example: fibctl eval fib_fixed_w8 dense --length 256 --length 512 --positions"""
    from fibctl.flows.evaluation import check_chosen, evaluate, plan

    check_chosen(names or [], all_runs)  # what to evaluate, before where from
    log_to = check_loggers(log_to or ())
    from fibctl.db.engine import current_revision, head_revision
    from fibctl.device import setup_process
    from fibctl.queue import check_named

    def check(reader) -> None:
        """Every input refused before the database is upgraded or switched to WAL mode; an
        older schema (upgraded first) only has its run names checked."""
        if names and not all_runs:  # a mistyped name first, whatever else is wrong
            check_named(names)(reader)
        if current_revision(reader) == head_revision():
            plan(reader, names or [], length, data_dir=data, all_runs=all_runs, datasets=dataset, tokens=tokens,
                 runs_dir=runs_dir)

    setup_process(device, threads)
    try:
        with EvalProgress(plain=False) as progress:
            df = evaluate(connect(db, must_exist=True, check=check), names or [], length, data_dir=data, all_runs=all_runs,
                          datasets=dataset, tokens=tokens, positions=positions, speed=speed, device=device,
                          runs_dir=runs_dir, on_start=progress.start, on_result=progress.result, log_to=log_to,
                          on_note=lambda note: err_console.print(as_written(f"note: {note}"), highlight=False,
                                                                 soft_wrap=True))
    except KeyboardInterrupt:  # each result is committed as it is measured
        err_console.print("interrupted; the results measured before it are recorded: run the same command "
                          "again to finish", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except OUTPUT_CLOSED:  # `fibctl eval ... | head -1`
        raise stopped_by_closed_output("the output's reader has gone: stopped; the results measured before it "
                                       "are recorded: run the same command again to finish") from None
    for table in _results_tables(df, speed, console.width):
        console.print(table)
