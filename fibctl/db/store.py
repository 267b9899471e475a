"""Writing a run's results. The training loop reports through `RunRecorder` only.

Every metric has a natural key (see schema.py); writing the same key again replaces the
old value. Replacement is a delete and an insert in one transaction, which works on any
database SQLAlchemy supports.

A write that the database refuses for a reason that can pass (a lock held past the busy
timeout, a full disk, a dropped connection) is tried again with growing pauses; past
`RETRY_DELAYS_S` it raises `DatabaseUnavailable`, and the worker checkpoints and requeues.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone

from sqlalchemy import Table, and_, delete, insert, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

from fibctl.db.schema import Alpha, AuxMetric, Evaluation, Event, PositionLoss, Run, RunStatus, TrainStep
from fibctl.errors import WorkerError

RETRY_DELAYS_S = (1, 2, 4, 8, 16)  # pauses between tries, each after the busy timeout has run out


class DatabaseUnavailable(WorkerError):
    """A write still failed after every retry."""


def write_retrying(engine: Engine, write: Callable[[Connection], object]):
    """`write(conn)` in one transaction, tried again after each pause of RETRY_DELAYS_S."""
    for delay in (*RETRY_DELAYS_S, None):
        try:
            with engine.begin() as conn:
                return write(conn)
        except OperationalError as e:
            if delay is None:
                reason = str(e.orig).strip().splitlines()[0] if str(e.orig).strip() else type(e.orig).__name__
                raise DatabaseUnavailable(f"the database refused writes {len(RETRY_DELAYS_S) + 1} times over "
                                          f"{sum(RETRY_DELAYS_S):g} s ({reason})") from None
            time.sleep(delay)


def utcnow() -> datetime:
    """The time every fibctl column holds: UTC, without a timezone (portable across dialects)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def replace_rows(conn: Connection, table: Table, key: dict, rows: list[dict]) -> None:
    """Delete the rows matching `key`, then insert `rows` (each extended with `key`)."""
    conn.execute(delete(table).where(and_(*(table.c[k] == v for k, v in key.items()))))
    if rows:
        conn.execute(insert(table), [{**key, **row} for row in rows])


def add_event(conn: Connection, run_id: int | None, kind: str, message: str | None = None,
              data: dict | None = None) -> None:
    conn.execute(insert(Event.__table__).values(run_id=run_id, time=utcnow(), kind=kind,
                                                message=message, data=data))


class RunRecorder:
    """Writes one run's metrics. With `worker`, `heartbeat` also checks the run is still ours."""

    def __init__(self, engine: Engine, run_id: int, worker: str | None = None):
        self.engine = engine
        self.run_id = run_id
        self.worker = worker

    def _replace(self, table: Table, key: dict, rows: list[dict]) -> None:
        write_retrying(self.engine, lambda conn: replace_rows(conn, table, {"run_id": self.run_id, **key}, rows))

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float | None = None,
                 tokens_per_s: float | None = None, elapsed_s: float | None = None) -> None:
        self._replace(TrainStep.__table__, {"step": step},
                      [dict(loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                            elapsed_s=elapsed_s)])

    def log_eval(self, step: int, dataset: str, eval_length: int, tokens: int, loss: float) -> None:
        """Mean next-token loss over `tokens` predicted tokens; perplexity is exp(loss)."""
        self._replace(Evaluation.__table__,
                      {"step": step, "dataset": dataset, "eval_length": eval_length},
                      [dict(tokens=tokens, loss=loss, ppl=math.exp(loss), created_at=utcnow())])

    def log_positions(self, step: int, dataset: str, eval_length: int, losses: Sequence[float],
                      windows: int) -> None:
        """Mean loss at each position (index = position), averaged over `windows` windows."""
        self._replace(PositionLoss.__table__,
                      {"step": step, "dataset": dataset, "eval_length": eval_length},
                      [dict(position=i, mean_loss=float(v), windows=windows)
                       for i, v in enumerate(losses)])

    def log_alphas(self, step: int, alphas: Sequence[float]) -> None:
        """alpha_l of every layer l (index = layer) at `step`."""
        self._replace(Alpha.__table__, {"step": step},
                      [dict(layer=i, alpha=float(a)) for i, a in enumerate(alphas)])

    def log_metric(self, name: str, metric: str, value: float | None = None,
                   text: str | dict | list | None = None) -> None:
        """An auxiliary metric; `text` may be a string or anything JSON can hold."""
        if text is not None and not isinstance(text, str):
            text = json.dumps(text)
        self._replace(AuxMetric.__table__, {"name": name, "metric": metric},
                      [dict(value=value, text=text)])

    def heartbeat(self) -> bool:
        """Mark the run alive. False when it is no longer running (cancelled, or taken over
        by another worker): the caller should stop."""
        cond = [Run.id == self.run_id, Run.status == RunStatus.RUNNING]
        if self.worker is not None:
            cond.append(Run.worker == self.worker)
        return write_retrying(self.engine, lambda conn: conn.execute(
            update(Run).where(*cond).values(heartbeat_at=utcnow())).rowcount == 1)

    def event(self, kind: str, message: str | None = None, data: dict | None = None) -> None:
        write_retrying(self.engine, lambda conn: add_event(conn, self.run_id, kind, message, data))

    def update_run(self, **columns) -> None:
        """Set columns of the run's row, e.g. params_total=..., tokens_trained=..."""
        unknown = set(columns) - set(Run.__table__.c.keys())
        if unknown:
            raise TypeError(f"runs has no column(s) {', '.join(sorted(unknown))}")
        write_retrying(self.engine, lambda conn: conn.execute(
            update(Run).where(Run.id == self.run_id).values(**columns)))
