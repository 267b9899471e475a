"""Read-only SQL on the results database (`fibctl sql`).

Writes are refused by the database connection itself (`fibctl.db.engine.connect_readonly`:
SQLite `mode=ro`, PostgreSQL read-only transactions), never by inspecting the statement. On
PostgreSQL a login that may reach the server's files (a superuser) is refused: a statement
can take such a role back whatever fibctl sets.
A read-only SQLite connection can still create files (`ATTACH`, `VACUUM INTO`) and use
unbounded memory and time, so the statement also runs under an authorizer that allows
reading only, a deadline (`timeout_s`), a heap limit, and a cap on the rows fetched.
"""

from __future__ import annotations

import fnmatch
import math
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain

from fibctl.lazy import pandas as pd
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, ProgrammingError, ResourceClosedError

from fibctl.db import schema
from fibctl.db.engine import BUSY_TIMEOUT_MS, connect_readonly, shown
from fibctl.errors import FibctlError, printable

MAX_ROWS = 100_000
MAX_ROWS_LIMIT = 10**9  # the driver fetches a C int's worth of rows at most (2**31 - 1)
TIMEOUT_S = 60.0
TIMEOUT_LIMIT_S = 2_000_000  # PostgreSQL's statement_timeout is a 32-bit count of milliseconds
MAX_RESULT_BYTES = 64 << 20  # text and bytes printed by one statement: a 1 GB value took hours to print
# what `fibctl sql --format table` draws at most (rich's table is drawn whole: seconds at these)
TABLE_MAX_VALUES = 50_000
TABLE_MAX_CHARACTERS = 1 << 20
FETCH_ROWS = 1_000  # rows fetched at a time at most (fewer where they are large)
HEAP_LIMIT_BYTES = 1 << 30  # SQLite's own memory for one statement (sorts, CTE queues)
PROGRESS_OPS = 10_000  # SQLite virtual-machine steps between deadline checks
OUT_OF_MEMORY = f"stopped: the statement needed more than {HEAP_LIMIT_BYTES >> 20} MiB; add a LIMIT or a tighter WHERE"

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# PRAGMAs that take an argument yet only read; any other PRAGMA with an argument sets something
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                 "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check", "collation_list",
                 "function_list", "pragma_list"}
_SCHEMA_TABLES = {"sqlite_master", "sqlite_schema", "sqlite_temp_master", "sqlite_temp_schema"}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit"}


# what a --matrix, --dataset, --run or --only (a glob) names: (table, column, what a row of it is)
NAMED = {"matrix": ("runs", "matrix", "runs of that matrix"), "dataset": ("evaluations", "dataset",
          "evaluations on that set"), "run": ("runs", "name", "run of that name"),
         "only": ("runs", "name", "run whose name matches that glob")}


def open_for_reports(db: str, option: str = "--db", **named: str | None) -> Engine:
    """`db` read-only, checked so that a report fails in one line before anything is written:
    fibctl's tables and columns all there (a database changed by hand fails mid-query with a
    traceback otherwise), and each of `named` (see NAMED) held by it: a typo, or '' (which
    would read as "every run"), would report nothing."""
    if not db.strip():
        raise FibctlError(f"{option} is empty; name a database")
    engine = connect_readonly(db, option=option)
    schema.check_tables(engine, shown(db))
    for name, value in ((n, v) for n, v in named.items() if v is not None):
        table, column, what = NAMED[name]
        with engine.connect() as conn:
            known = conn.execute(text(f"SELECT DISTINCT {column} FROM {table} ORDER BY 1")).scalars().all()
        if not (any(fnmatch.fnmatchcase(k, value) for k in known) if name == "only" else value in known):
            listed = ", ".join(map(repr, known[:5])) + (", ..." if len(known) > 5 else "") or "none"
            raise FibctlError(f"--{name} {value!r}: no {what} in {shown(db)} (it has: {listed})")
    return engine



@dataclass
class Rows:
    """A statement's result as the database returned it: no pandas, no coercion."""

    columns: list[str]
    rows: list[tuple]
    truncated: bool  # more rows were left than were fetched

    @property
    def empty(self) -> bool:
        return not self.rows


def query_rows(db: str, sql: str, *, max_rows: int = MAX_ROWS, timeout_s: float = TIMEOUT_S) -> Rows:
    """Run one SQL statement read-only and return up to `max_rows` of its rows, each value as
    the driver returned it (an integer stays an integer beside a NULL, a NULL stays None)."""
    if not 1 <= max_rows <= MAX_ROWS_LIMIT:
        raise FibctlError(f"--max-rows must be 1 to {MAX_ROWS_LIMIT:,} (got {max_rows})")
    if not 0 < timeout_s <= TIMEOUT_LIMIT_S:  # also refuses nan
        raise FibctlError(f"--timeout must be above 0 and at most {TIMEOUT_LIMIT_S:,} s (got {timeout_s:g})")
    if not sql.strip():
        raise FibctlError('the SQL statement is empty; give one, e.g. "SELECT name, status FROM runs"')
    # another process's lock is waited out within the deadline too, not for the usual 30 s
    engine = connect_readonly(db, current=False, busy_timeout_ms=min(BUSY_TIMEOUT_MS, math.ceil(timeout_s * 1000)))
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            if isinstance(raw, sqlite3.Connection):
                guard = _SqliteGuard(raw, timeout_s)
            else:  # PostgreSQL: the server enforces the deadline
                conn.exec_driver_sql(f"SET statement_timeout = {int(timeout_s * 1000)}")
                _refuse_privileged_login(conn)
                guard = None
            try:
                result = _pg_result(conn, sql) if guard is None else conn.exec_driver_sql(sql)
                # closed on every path: a statement left with rows to fetch keeps its read lock (the
                # traceback of an error holds it) past the command's tidying of -wal and -shm
                with result:
                    try:
                        rows, truncated = _fetch(result, max_rows)
                        columns = list(result.keys())
                    except ResourceClosedError:  # no result set: only comments, or no query (nothing done)
                        raise FibctlError("the statement returned no result set (is it only a comment?); "
                                          "fibctl sql prints the rows of a query") from None
                return Rows([str(c) for c in columns], rows, truncated)
            finally:
                if guard:
                    guard.remove()
                    if guard.signalled is not None:
                        raise guard.signalled
    except DBAPIError as e:
        raise FibctlError(_sql_error(e, timeout_s)) from None
    except MemoryError:  # SQLite past HEAP_LIMIT_BYTES: the driver raises it, not an SQL error
        raise FibctlError(OUT_OF_MEMORY) from None
    finally:
        engine.dispose()


def _fetch(result, max_rows: int) -> tuple[list[tuple], bool]:
    """Up to `max_rows` rows of `result`, and whether more were left; refused as soon as their
    text and bytes pass MAX_RESULT_BYTES. Fetched in batches, each sized so that rows as large
    as the largest so far fit in what is left of the cap: memory stays near the cap (fetching
    every row before counting took 929 MB to refuse 64 MiB)."""
    rows: list[tuple] = []
    size = largest = 0
    batch = 1  # the size of a row is not known before the first
    while fetched := result.fetchmany(min(batch, max_rows + 1 - len(rows))):
        for row in fetched:
            if len(rows) == max_rows:  # the row past --max-rows only says that more are left
                return rows, True
            held = sum(len(v) for v in row if isinstance(v, (str, bytes, bytearray, memoryview)))
            size += held
            if size > MAX_RESULT_BYTES:
                raise FibctlError(f"the result holds over {MAX_RESULT_BYTES >> 20} MiB of text and bytes, "
                                  "more than fibctl sql prints; select fewer rows or part of a value "
                                  "(substr, length)")
            largest = max(largest, held)
            rows.append(tuple(row))
        batch = max(1, min(FETCH_ROWS, 10 * batch, (MAX_RESULT_BYTES - size) // max(largest, 1)))
    return rows, False


# roles whose members may reach the server's files or programs from SQL
_FILE_ROLES = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")


def _refuse_privileged_login(conn) -> None:
    """A read-only transaction still lets a superuser (or a member of the file roles) read and
    write the server's files and run programs (COPY ... TO PROGRAM, pg_read_file). No setting
    holds against it: a statement can take the login's own role back whatever role fibctl
    sets (`set_config('role', 'none', false)`, then the rest through a DO block or
    query_to_xml). So a login that is such a role, or may become one (SET ROLE to a role it
    is a member of), is refused; docs/cli.md says how to make a role that only reads."""
    shown = conn.exec_driver_sql(
        "SELECT r.rolname, r.rolsuper FROM pg_roles r WHERE pg_has_role(session_user, r.oid, 'MEMBER') AND (r.rolsuper"
        + "".join(f" OR r.rolname = '{r}'" for r in _FILE_ROLES)
        + ") ORDER BY r.rolname <> session_user, r.rolname LIMIT 1").first()
    if shown is None:
        return
    login = conn.exec_driver_sql("SELECT session_user").scalar()
    what = ("is a superuser" if shown.rolname == login and shown.rolsuper
            else f"may act as {shown.rolname}" + (" (a superuser)" if shown.rolsuper else ""))
    raise FibctlError(f"fibctl sql: role {login!r} {what}: a statement run as it reaches the server's files and "
                      "programs whatever fibctl sets; connect as a role that only reads "
                      "(CREATE ROLE reader LOGIN; GRANT pg_read_all_data TO reader)")


def _pg_result(conn, sql: str):
    """`sql`'s result on PostgreSQL, its rows fetched as they are read.

    psycopg's ordinary cursor receives the whole result before the first row is read, so an
    unbounded statement would run to the deadline (and a large one fill memory) whatever
    --max-rows says. A server-side cursor (DECLARE ... CURSOR FOR) fetches in batches, but
    takes only queries: any other statement (SET, SHOW, a write, several statements) fails
    to parse there, having run nothing, and is run from the savepoint as one prepared
    statement: sent as it is, 'SELECT 1; ROLLBACK; SET ROLE postgres; COPY ...' would end the
    read-only transaction (and the SET ROLE with it) and run the rest as the login role."""
    as_written = {"no_parameters": True}  # the driver parses no placeholders: a '%' is a '%'
    savepoint = conn.begin_nested()
    try:
        return conn.exec_driver_sql(sql, execution_options={**as_written, "stream_results": True})
    except ProgrammingError as e:
        if getattr(e.orig, "sqlstate", None) != "42601":  # syntax_error
            raise
        savepoint.rollback()
        conn.connection.driver_connection.prepare_threshold = 0  # the server parses one statement only
        try:
            return conn.exec_driver_sql(sql, execution_options=as_written)
        except DBAPIError:
            conn.invalidate()  # COPY ... TO STDOUT leaves it mid-copy: closed, not reset (a logged traceback)
            raise


def run_query(db: str, sql: str, *, max_rows: int = MAX_ROWS, timeout_s: float = TIMEOUT_S) -> pd.DataFrame:
    """`query_rows` as a DataFrame (object columns: values as the database returned them);
    `frame.attrs["truncated"]` says whether more were left."""
    result = query_rows(db, sql, max_rows=max_rows, timeout_s=timeout_s)
    frame = pd.DataFrame(result.rows, columns=result.columns, dtype=object) if result.columns else pd.DataFrame()
    frame.attrs["truncated"] = result.truncated
    return frame


class _SqliteGuard:
    """Authorizer, deadline and heap limit on one connection, for the user's statement only
    (fibctl's own schema checks ran before it was installed)."""

    def __init__(self, raw: sqlite3.Connection, timeout_s: float):
        self.raw = raw
        self.heap_before = raw.execute("PRAGMA hard_heap_limit").fetchone()[0]
        raw.execute(f"PRAGMA hard_heap_limit={HEAP_LIMIT_BYTES}")
        deadline = time.monotonic() + timeout_s
        raw.set_progress_handler(lambda: time.monotonic() > deadline, PROGRESS_OPS)
        raw.set_authorizer(_authorize)
        # Ctrl-C or SIGTERM mid-statement: sqlite3 would swallow the handler's exception as
        # "interrupted" (said as the deadline); the signal is noted, the statement interrupted,
        # and the signal's own ending raised once the connection is back (self.signalled)
        self.signalled: BaseException | None = None
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(signum) is not signal.SIG_IGN:  # an ignored one stays ignored
                    self.handlers[signum] = signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        self.signalled = KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
        self.raw.interrupt()

    def remove(self) -> None:
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        self.raw.set_authorizer(None)
        self.raw.set_progress_handler(None, PROGRESS_OPS)
        self.raw.execute(f"PRAGMA hard_heap_limit={self.heap_before}")  # the limit is process-wide


def _authorize(action: int, arg1, arg2, _db, _trigger) -> int:
    if action == sqlite3.SQLITE_PRAGMA:
        return sqlite3.SQLITE_OK if arg2 is None or arg1.lower() in _READ_PRAGMAS else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_UPDATE and arg1 in _SCHEMA_TABLES:
        # asked as a table-valued PRAGMA (pragma_table_info('runs')) first reads the schema;
        # the schema table cannot be written here anyway (mode=ro, query_only, no writable_schema)
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def cell(value):
    """A value for text output: blobs as SQL hex literals, everything else as it is."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "x'" + bytes(value).hex() + "'"
    return value


def csv_lines(result: Rows) -> Iterator[str]:
    """CSV with the values as the database returned them; NULL is an empty field. A row at a
    time, to be written as it is made: the whole text, beside the rows, doubled the memory."""
    import csv
    import io

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in chain([result.columns], (["" if v is None else cell(v) for v in row] for row in result.rows)):
        writer.writerow(row)
        yield out.getvalue()
        out.seek(0)
        out.truncate()


def json_lines(result: Rows) -> Iterator[str]:
    """JSON records, as `json.dumps(records, indent=2)` writes them but a record at a time (a
    dict for every row, then the whole text, took 1 GB for 100,000 rows of 47 columns): NULL
    as null, integers as integers, slashes as they are; a non-finite float (which JSON cannot
    hold) as its name, e.g. "inf". A NUMERIC (PostgreSQL's type of `2.5`, `avg(int)`,
    `sum(bigint)`; the driver returns a Decimal) is a number too. No newline at the end."""
    import json
    import math
    from decimal import Decimal

    def value(v):
        v = cell(v)
        if isinstance(v, Decimal):
            v = int(v) if v.is_finite() and v == v.to_integral_value() else float(v)
        return str(v) if isinstance(v, float) and not math.isfinite(v) else v

    # a record holds one value per name: the first of two columns named alike was dropped unsaid
    repeated = sorted({c for c in result.columns if result.columns.count(c) > 1})
    if repeated:
        raise FibctlError(f"the result has more than one column named {', '.join(map(repr, repeated))}, and a JSON "
                          "record holds one value per name: name them apart (r.id AS run_id) or use --format csv")
    if not result.rows:
        yield "[]"
        return
    for i, row in enumerate(result.rows):
        record = json.dumps({k: value(v) for k, v in zip(result.columns, row)}, indent=2, ensure_ascii=False,
                            default=str)
        # one level in, as inside the list; a line break in a value is written \n, never as one
        yield ("[\n  " if i == 0 else ",\n  ") + record.replace("\n", "\n  ")
    yield "\n]"


def _sql_error(e: DBAPIError, timeout_s: float) -> str:
    msg = printable((str(e.orig).strip().splitlines() or [type(e.orig).__name__])[0])  # it may quote the query
    flat = msg.replace("-", "").replace(" ", "").lower()
    if "readonly" in flat:
        return f"refused: the database is opened read-only, nothing was written ({msg})"
    if "notauthorized" in flat or "authorizationdenied" in flat:
        return ("refused: fibctl sql only reads (no writes, ATTACH, VACUUM or PRAGMA settings), "
                "nothing was written")
    if "multiple commands" in msg:  # PostgreSQL's words for 'SELECT 1; SELECT 2'
        return "fibctl sql runs one statement at a time; remove the ';' between statements"
    if msg.startswith("COPY cannot be used"):  # the driver's words for COPY ... TO STDOUT
        return "fibctl sql prints the rows of a query, not COPY; use SELECT with --format csv"
    if msg == "interrupted" or "statement timeout" in msg:
        return f"stopped: the statement ran past --timeout {timeout_s:g} s; add a LIMIT or a tighter WHERE"
    if "out of memory" in msg:
        return OUT_OF_MEMORY
    if msg.startswith("no such table") or (msg.startswith("relation ") and msg.endswith("does not exist")):
        return f"SQL error: {msg} (fibctl's tables: {', '.join(sorted(schema.Base.metadata.tables))})"
    return f"SQL error: {msg}"
