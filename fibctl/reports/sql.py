"""Read-only SQL on the results database (`fibctl sql`).

Writes are refused by the database connection itself (`fibctl.db.engine.connect_readonly`:
SQLite `mode=ro`, PostgreSQL read-only transactions), never by inspecting the statement.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy.exc import DBAPIError, ResourceClosedError

from fibctl.db.engine import connect_readonly
from fibctl.errors import FibctlError


def run_query(db: str, sql: str) -> pd.DataFrame:
    """Run one SQL statement read-only and return its rows (an empty frame if it returns none)."""
    engine = connect_readonly(db)
    try:
        with engine.connect() as conn:
            result = conn.exec_driver_sql(sql)  # as written: no bind-parameter parsing
            try:
                return pd.DataFrame(result.fetchall(), columns=list(result.keys()))
            except ResourceClosedError:  # a statement that returns no rows
                return pd.DataFrame()
    except DBAPIError as e:
        raise FibctlError(_sql_error(e)) from None
    finally:
        engine.dispose()


def _sql_error(e: DBAPIError) -> str:
    msg = str(e.orig).strip().splitlines()[0]
    if "readonly" in msg.replace("-", "").replace(" ", "").lower():
        return f"refused: the database is opened read-only, nothing was written ({msg})"
    return f"SQL error: {msg}"
