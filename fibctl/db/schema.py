"""The database schema. It is fibctl's public API: names are chosen for people writing SQL.

Every metric table has a natural key (a unique constraint) so that writing the same
metric twice replaces it instead of duplicating it.
"""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text, UniqueConstraint, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fibctl.db.stored import BigWhole, Number, Time, Whole, name_columns
from fibctl.errors import FibctlError

class RunStatus(str, enum.Enum):
    """Where a run is in the queue: queued -> running -> done | failed; cancelled by the user."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


RUN_STATUSES = tuple(s.value for s in RunStatus)


class Base(DeclarativeBase):
    pass


class Run(Base):
    """One training run: its identity, resolved config, queue state and outcome."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    matrix: Mapped[str] = mapped_column(String(100))
    preset: Mapped[str] = mapped_column(String(50))
    base: Mapped[str | None] = mapped_column(String(20))  # fib | pow2; NULL for dense
    schedule: Mapped[str] = mapped_column(String(20))  # dense | fixed | learned | stagger | coprime
    window: Mapped[int | None] = mapped_column(Whole)  # W; NULL for dense
    seed: Mapped[int] = mapped_column(BigWhole)  # the replicate seed the tables group by (= data_seed)
    init_seed: Mapped[int | None] = mapped_column(BigWhole)  # drew the initial weights; NULL: not recorded
    data_seed: Mapped[int | None] = mapped_column(BigWhole)  # drew the batches; NULL: not recorded
    train_length: Mapped[int] = mapped_column(Whole)  # sequence length T it trains at
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(20), default=RunStatus.QUEUED.value)
    attempts: Mapped[int] = mapped_column(Whole, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    host: Mapped[str | None] = mapped_column(String(200))
    device: Mapped[str | None] = mapped_column(String(100))
    torch_version: Mapped[str | None] = mapped_column(String(50))
    # where and with what it last trained (recorded at each claim; see fibctl/provenance.py)
    pid: Mapped[int | None] = mapped_column(Whole)
    fibctl_version: Mapped[str | None] = mapped_column(String(50))
    git_commit: Mapped[str | None] = mapped_column(String(60))  # +dirty: uncommitted changes
    cuda_version: Mapped[str | None] = mapped_column(String(50))
    command_line: Mapped[str | None] = mapped_column(Text)
    data_hash: Mapped[str | None] = mapped_column(String(64))  # the data's content hash (DataManifest.data_hash)
    tokenizer_hash: Mapped[str | None] = mapped_column(String(64))
    optimizer: Mapped[str | None] = mapped_column(String(20))  # actually used (config_json: requested)
    # what drew its training windows: numpy (the study's) | torch (fibctl before 2026-12-06);
    # NULL: not recorded (trained before revision 0009, or a probe run, which draws no windows)
    sampler: Mapped[str | None] = mapped_column(String(20))
    heartbeat_at: Mapped[datetime | None] = mapped_column(Time)
    created_at: Mapped[datetime] = mapped_column(Time)
    started_at: Mapped[datetime | None] = mapped_column(Time)
    finished_at: Mapped[datetime | None] = mapped_column(Time)
    wall_seconds: Mapped[float | None] = mapped_column(Number)
    params_total: Mapped[int | None] = mapped_column(BigWhole)
    params_non_embedding: Mapped[int | None] = mapped_column(BigWhole)
    tokens_trained: Mapped[int | None] = mapped_column(BigWhole)
    final_step: Mapped[int | None] = mapped_column(Whole)
    error: Mapped[str | None] = mapped_column(Text)
    checkpoint_path: Mapped[str | None] = mapped_column(Text)  # RUN/step_N.pt, under the runs folder
    runs_dir: Mapped[str | None] = mapped_column(Text)  # the runs folder it last trained in: eval's default
    source: Mapped[str] = mapped_column(String(100), default="fibctl")  # or the imported file

    __table_args__ = (
        Index("ix_runs_status_id", "status", "id"),
        Index("ix_runs_matrix", "matrix"),
    )


class TrainStep(Base):
    """Training metrics logged every `log_interval` steps."""

    __tablename__ = "train_steps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Whole)
    loss: Mapped[float] = mapped_column(Number)
    lr: Mapped[float] = mapped_column(Number)
    grad_norm: Mapped[float | None] = mapped_column(Number)
    tokens_per_s: Mapped[float | None] = mapped_column(Number)
    elapsed_s: Mapped[float | None] = mapped_column(Number)

    __table_args__ = (UniqueConstraint("run_id", "step", name="uq_train_steps_run_step"),)


class Evaluation(Base):
    """Perplexity of one run at one step on one held-out set at one evaluation length."""

    __tablename__ = "evaluations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Whole)
    dataset: Mapped[str] = mapped_column(String(100))
    eval_length: Mapped[int] = mapped_column(Whole)
    tokens: Mapped[int | None] = mapped_column(BigWhole)  # predicted tokens the mean is over; NULL: unknown
    loss: Mapped[float] = mapped_column(Number)  # mean next-token cross-entropy, nats
    ppl: Mapped[float] = mapped_column(Number)  # exp(loss)
    created_at: Mapped[datetime | None] = mapped_column(Time)

    __table_args__ = (
        UniqueConstraint("run_id", "step", "dataset", "eval_length", name="uq_evaluations_key"),
        Index("ix_evaluations_dataset_length", "dataset", "eval_length"),
    )


class PositionLoss(Base):
    """Mean next-token loss at one position of the window, averaged over `windows` windows."""

    __tablename__ = "position_losses"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Whole)
    dataset: Mapped[str] = mapped_column(String(100))
    eval_length: Mapped[int] = mapped_column(Whole)
    position: Mapped[int] = mapped_column(Whole)  # 0-based index of the predicted token
    mean_loss: Mapped[float] = mapped_column(Number)
    windows: Mapped[int] = mapped_column(Whole)

    __table_args__ = (
        UniqueConstraint("run_id", "step", "dataset", "eval_length", "position",
                         name="uq_position_losses_key"),
    )


class Alpha(Base):
    """The per-layer scale alpha_l of a run at a step (learned: a trajectory; static: once)."""

    __tablename__ = "alphas"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Whole)
    layer: Mapped[int] = mapped_column(Whole)
    alpha: Mapped[float] = mapped_column(Number)

    __table_args__ = (UniqueConstraint("run_id", "step", "layer", name="uq_alphas_key"),)


class AuxMetric(Base):
    """Anything else measured about a run: throughput, probes, auxiliary evaluations.

    `name` groups metrics (e.g. 'speed@4096', 'lambada', 'probe'), `metric` names the value
    ('tokens_per_s', 'accuracy'); `text` holds a JSON payload where a number is not enough.
    """

    __tablename__ = "aux_metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(100))
    metric: Mapped[str] = mapped_column(String(100))
    value: Mapped[float | None] = mapped_column(Number)
    text: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (UniqueConstraint("run_id", "name", "metric", name="uq_aux_metrics_key"),)


class Event(Base):
    """What happened to a run (claimed, resumed, checkpointed, failed, ...), in order."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(Time)
    kind: Mapped[str] = mapped_column(String(50))
    message: Mapped[str | None] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)

    __table_args__ = (Index("ix_events_run_time", "run_id", "time"),)


# Number and time columns check what SQLite hands back (fibctl/db/stored.py); NUMBERS types a
# report's columns by name, its SQL being text
NUMBERS = name_columns(Base.metadata)


def check_tables(engine: Engine, shown_db: str) -> None:
    """Refuse a database whose tables or columns are not all fibctl's, in one line, before
    it is read: changed by hand, it failed mid-query with a traceback. A view in a table's
    place is no table (a crafted one of endless rows held `db copy` in SQLite's C code, which
    even Ctrl-C does not stop)."""
    found = inspect(engine)
    tables = set(found.get_table_names())
    missing = [f"table {t.name}" for t in Base.metadata.sorted_tables if t.name not in tables]
    missing += [f"column {t.name}.{c}" for t in Base.metadata.sorted_tables if t.name in tables
                for c in sorted(set(t.columns.keys()) - {c["name"] for c in found.get_columns(t.name)})]
    if missing:
        raise FibctlError(f"{shown_db} lacks {', '.join(missing)}: it was changed outside fibctl; "
                          "restore it from a copy")
