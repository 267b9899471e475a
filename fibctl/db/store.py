"""Writing a run's results. The training loop reports through `RunRecorder` only.

Every metric has a natural key (a unique constraint, see schema.py); writing the same key
again replaces the old value. `upsert` is the one way rows are written by key, here and by
the study importer (SQLite's and PostgreSQL's INSERT ... ON CONFLICT); `run_row` is the one
place a `runs` row is built from a config, for the queue and the importer alike.

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

from sqlalchemy import Table, UniqueConstraint, and_, delete, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

from fibctl.db.engine import shown
from fibctl.db.schema import Alpha, AuxMetric, Evaluation, Event, PositionLoss, Run, RunStatus, TrainStep
from fibctl.config import RunConfig
from fibctl.errors import FibctlError, WorkerError

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
                # the database as given, noted by its engine (a worker's log may serve several)
                named = f"the database {shown(e.database)}" if hasattr(e, "database") else "the database"
                raise DatabaseUnavailable(f"{named} refused writes {len(RETRY_DELAYS_S) + 1} times over "
                                          f"{sum(RETRY_DELAYS_S):g} s ({reason})") from None
            time.sleep(delay)


def utcnow() -> datetime:
    """The time every fibctl column holds: UTC, without a timezone (portable across dialects)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def natural_key(table: Table) -> tuple[str, ...]:
    """The columns of the table's unique constraint."""
    return next(tuple(c.name for c in k.columns) for k in table.constraints if isinstance(k, UniqueConstraint))


def upsert(conn: Connection, table: Table, rows: list[dict], keys: tuple[str, ...] | None = None,
           replace: bool = True) -> int:
    """Insert rows by natural key; an existing row is updated where a value differs (or, with
    replace=False, kept). Returns the rows written or changed."""
    if not rows:
        return 0
    keys = keys or natural_key(table)
    dialect = conn.dialect.name
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        raise FibctlError(f"fibctl writes results to SQLite or PostgreSQL, not {dialect}")
    stmt = dialect_insert(table)
    values = [c for c in rows[0] if c not in keys]
    if replace and values:  # an existing row is rewritten only where a value differs: counted as changed
        stmt = stmt.on_conflict_do_update(
            index_elements=list(keys), set_={c: stmt.excluded[c] for c in values},
            where=or_(*(table.c[c].is_distinct_from(stmt.excluded[c]) for c in values)))
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(keys))
    # RETURNING counts the rows inserted or changed on every driver (executemany's rowcount
    # is not reliable on psycopg)
    stmt = stmt.returning(table.c[keys[0]])
    written = 0
    for start in range(0, len(rows), 5000):
        written += len(conn.execute(stmt, rows[start:start + 5000]).all())
    return written


def run_row(cfg: RunConfig, **columns) -> dict:
    """The `runs` row of a config: its identity and settings, queued by default; `columns`
    override (an imported run: done, its source, its seeds as recorded)."""
    dense = cfg.model.schedule == "dense"
    return dict(
        name=cfg.name, matrix=cfg.matrix, preset=cfg.preset,
        base=None if dense else cfg.model.base, schedule=cfg.model.schedule,
        window=None if dense else cfg.model.window, seed=cfg.seed, init_seed=cfg.init_seed,
        data_seed=cfg.data_seed, train_length=cfg.model.seq_len, config_json=cfg.to_json(),
        config_hash=cfg.config_hash, status=RunStatus.QUEUED, attempts=0, created_at=utcnow(),
        source="fibctl",
    ) | columns


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

    def _replace(self, *sets: tuple[Table, dict, list[dict]]) -> None:
        """For each (table, key, rows), the rows under `key` become `rows` (a shorter set of
        positions drops the rest); all of them in one transaction."""
        def write(conn: Connection) -> None:
            for table, key, rows in sets:
                key = {"run_id": self.run_id, **key}
                conn.execute(delete(table).where(and_(*(table.c[k] == v for k, v in key.items()))))
                upsert(conn, table, [{**key, **row} for row in rows])
        write_retrying(self.engine, write)

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float | None = None,
                 tokens_per_s: float | None = None, elapsed_s: float | None = None,
                 mfu: float | None = None) -> None:
        # mfu is not stored: the run's config, its device and tokens_per_s give it (fibctl.flops)
        self._replace((TrainStep.__table__, {"step": step},
                       [dict(loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s,
                             elapsed_s=elapsed_s)]))

    def log_eval(self, step: int, dataset: str, eval_length: int, tokens: int, loss: float,
                 positions: Sequence[float] | None = None, windows: int | None = None) -> None:
        """Mean next-token loss over `tokens` predicted tokens; perplexity is exp(loss). With
        `positions`, the mean loss at each position (index = position) over `windows` windows,
        written in the same transaction: a kill between them cannot pair this perplexity with
        an earlier evaluation's positions."""
        key = {"step": step, "dataset": dataset, "eval_length": eval_length}
        sets = [(Evaluation.__table__, key,
                 [dict(tokens=tokens, loss=loss, ppl=math.exp(loss), created_at=utcnow())])]
        if positions is not None:
            sets.append((PositionLoss.__table__, key,
                         [dict(position=i, mean_loss=float(v), windows=windows) for i, v in enumerate(positions)]))
        self._replace(*sets)

    def log_alphas(self, step: int, alphas: Sequence[float]) -> None:
        """alpha_l of every layer l (index = layer) at `step`."""
        self._replace((Alpha.__table__, {"step": step},
                       [dict(layer=i, alpha=float(a)) for i, a in enumerate(alphas)]))

    def history(self, upto: int) -> list[tuple[int, str, dict]]:
        """The run's recorded steps, evaluations and alphas up to step `upto`, as (step, kind,
        fields), each kind's fields named as its log_ call names them (kind "step": loss, lr,
        grad_norm, tokens_per_s; "eval": dataset, eval_length, tokens, loss; "alphas": alphas):
        what a metric back-end attached late, or one that lost an attempt, is sent again."""
        with self.engine.connect() as conn:
            def rows(table: Table, *columns: str):
                return conn.execute(select(*(table.c[c] for c in ("step", *columns))).where(
                    table.c.run_id == self.run_id, table.c.step <= upto)).all()

            out = [(step, "step", dict(loss=loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tps))
                   for step, loss, lr, grad_norm, tps in rows(TrainStep.__table__, "loss", "lr", "grad_norm",
                                                              "tokens_per_s")]
            out += [(step, "eval", dict(dataset=dataset, eval_length=length, tokens=tokens, loss=loss))
                    for step, dataset, length, tokens, loss in rows(Evaluation.__table__, "dataset",
                                                                    "eval_length", "tokens", "loss")]
            alphas: dict[int, dict[int, float]] = {}
            for step, layer, alpha in rows(Alpha.__table__, "layer", "alpha"):
                alphas.setdefault(step, {})[layer] = alpha
        out += [(step, "alphas", dict(alphas=[by_layer[i] for i in sorted(by_layer)]))
                for step, by_layer in alphas.items()]
        return sorted(out, key=lambda row: row[0])

    def log_metric(self, name: str, metric: str, value: float | None = None,
                   text: str | dict | list | None = None) -> None:
        """An auxiliary metric; `text` may be a string or anything JSON can hold."""
        if text is not None and not isinstance(text, str):
            text = json.dumps(text)
        self._replace((AuxMetric.__table__, {"name": name, "metric": metric}, [dict(value=value, text=text)]))

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
        # a worker's writes stop once the run is no longer its own (see heartbeat)
        cond = [Run.id == self.run_id] + ([Run.status == RunStatus.RUNNING, Run.worker == self.worker]
                                          if self.worker is not None else [])
        write_retrying(self.engine, lambda conn: conn.execute(update(Run).where(*cond).values(**columns)))
