"""Runs record what drew their training windows: `numpy` (numpy's legacy generator, as the
study drew them; fibctl's sampler since 2026-12-06) or `torch` (torch's generator, which
fibctl's sampler drew from before, and which a run resumed from a checkpoint of then keeps).
Runs of one seed drawn by the two read other windows, which the reports say.

The study's imported runs drew from numpy's generator: `numpy`. fibctl's own runs trained
before this revision keep NULL (not recorded): one trained either side of 2026-12-06, or
resumed across it, cannot be told from its row. The trainer sets it at each attempt.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("sampler", sa.String(20), nullable=True))
    # the study's probe models (preset probe) draw no windows: left NULL
    op.execute("UPDATE runs SET sampler = 'numpy' WHERE source <> 'fibctl' AND preset <> 'probe'")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("sampler")
