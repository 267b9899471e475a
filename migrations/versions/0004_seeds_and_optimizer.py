"""Runs record their two seeds and the optimizer they trained with.

`init_seed` draws the initial weights, `data_seed` everything after (the batches); `seed`
stays the replicate seed the tables group by (equal to `data_seed` for fibctl's runs).
`optimizer` is the one actually used, which can differ from the config's on a machine
where bitsandbytes' 8-bit AdamW cannot run. Rows written before this revision had one seed
for both and trained with torch's AdamW: they are filled in accordingly.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("init_seed", sa.Integer, nullable=True))
        batch.add_column(sa.Column("data_seed", sa.Integer, nullable=True))
        batch.add_column(sa.Column("optimizer", sa.String(20), nullable=True))
    # fibctl's own runs seeded everything with `seed`; imported runs keep NULL (not recorded)
    op.execute("UPDATE runs SET init_seed = seed, data_seed = seed WHERE source = 'fibctl'")
    op.execute("UPDATE runs SET optimizer = 'adamw' WHERE source = 'fibctl' AND attempts > 0")


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("optimizer")
        batch.drop_column("data_seed")
        batch.drop_column("init_seed")
