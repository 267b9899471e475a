"""Runs record their training length and final step; the events table; report indexes.

`runs.train_length` is filled for existing runs from the `model.seq_len` of their
stored config.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("train_length", sa.Integer))
        batch.add_column(sa.Column("final_step", sa.Integer))

    runs = sa.table("runs", sa.column("id", sa.Integer), sa.column("config_json", sa.Text),
                    sa.column("train_length", sa.Integer))
    conn = op.get_bind()
    for run_id, config_json in conn.execute(sa.select(runs.c.id, runs.c.config_json)).all():
        length = json.loads(config_json)["model"]["seq_len"]
        conn.execute(runs.update().where(runs.c.id == run_id).values(train_length=length))

    with op.batch_alter_table("runs") as batch:
        batch.alter_column("train_length", existing_type=sa.Integer, nullable=False)
        batch.create_index("ix_runs_status_id", ["status", "id"])
        batch.create_index("ix_runs_matrix", ["matrix"])

    op.create_index("ix_evaluations_dataset_length", "evaluations", ["dataset", "eval_length"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id", ondelete="CASCADE")),
        sa.Column("time", sa.DateTime, nullable=False),
        sa.Column("kind", sa.String(50), nullable=False),
        sa.Column("message", sa.Text),
        sa.Column("data", sa.JSON),
    )
    op.create_index("ix_events_run_time", "events", ["run_id", "time"])


def downgrade() -> None:
    op.drop_index("ix_events_run_time", "events")
    op.drop_table("events")
    op.drop_index("ix_evaluations_dataset_length", "evaluations")
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_matrix")
        batch.drop_index("ix_runs_status_id")
        batch.drop_column("final_step")
        batch.drop_column("train_length")
