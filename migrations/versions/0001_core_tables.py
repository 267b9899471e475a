"""Core tables: runs and the metric tables, each metric with its natural key.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _run_fk() -> sa.Column:
    return sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("matrix", sa.String(100), nullable=False),
        sa.Column("preset", sa.String(50), nullable=False),
        sa.Column("base", sa.String(20)),
        sa.Column("schedule", sa.String(20), nullable=False),
        sa.Column("window", sa.Integer),
        sa.Column("seed", sa.Integer, nullable=False),
        sa.Column("config_json", sa.Text, nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("worker", sa.String(200)),
        sa.Column("host", sa.String(200)),
        sa.Column("device", sa.String(100)),
        sa.Column("torch_version", sa.String(50)),
        sa.Column("heartbeat_at", sa.DateTime),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("started_at", sa.DateTime),
        sa.Column("finished_at", sa.DateTime),
        sa.Column("wall_seconds", sa.Float),
        sa.Column("params_total", sa.Integer),
        sa.Column("params_non_embedding", sa.Integer),
        sa.Column("tokens_trained", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("checkpoint_path", sa.Text),
        sa.Column("source", sa.String(100), nullable=False),
    )
    op.create_table(
        "train_steps",
        sa.Column("id", sa.Integer, primary_key=True),
        _run_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float, nullable=False),
        sa.Column("lr", sa.Float, nullable=False),
        sa.Column("grad_norm", sa.Float),
        sa.Column("tokens_per_s", sa.Float),
        sa.Column("elapsed_s", sa.Float),
        sa.UniqueConstraint("run_id", "step", name="uq_train_steps_run_step"),
    )
    op.create_table(
        "evaluations",
        sa.Column("id", sa.Integer, primary_key=True),
        _run_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("dataset", sa.String(100), nullable=False),
        sa.Column("eval_length", sa.Integer, nullable=False),
        sa.Column("tokens", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float, nullable=False),
        sa.Column("ppl", sa.Float, nullable=False),
        sa.Column("created_at", sa.DateTime),
        sa.UniqueConstraint("run_id", "step", "dataset", "eval_length", name="uq_evaluations_key"),
    )
    op.create_table(
        "position_losses",
        sa.Column("id", sa.Integer, primary_key=True),
        _run_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("dataset", sa.String(100), nullable=False),
        sa.Column("eval_length", sa.Integer, nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("mean_loss", sa.Float, nullable=False),
        sa.Column("windows", sa.Integer, nullable=False),
        sa.UniqueConstraint("run_id", "step", "dataset", "eval_length", "position",
                            name="uq_position_losses_key"),
    )
    op.create_table(
        "alphas",
        sa.Column("id", sa.Integer, primary_key=True),
        _run_fk(),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("layer", sa.Integer, nullable=False),
        sa.Column("alpha", sa.Float, nullable=False),
        sa.UniqueConstraint("run_id", "step", "layer", name="uq_alphas_key"),
    )
    op.create_table(
        "aux_metrics",
        sa.Column("id", sa.Integer, primary_key=True),
        _run_fk(),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("metric", sa.String(100), nullable=False),
        sa.Column("value", sa.Float),
        sa.Column("text", sa.Text),
        sa.UniqueConstraint("run_id", "name", "metric", name="uq_aux_metrics_key"),
    )


def downgrade() -> None:
    for table in ("aux_metrics", "alphas", "position_losses", "evaluations", "train_steps", "runs"):
        op.drop_table(table)
