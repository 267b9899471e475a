"""`fibctl demo`: the study in miniature, offline, on a CPU.

data (installed-docs) -> queue (matrix `demo`) -> one sequential worker -> evaluation at
1x, 2x, 4x, 8x the training length with per-position losses -> tables and figures.
Everything lands in DIR/results.db; a second run resumes where the first stopped.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pandas as pd
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine

from fibctl import queue
from fibctl.config import get_preset
from fibctl.errors import FibctlError, shown_path
from fibctl.matrix import load_matrix
from fibctl.units import duration

MARKER = ".fibctl-demo"  # written into DIR so that a later run knows the folder is a demo's
LENGTH_FACTORS = (1, 2, 4, 8)
# Any running row left by an earlier demo process is stale once the demo starts again.
HEARTBEAT_TIMEOUT_S = 60


@dataclass(frozen=True)
class DemoPlan:
    name: str  # "full" or "quick" (--quick)
    recipe: str
    preset: str
    train_length: int

    @property
    def lengths(self) -> list[int]:
        return [f * self.train_length for f in LENGTH_FACTORS]


FULL = DemoPlan("full", recipe="demo", preset="tiny", train_length=128)
QUICK = DemoPlan("quick", recipe="quick", preset="micro", train_length=64)


def plan(quick: bool) -> DemoPlan:
    return QUICK if quick else FULL


def check_out_dir(out: Path, p: DemoPlan) -> None:
    """Refuse a folder that holds something other than a fibctl demo of this plan (before
    anything in it changes: the other plan's data would be rebuilt, then its runs refused);
    mark ours, with its plan."""
    if out.exists() and not out.is_dir():
        raise FibctlError(f"--out {shown_path(out)} is a file, not a folder")
    marker = out / MARKER
    if out.is_dir() and any(out.iterdir()) and not marker.exists():
        raise FibctlError(f"--out {shown_path(out)} holds files that are not a fibctl demo; "
                          "choose an empty or new folder so results are not mixed")
    theirs = re.search(r"^plan: (\w+)$", marker.read_text(), re.M) if marker.exists() else None
    if theirs and theirs[1] != p.name:
        raise FibctlError(f"--out {shown_path(out)} holds a "
                          f"{'`fibctl demo --quick`' if theirs[1] == 'quick' else '`fibctl demo`'}; run that to "
                          "resume it, or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"made by `fibctl demo`; a later `fibctl demo` of the same plan resumes here\nplan: {p.name}\n")


def fastest_threads(preset: str, steps: int = 4) -> tuple[int, dict[int, float]]:
    """Time a few training steps of the preset's model at 1 thread and at every core; the
    faster layout wins. Which one depends on the machine and its load, hence a measurement
    rather than a rule."""
    import torch

    from fibctl.model import FibLM
    from fibctl.device import keep_freed_memory

    keep_freed_memory()
    p = get_preset(preset)
    idx = torch.randint(0, p.model.vocab_size, (p.train.batch_size, p.model.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    timings = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        model = FibLM(dataclasses.replace(p.model, schedule="dense"))
        opt = torch.optim.AdamW(model.parameters(), lr=p.train.lr)
        times = []
        for i in range(steps + 2):  # two warm-up steps
            t0 = time.perf_counter()
            model(idx[:, :-1], idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        timings[threads] = 1e3 * statistics.median(times)
    return min(timings, key=timings.get), timings


def threads_line(timings: dict[int, float], threads: int) -> str:
    """The measurement and its choice on one 80-column line (wrapped, the chosen count was left
    alone on the next line)."""
    measured = ", ".join(f"{n} thread{'s' if n > 1 else ''} {ms:,.0f}" for n, ms in timings.items())
    return f"ms per training step: {measured}; training with {threads}"


def queue_demo(engine: Engine, p: DemoPlan) -> tuple[list[str], list[str]]:
    """Queue the `demo` matrix at the plan's preset (idempotent: finished runs stay done)."""
    return queue.add_runs(engine, load_matrix("demo").resolve(preset=p.preset))


def release_ended_workers(engine: Engine) -> list[str]:
    """Runs marked running by a worker of this machine whose process has ended (a demo killed,
    its terminal closed): queued again at once, where a heartbeat timeout would leave them
    running a minute and the demo go on without them. Returns their names."""
    with engine.connect() as conn:
        running = conn.execute(text("SELECT id, name, worker FROM runs WHERE status = 'running'")).all()
    released = []
    for run_id, name, worker in running:
        if queue.ended_here(engine, run_id, worker) and queue.release(
                engine, run_id, f"released: its worker {worker} on this machine has ended", worker=worker):
            released.append(name)
    return released


def still_running(engine: Engine) -> list[tuple[str, str]]:
    """(name, worker) of the demo's runs another live process is training."""
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(text(
            "SELECT name, worker FROM runs WHERE matrix = 'demo' AND status = 'running' ORDER BY id"))]


def runs_to_evaluate(engine: Engine, p: DemoPlan) -> list[str]:
    """Done runs that lack an evaluation (with per-position losses) at some demo length."""
    sql = text("""
        SELECT r.name FROM runs r
        WHERE r.status = 'done' AND r.matrix = 'demo' AND (
            (SELECT COUNT(DISTINCT e.eval_length) FROM evaluations e
             WHERE e.run_id = r.id AND e.step = r.final_step AND e.eval_length IN :lengths) < :n
            OR (SELECT COUNT(DISTINCT pl.eval_length) FROM position_losses pl
                WHERE pl.run_id = r.id AND pl.step = r.final_step AND pl.eval_length IN :lengths) < :n)
        ORDER BY r.id""").bindparams(bindparam("lengths", expanding=True))
    with engine.connect() as conn:
        return [row.name for row in conn.execute(sql, {"lengths": p.lengths, "n": len(p.lengths)})]


# The paper's length claim at the demo's scale, named once: the prose below is built from these.
DENSE_MIN_RISE = 10.0  # % rise of dense perplexity from 1x to 4x the training length
DENSE_OVER_SPARSE = 3.0  # dense's rise at least this many times the largest sparse change
SPARSE_MAX_CHANGE = 5.0  # % every sparse model stays within


@dataclass
class Headline:
    """The paper's length claim, checked on the demo's own numbers."""

    dense_change: float  # % change of dense perplexity from 1x to 4x
    sparse_change: dict[str, float]  # run -> % change 1x to 4x
    dense_best_at_1x: bool

    @property
    def largest_sparse(self) -> float:
        return max(abs(v) for v in self.sparse_change.values())

    @property
    def holds(self) -> bool:
        # the length claim alone, as the claim printed with it says: at the demo's scale the
        # ranking at 1x is a margin of about 1 % that one draw of the initial weights and
        # one corpus decide (README), so it is reported beside the verdict, not counted in it
        return (self.dense_change > DENSE_MIN_RISE
                and self.dense_change >= DENSE_OVER_SPARSE * self.largest_sparse
                and all(abs(v) <= SPARSE_MAX_CHANGE for v in self.sparse_change.values()))


def headline(engine: Engine, dataset: str, train_length: int) -> Headline:
    """Perplexity change 1x -> 4x per run, from the database."""
    df = pd.read_sql(text("""
        SELECT r.name, r.schedule, e.eval_length, e.ppl FROM runs r
        JOIN evaluations e ON e.run_id = r.id AND e.step = r.final_step
        WHERE r.matrix = 'demo' AND r.status = 'done' AND e.dataset = :dataset
          AND e.eval_length IN (:t, :t4)"""), engine,
        params={"dataset": dataset, "t": train_length, "t4": 4 * train_length})
    wide = df.pivot(index=["name", "schedule"], columns="eval_length", values="ppl").dropna().reset_index()
    if wide.empty or "dense" not in set(wide.schedule) or len(wide) < 2:
        raise FibctlError("the demo's runs lack evaluations at 1x and 4x; run `fibctl demo` again to finish them")
    wide["change"] = (wide[4 * train_length] / wide[train_length] - 1) * 100
    dense = wide[wide.schedule == "dense"].iloc[0]
    sparse = wide[wide.schedule != "dense"]
    return Headline(
        dense_change=float(dense.change),
        sparse_change={r.name: float(r.change) for r in sparse.itertuples()},
        dense_best_at_1x=bool(dense[train_length] <= sparse[train_length].min()),
    )


def describe(h: Headline) -> list[str]:
    """The verdict in plain words, from this run's numbers only."""
    worst = max(h.sparse_change, key=lambda k: abs(h.sparse_change[k]))
    claim = (f"dense > +{DENSE_MIN_RISE:g} %, >= {DENSE_OVER_SPARSE:g}x the largest sparse change, "
             f"every sparse model within {SPARSE_MAX_CHANGE:g} %")
    return [
        f"At 4x the training length the dense model's perplexity changed by {h.dense_change:+.1f} %; "
        f"the largest change among the sparse models was {h.sparse_change[worst]:+.1f} % ({worst}).",
        ("The dense model was the best at the training length." if h.dense_best_at_1x
         else "The dense model was NOT the best at the training length."),
        (f"The paper's headline holds at this scale ({claim})." if h.holds else
         f"The paper's headline does NOT hold in this run ({claim}); the effect grows with training, "
         "so train longer rather than loosen the thresholds."),
    ]


class DemoView(Protocol):
    """How the demo shows itself (the CLI draws it with rich; tests may ignore it)."""

    def section(self, title: str) -> None: ...

    def line(self, text: str) -> None: ...

    def warn(self, text: str) -> None: ...  # a line on why the demo stopped (stderr, beside errors)

    def table(self, table) -> None: ...  # a fibctl.reports.tables.Table

    def data_progress(self) -> AbstractContextManager: ...  # a progress for data.prepare.prepare

    def run_display(self, stop): ...  # a fibctl.flows.worker.Display; it sets `stop` if its reader goes

    def eval_progress(self) -> AbstractContextManager: ...  # its start and result: evaluate's on_start, on_result


def run_demo(out: Path, quick: bool, view: DemoView, stop_if_signalled: Callable[[], None]) -> int:
    """The whole pipeline: data, queue, training, evaluation, reports, the verdict. Returns the
    exit code: 0, 1 when a run failed, 128 + N when signal N stopped training (run it again to
    resume). `stop_if_signalled`, called between the steps, raises the exception of a signal
    whose own was lost where it landed (a callback of the garbage collector)."""
    from fibctl.data.prepare import prepare
    from fibctl.data.recipe import load_recipe
    from fibctl.db.engine import connect
    from fibctl.flows.evaluation import evaluate
    from fibctl.flows.worker import StopRequest, WorkerOptions, work
    from fibctl.reports import export, tables

    started = time.perf_counter()
    p = plan(quick)
    check_out_dir(out, p)
    data_dir, db = out / "data", str(out / "results.db")

    view.section(f"1/5 data: recipe {p.recipe!r} (documentation installed on this machine)")
    with view.data_progress() as progress:
        prepared = prepare(load_recipe(p.recipe), data_dir, progress)
    stop_if_signalled()
    view.line(f"data ready in {shown_path(data_dir)} ({'reused' if prepared.reused else 'built'})")

    view.section(f"2/5 queue: matrix 'demo' at preset {p.preset!r}")
    engine = connect(db)
    added, present = queue_demo(engine, p)
    view.line(f"{queue.added_line(added, present)} in {shown_path(db)}")
    released = release_ended_workers(engine)
    if released:
        view.line(f"queued again {', '.join(released)}: its worker, an earlier demo, has ended")

    view.section("3/5 train: one worker, runs one after the other")
    counts = queue.status_counts(engine)
    if not counts.get("queued") and not counts.get("running"):  # a finished demo run again: nothing to time
        threads = 1
        view.line("every run is trained already")
    else:
        threads, timings = fastest_threads(p.preset)
        view.line(threads_line(timings, threads))
    opts = WorkerOptions(data_dir=data_dir, runs_dir=out / "runs", threads=threads,
                         heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    stop = StopRequest()  # the worker's own: a signal checkpoints the run in training and stops
    outcomes = work(engine, opts, view.run_display(stop), stop=stop)
    if stop.signal is not None or any(o.status != "done" for o in outcomes):
        view.warn("training stopped before every run finished; run the same command again to resume "
                  "from the checkpoints")
        return 128 + stop.signal if stop.signal is not None else 1
    busy = still_running(engine)
    if busy:  # another demo, still alive, trains them: the tables would leave them out
        view.warn(f"{', '.join(f'{name} (worker {worker})' for name, worker in busy)} still training in another "
                  "process; run the same command again when it has finished")
        return 1
    stop_if_signalled()

    view.section(f"4/5 evaluate at lengths {', '.join(map(str, p.lengths))} (x1, x2, x4, x8), by position")
    names = runs_to_evaluate(engine, p)
    if names:
        with view.eval_progress() as progress:
            evaluate(engine, names, p.lengths, data_dir=data_dir, positions=True, on_start=progress.start,
                     on_result=progress.result)
    stop_if_signalled()
    others = len(added) + len(present) - len(names)
    view.line(f"evaluated {len(names)} run(s)" + (f"; {others} already evaluated" if others else ""))

    view.section("5/5 report")
    for table in (tables.table1(engine, matrix="demo", dense=True), tables.table3(engine, matrix="demo", all_runs=True),
                  tables.table4(engine, matrix="demo")):
        view.table(table)
    written, skipped = export.write_all(engine, out / "report", matrix="demo", source=export.made_from(db))
    view.line(f"wrote {len(written)} files of tables and figures to {shown_path(out / 'report')}/ "
              f"(skipped: {', '.join(n for n, _ in skipped) or 'none'}; all of them on one page: "
              f"{shown_path(out / 'report' / 'index.html')}); database: {shown_path(db)}")
    if quick:
        view.line("--quick: too little training for the length effect; run `fibctl demo` for the real thing.")
    else:
        for line in describe(headline(engine, tables.default_dataset(engine), p.train_length)):
            view.line(line)
    for line in _going_on(out):
        view.line(line)
    view.line(f"total time: {duration(time.perf_counter() - started)}")
    stop_if_signalled()
    return 0


def _going_on(out: Path) -> list[str]:
    """How to go on from the demo's folder in this shell: every other command reads results.db,
    data and runs from the current folder unless told (a first `fibctl queue ls` after the demo
    said there was no database). One setting a line, each short enough not to wrap."""
    return ["to go on from here (fibctl queue ls, compare, eval, queue add and worker):",
            *(f"  export {name}={shlex.quote(str(out / part))}" for name, part in
              (("FIBCTL_DB", "results.db"), ("FIBCTL_DATA", "data"), ("FIBCTL_RUNS_DIR", "runs")))]
