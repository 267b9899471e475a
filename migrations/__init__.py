"""Alembic migrations of the results database, shipped as the package `fibctl.migrations`.

Run them through `fibctl db upgrade` or `fibctl.db.engine.upgrade`; there is no alembic.ini.
To write a new revision after changing `fibctl/db/schema.py`:

    from alembic import command
    from fibctl.db.engine import alembic_config, connect
    engine = connect("dev.db")  # a database at the current head
    with engine.begin() as conn:
        command.revision(alembic_config(conn), "what changed", autogenerate=True)
"""
