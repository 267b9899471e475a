"""Alembic environment: runs migrations on the connection `fibctl.db.engine` passes in.

Batch mode lets SQLite, which cannot alter most column properties in place, rebuild
tables instead. The caller owns the transaction, so a failed upgrade leaves nothing behind.
"""

from alembic import context

from fibctl.db.schema import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("fibctl migrations run through fibctl.db.engine.upgrade, which passes a connection")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,
    transactional_ddl=True,
)
with context.begin_transaction():
    context.run_migrations()
