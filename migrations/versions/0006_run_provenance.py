"""Runs record where and with what they trained: process id, fibctl version and git commit,
CUDA version, command line, and the hashes of the data and tokenizer they read (host, device
and torch version were already there). NULL for runs trained before this revision.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = (("pid", sa.Integer), ("fibctl_version", sa.String(50)), ("git_commit", sa.String(60)),
           ("cuda_version", sa.String(50)), ("command_line", sa.Text), ("data_hash", sa.String(64)),
           ("tokenizer_hash", sa.String(64)))


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for name, kind in COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        for name, _ in reversed(COLUMNS):
            batch.drop_column(name)
