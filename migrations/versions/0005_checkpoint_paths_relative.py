"""Runs record the runs folder they trained in; checkpoint paths become relative to it.

`checkpoint_path` is now `RUN/step_N.pt`, resolved against the `--runs-dir` given, so a runs
folder can be named from any directory. `runs_dir` (absolute) is where the run last trained:
the folder `fibctl eval` looks in when no `--runs-dir` is given. Paths recorded before this
revision (absolute, or relative to the worker's directory) are kept as they are and still
resolve.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("runs_dir", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("runs_dir")
