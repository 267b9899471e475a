"""`evaluations.tokens` may be NULL: imported results that never recorded their token count.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.alter_column("tokens", existing_type=sa.Integer, nullable=True)


def downgrade() -> None:
    with op.batch_alter_table("evaluations") as batch:
        batch.alter_column("tokens", existing_type=sa.Integer, nullable=False)
