"""`fibctl bench queue`: how fast workers claim runs, against a plain claim loop measured in
the same run, on SQLite or on a PostgreSQL server.

The benchmark works in a scratch database of its own (a temporary SQLite file, or a
database it creates on the PostgreSQL server and drops afterwards), queues `runs` `micro`
runs and claims them all with `queue.claim_next` (the transaction, the abandoned-run sweep
and reclaim check and the `claimed` event included) and with a bare `UPDATE ... RETURNING`
of the next queued row: each first by one process alone (what a claim costs, uncontended),
then by `processes` processes at once (throughput, and the worst process's time per claim
under contention). Both costs are put beside one training step of the `micro` preset,
measured in the same run: a claim should never cost more than 1 % of it.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Empty

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from fibctl import queue
from fibctl.config import RunConfig
from fibctl.db.engine import connect, resolve_url, shown
from fibctl.errors import FibctlError, first_line

# Each claiming process is a fork with a connection of its own; past these the benchmark would
# take the machine's memory (or the server's connections) rather than measure claims
MAX_PROCESSES = 256
MAX_RUNS = 1_000_000  # queued before the timing: some 0.4 GB of configs, resolved in about 12 s


@dataclass
class QueueBench:
    backend: str
    processes: int
    runs: int
    solo_claim_ms: float  # one claim by fibctl, one process alone
    solo_plain_ms: float  # one bare UPDATE ... RETURNING claim, one process alone
    claims_per_s: float  # fibctl's claim, `processes` at once
    plain_per_s: float  # a bare UPDATE ... RETURNING loop, `processes` at once
    claim_ms: float  # one claim as the slowest of the `processes` saw it
    step_ms: float  # one `micro` training step, same machine, same run

    @property
    def ratio(self) -> float:
        return self.claims_per_s / self.plain_per_s

    @property
    def solo_ratio(self) -> float:
        """Plain over fibctl cost per claim: like `ratio`, 1 means as fast as the plain loop."""
        return self.solo_plain_ms / self.solo_claim_ms

    @property
    def solo_vs_step(self) -> float:
        return self.solo_claim_ms / self.step_ms

    @property
    def claim_vs_step(self) -> float:
        return self.claim_ms / self.step_ms


@contextmanager
def scratch_database(db: str | None):
    """A fresh database URL on `db`'s PostgreSQL server (a temporary SQLite file when `db` is None)."""
    url = resolve_url(db) if db is not None else None
    if url is not None and url.get_backend_name() not in ("sqlite", "postgresql"):
        raise FibctlError(f"bench queue runs on SQLite or PostgreSQL, not {shown(db)}")
    if url is not None and url.get_backend_name() == "sqlite":
        # SQLite is benchmarked in a temporary file: a path given would be ignored
        raise FibctlError(f"--db {shown(db)}: bench queue takes --db for a PostgreSQL server only; on SQLite "
                          "it benchmarks a temporary file (leave --db out)")
    if url is None:
        with tempfile.TemporaryDirectory() as folder:
            yield str(Path(folder) / "bench.db")
        return
    name = f"fibctl_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as e:
        admin.dispose()
        raise FibctlError(f"cannot create a scratch database on {shown(db)}: "
                          f"{(str(getattr(e, 'orig', e)).strip().splitlines() or ['?'])[0]}") from None
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def sigint_left_to_parent() -> Iterator[None]:
    """Start child processes inside: each starts with SIGINT ignored (a disposition that fork
    and exec both keep, and Python's start-up leaves as it is), so that a Ctrl-C, which the
    terminal sends to every process of the command, cannot raise a KeyboardInterrupt in one
    (its traceback printed by multiprocessing, or by the spawn bootstrap while it imports
    torch) before the code it runs could catch it. The Ctrl-C is this process's: it stops the
    children (stop_children). One that comes while a child is being started, a few
    milliseconds, is lost. Shared with `bench train|probe` (bench.in_fresh_process); here
    because this module imports no torch, which the claiming processes forked here do without."""
    previous = signal.getsignal(signal.SIGINT)
    # a handler only the main thread may set; None: one set outside Python, which could not be put back
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_children(processes: Iterable[mp.process.BaseProcess], grace_s: float = 5.0) -> None:
    """End the started ones of `processes` still running (SIGTERM, then SIGKILL after
    `grace_s`) and reap them all: a Ctrl-C or an error in this process leaves none behind."""
    started = [p for p in processes if p.pid is not None]
    for p in started:
        if p.exitcode is None:
            p.terminate()
    for p in started:
        p.join(grace_s)
        if p.exitcode is None:
            p.kill()
            p.join()


def _claimer(db: str, plain: bool, barrier, results) -> None:
    # forked: SIGINT ignored from the start (sigint_left_to_parent), and SIGTERM (stop_children) ends
    # the process at once, not through the command's handler, which would wait out an SQLite busy wait
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        engine = connect(db)
        engine.connect().close()  # the pool keeps it: opening it is not part of a claim
        barrier.wait()
        claim = (lambda: _plain_claim(engine)) if plain else (lambda: queue.claim_next(engine, "bench") is not None)
        count, started = 0, time.perf_counter()
        while claim():
            count += 1
        results.put((count, time.perf_counter() - started))
    except threading.BrokenBarrierError:  # another process failed: its reason is the one to give
        results.put(None)
    except Exception as e:  # a connection refused (too many clients): a traceback per process, the others waiting
        barrier.abort()
        results.put(first_line(e, 300))


def _plain_claim(engine) -> bool:
    lock = " FOR UPDATE SKIP LOCKED" if engine.dialect.name == "postgresql" else ""
    with engine.begin() as conn:  # on SQLite fibctl's engine begins IMMEDIATE, as claim_next does
        row = conn.execute(text(
            "UPDATE runs SET status = 'running' WHERE id = (SELECT id FROM runs WHERE status = 'queued' "
            f"ORDER BY id LIMIT 1{lock}) RETURNING id")).first()
    return row is not None


def _claim_all(db: str, processes: int, plain: bool) -> tuple[float, float]:
    """Claims per second over all processes, and seconds per claim within one process."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(db, plain, barrier, results)) for _ in range(processes)]
    try:
        started = time.perf_counter()
        with sigint_left_to_parent():
            for p in procs:
                p.start()
        outcomes = [_outcome(results, procs) for _ in procs]
        wall = time.perf_counter() - started
        failed = next((o for o in outcomes if isinstance(o, str)), None)
        if failed is not None or None in outcomes:
            raise FibctlError(f"bench queue: a claiming process failed: {failed or 'it ended without a word'}")
        for p in procs:
            p.join(60)
    finally:  # after a Ctrl-C here (or a failure) the claiming processes, which ignore it, are ended
        stop_children(procs)
    claims = sum(n for n, _ in outcomes)
    per_claim = max(s / n for n, s in outcomes if n) if claims else float("nan")
    return claims / wall, per_claim


def _outcome(results, procs: list[mp.process.BaseProcess]):
    """The next process's outcome; a process that died without one (killed) would be waited for
    forever, the others at the barrier with it."""
    while True:
        try:
            return results.get(timeout=1)
        except Empty:
            dead = next((p for p in procs if p.exitcode not in (None, 0)), None)
            if dead is not None:
                raise FibctlError(f"bench queue: a claiming process ended with exit code {dead.exitcode} "
                                  "before it was done") from None


def _micro_step_ms() -> float:
    """One `micro` training step as `fibctl bench train` times it (the trainer's recipe)."""
    from fibctl.flows.bench import _measure_train, train_bench

    return _measure_train(train_bench("micro", steps=5, warmup=1), "fixed")["step_ms"]


def bench_queue(db: str | None = None, processes: int = 8, runs: int = 400) -> QueueBench:
    if processes < 1 or runs < processes:
        raise FibctlError(f"--processes must be >= 1 and --runs at least as many (got {processes}, {runs})")
    if processes > MAX_PROCESSES or runs > MAX_RUNS:
        raise FibctlError(f"--processes and --runs are at most {MAX_PROCESSES} and {MAX_RUNS:,} "
                          f"(got {processes:,}, {runs:,})")
    configs = [RunConfig.resolve(f"bench{i:05d}", "bench", "micro", schedule="fixed") for i in range(runs)]
    with scratch_database(db) as scratch:
        engine = connect(scratch)
        backend = engine.dialect.name
        queue.add_runs(engine, configs)
        measured = {}
        for plain in (False, True):
            for n in sorted({1, processes}):
                with engine.begin() as conn:  # every pass claims the whole queue
                    conn.execute(text("UPDATE runs SET status = 'queued'"))
                measured[plain, n] = _claim_all(scratch, n, plain)
        engine.dispose()
    (_, solo), (_, solo_plain) = measured[False, 1], measured[True, 1]
    rate, per_claim = measured[False, processes]
    plain_rate, _ = measured[True, processes]
    return QueueBench(backend, processes, runs, 1e3 * solo, 1e3 * solo_plain, rate, plain_rate,
                      1e3 * per_claim, _micro_step_ms())
