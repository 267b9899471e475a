"""Opening the results database: URL resolution, SQLite pragmas, schema upgrade on open."""

from __future__ import annotations

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url

from fibctl.db.schema import Base


def resolve_url(db: str) -> str:
    """A SQLAlchemy URL as given; a bare path means SQLite."""
    return db if "://" in db else f"sqlite:///{db}"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def connect(db: str, *, create: bool = True) -> Engine:
    """An engine on `db`, its schema brought to the latest revision when `create` is true."""
    url = resolve_url(db)
    engine = create_engine(url)
    if make_url(url).get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    if create:
        Base.metadata.create_all(engine)  # TODO(db issue): replaced by the Alembic upgrade
    return engine
