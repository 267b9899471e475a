"""Seeds, parameter counts and token counts become 64-bit integers.

PostgreSQL's INTEGER is 32-bit: a seed from 2**31 (fibctl takes seeds up to 2**32 - 1, as
numpy does), a model of over 2**31 parameters (the study's open question is larger models)
or a run of over 2**31 tokens trained (the `paper` recipe past about 65,000 steps) could not
be recorded there. SQLite's INTEGER was 64-bit already; its tables are rebuilt with the new
declared type, their rows kept.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

WIDE = {"runs": ("seed", "init_seed", "data_seed", "params_total", "params_non_embedding", "tokens_trained"),
        "evaluations": ("tokens",)}
NOT_NULL = {"seed"}


def _retype(to, frm) -> None:
    for table, columns in WIDE.items():
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.alter_column(column, type_=to, existing_type=frm, existing_nullable=column not in NOT_NULL)


def upgrade() -> None:
    _retype(sa.BigInteger(), sa.Integer())


def downgrade() -> None:
    _retype(sa.Integer(), sa.BigInteger())
