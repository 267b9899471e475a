"""Opening the results database: URL resolution, SQLite settings, schema revision checks.

`connect` brings a database to the latest Alembic revision before handing it out;
`connect_readonly` opens one whose connection itself refuses writes (for `fibctl sql`).
A file that is not a database, or a database written by a newer fibctl, is refused with a
`FibctlError` before anything is written to it (WAL mode included); so is an in-memory
SQLite database, which would be gone when the command ends. Messages name a database by
`shown(db)`: its URL with any password masked (libpq's `?password=` too); `option` is the
one the user gave it with (--db, or `db copy`'s --from and --to). A PostgreSQL server gets CONNECT_TIMEOUT_S to
answer, so that one that accepts a connection and never answers fails instead of hanging.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sqlite3
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import NullPool

import fibctl
from fibctl.errors import DamagedDatabase, FibctlError, shell_word, shown_path
from fibctl.paths import expanded
from fibctl.db.stored import sql_literal

SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_S = 10  # unless the URL's connect_timeout or PGCONNECT_TIMEOUT says otherwise
LIBPQ_DRIVERS = ("psycopg", "psycopg2")  # the drivers that take libpq's connect_timeout
UPGRADE_LOCK = 0x0F1BC7  # the PostgreSQL advisory lock schema upgrades hold
# libpq takes these in a URL's query as well as before the '@' (postgresql://u@h/db?password=...);
# SQLAlchemy's own masking knows only the latter
SECRET_PARAMS = ("password", "sslpassword")
MASKED = "***"


# the extra to install for a dialect whose driver is missing
DRIVER_HINTS = {"postgresql": "pip install -e '.[postgres]' (psycopg 3) and name it postgresql+psycopg://...",
                "mysql": "pip install pymysql, and name it: mysql+pymysql://..."}


def resolve_url(db: str, option: str = "--db") -> URL:
    """A SQLAlchemy URL as given; a bare path means SQLite (the path taken whole: a '?' or
    '#' in it is part of the file name, not a URL query). An in-memory database is refused."""
    if not db.strip():  # '' would be an in-memory SQLite database, not the one meant
        raise FibctlError(f"{option} is empty; name a database (a file path or a URL)")
    if "://" not in db:
        db = expanded(db)  # `--db '~/r.db'` quoted, or FIBCTL_DB=~/r.db: the home folder's, as --data's
        if db.endswith(os.sep) and not os.path.isdir(db):  # a file of the folder's name would be made
            raise FibctlError(f"{option} {shown_path(db)} ends with {os.sep!r}: name a database file, not a folder "
                              f"(e.g. {os.path.join(db, 'results.db')})")
        url = URL.create("sqlite", database=db)
    else:
        try:
            url = make_url(db)
        except (ArgumentError, ValueError):  # ValueError: a port that is not a number
            raise FibctlError(f"{option} {shown(db)} is not a database URL (e.g. sqlite:///results.db, "
                              "postgresql://user@host/db) or a file path") from None
        if url.get_backend_name() == "sqlite" and url.database:  # sqlite:///~/r.db: as the bare path
            url = url.set(database=expanded(url.database))
    if _in_memory(url):
        raise FibctlError(f"{option} {shown(url) if has_password(url) else db} is an in-memory database: "
                          "it keeps nothing between commands; name a file (e.g. results.db)")
    ignored = _ignored_sqlite_options(url)
    if ignored:  # SQLAlchemy only warns, and a `mode=ro` asked for would not be kept
        raise FibctlError(f"{option} {shown_path(db)}: the SQLite driver ignores {', '.join(ignored)} without "
                          "uri=true; name the file alone (commands that only read open it read-only themselves)")
    return url


# what the pysqlite driver takes from a URL's query (sqlalchemy.dialects.sqlite.pysqlite)
SQLITE_DRIVER_OPTIONS = {"uri", "timeout", "isolation_level", "detect_types", "check_same_thread",
                         "cached_statements"}


def _ignored_sqlite_options(url: URL) -> list[str]:
    """A SQLite URL's query keys its driver drops: SQLite URI options (mode, cache, ...)
    without uri=true."""
    from sqlalchemy.util import asbool  # as the driver reads uri=

    uri = url.query.get("uri")
    if url.get_backend_name() != "sqlite" or (isinstance(uri, str) and asbool(uri)):
        return []
    return sorted(set(url.query) - SQLITE_DRIVER_OPTIONS)


def _in_memory(url: URL) -> bool:
    """sqlite://, sqlite:///:memory:, and SQLite URIs such as file::memory: or mode=memory."""
    name = url.database or ""
    return url.get_backend_name() == "sqlite" and (
        name in ("", ":memory:") or name.startswith("file::memory:")
        or (name.startswith("file:") and url.query.get("mode") == "memory"))


def has_password(url: URL) -> bool:
    """Whether the URL holds a secret: a password before the '@' or in its query."""
    return url.password is not None or any(key in url.query for key in SECRET_PARAMS)


def shown(db: str | URL) -> str:
    """The database as messages show it: a URL's password masked, in its query too."""
    if isinstance(db, str) and "://" not in db:
        return shown_path(db)
    try:
        url = make_url(db)
    except (ArgumentError, ValueError):
        return "(an unparsable URL)"
    # a placeholder of URL-safe letters, swapped after rendering: '***' itself would be escaped there
    placeholder = "fibctlmaskedsecret"
    secrets = {key: placeholder for key in SECRET_PARAMS if key in url.query}
    rendered = url.update_query_dict(secrets).render_as_string(hide_password=True)
    return rendered.replace(placeholder, MASKED)


def same_database(a: str, b: str) -> bool:
    """Whether two --db values name one database: one SQLite file, or one server database."""
    ua, ub = resolve_url(a), resolve_url(b)
    pa, pb = _sqlite_path(ua), _sqlite_path(ub)
    if pa is not None or pb is not None:
        return pa is not None and pb is not None and pa.resolve() == pb.resolve()
    keys = ("drivername", "host", "port", "database")
    return [getattr(ua, k) for k in keys] == [getattr(ub, k) for k in keys]


def _sqlite_path(url: URL) -> Path | None:
    """The file behind a SQLite URL (`resolve_url` refused in-memory ones); None for other
    dialects."""
    if url.get_backend_name() != "sqlite":
        return None
    return Path(url.database)


# Every engine this process made, and the SQLite files it opened with whether their -wal and
# -shm files were absent then: `release` closes the one and removes what it added to the other.
_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_opened: dict[Path, bool] = {}


def _wal_files(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]


def close_connections() -> None:
    """Close every connection the engines of this process hold in their pools (each engine
    stays usable: its next query opens one)."""
    for engine in list(_engines):
        engine.dispose()


def release() -> None:
    """Close this process's connections, and leave a SQLite database's folder as it was.

    A connection to a WAL database makes -wal and -shm files; SQLite removes them when the
    last connection closes, but not when that one is read-only (`mode=ro`, the reports'). So
    where this process found neither file, one plain connection opened and closed here
    removes them, after a checkpoint of nothing; where another process still has the database
    open, SQLite leaves them to it."""
    close_connections()
    for path, absent in list(_opened.items()):
        try:
            stray = absent and path.is_file() and any(p.exists() for p in _wal_files(path))
        except OSError:  # a folder this process may no longer look into: nothing it can tidy
            continue
        if stray:
            try:
                conn = sqlite3.connect(path)
                try:
                    conn.execute("PRAGMA schema_version")
                finally:
                    conn.close()
            except sqlite3.Error:  # locked or unreadable: the files stay, as they would have
                pass
    _opened.clear()


def check_sqlite_file(path: Path, *, must_exist: bool, option: str | None = None) -> None:
    """Refuse, in one line, a path SQLite cannot use: a folder, a file of another kind, a
    missing database (`must_exist`), or a new one whose folder is not there. `option`: the
    option that named it (said first, as a bad URL is), and a missing one's way out (--db: the
    results database)."""
    named = f"{option} {shown_path(path)}" if option else shown_path(path)
    if path.is_dir():  # first: '.' or '/' has no name to put -wal beside
        raise FibctlError(f"{named} is a directory, not a database file")
    _opened.setdefault(path.resolve(), not any(p.exists() for p in _wal_files(path)))
    if path.exists() and not path.is_file():  # a FIFO or a device: reading its header would block
        raise FibctlError(f"{named} is not a regular file: name a database file or URL")
    if not path.exists():
        if must_exist:
            raise FibctlError(f"no database at {shown_path(path)}{_missing_hint(option)}")
        if path.parent.exists() and not path.parent.is_dir():
            raise FibctlError(f"cannot create database {shown_path(path)}: {shown_path(path.parent)} "
                              "is not a directory")
        if not path.parent.is_dir():
            raise FibctlError(f"cannot create database {shown_path(path)}: directory {shown_path(path.parent)} does "
                              "not exist")
        return
    with path.open("rb") as f:
        header = f.read(len(SQLITE_HEADER))
    if header and header != SQLITE_HEADER:  # an empty file is an empty SQLite database
        raise FibctlError(f"{named} is not a SQLite database")


def _missing_hint(option: str | None) -> str:
    """The way out of a missing database: a new user's first command (or a typo, or a shell
    without the FIBCTL_DB of the one that made it) reaches for the default results.db."""
    if option == "--db":
        return ("; name yours with --db or FIBCTL_DB (the demo's: fibctl-demo/results.db), or make "
                "one with `fibctl queue add MATRIX`")
    return f" ({option})" if option else ""


def check_writable(path: Path) -> None:
    """Refuse, before SQLite opens it, a database this process cannot write: a file it may not
    write (SQLite would open it read-only, failing only at the first write, after making a
    WAL database's -wal and -shm files beside it), or one in a folder it may not write (a
    write needs a -journal, or a -wal and -shm, file there). chattr +i refuses root as well."""
    folder = path.absolute().parent
    if path.exists() and not os.access(path, os.W_OK):
        raise FibctlError(f"cannot write to database {shown_path(path)}: the file is not writable")
    if not os.access(folder, os.W_OK | os.X_OK):
        doing = "write to" if path.exists() else "create"
        raise FibctlError(f"cannot {doing} database {shown_path(path)}: directory {shown_path(folder)} is not writable")


def _install_sqlite_settings(engine: Engine, *, foreign_keys: bool = True) -> None:
    """WAL, busy timeout, foreign keys; every transaction starts with BEGIN IMMEDIATE.

    Taking the write lock up front means a transaction never has to upgrade a read lock,
    which in WAL mode fails at once with "database is locked" instead of waiting.
    Statements outside `begin()` still autobegin through the same hook.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let SQLAlchemy, not the driver, issue BEGIN
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _create_engine(url: URL, option: str = "--db", name: str | None = None, **kwargs) -> Engine:
    """`create_engine`, with a missing driver or an unknown dialect as one line; a damaged
    SQLite file (`name`: the database as the user gave it) found by any query is one too."""
    if _connect_timeout(url) is None and url.get_backend_name() == "postgresql" \
            and url.get_driver_name() in LIBPQ_DRIVERS:
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S, **kwargs.get("connect_args", {})}
    try:
        engine = create_engine(url, **kwargs)
        _engines.add(engine)
        engine.pool.logger.addFilter(_raised_on)  # the class's logger: once per pool class
        logging.getLogger("psycopg").addFilter(_not_cancelling)  # a set: once
        _note_database(engine, name if name is not None else url)
        if engine.dialect.name == "sqlite":
            _refuse_damaged(engine, name if name is not None else url)
        return engine
    except NoSuchModuleError:
        raise FibctlError(f"{option} {shown(url)}: unknown database kind {url.drivername!r}; "
                          "use a SQLite path or a postgresql:// URL") from None
    except ArgumentError as e:
        raise FibctlError(f"{option} {shown(url)} is not a usable database URL: "
                          f"{str(e).strip().splitlines()[0]}") from None
    except ImportError as e:
        hint = DRIVER_HINTS.get(url.get_backend_name(), f"install the {url.drivername} driver")
        raise FibctlError(f"{option} {shown(url)}: its driver is not installed ({e.name or e}); {hint}") from None


def _raised_on(record: logging.LogRecord) -> bool:
    """Drop the pool's traceback of a Ctrl-C or SIGTERM (KeyboardInterrupt, SystemExit) that
    landed while it closed or reset a connection: SQLAlchemy logs it, with no handler set, on
    stderr ("Exception closing connection", "Exception during reset or similar"), then raises
    it on, and the command ends as interrupted with its own line. Errors are still logged."""
    raised = record.exc_info[1] if record.exc_info else None
    return raised is None or isinstance(raised, Exception)


# what psycopg logs while it cancels the query a Ctrl-C (or SIGTERM) landed in, on stderr
# with no handler set, before it raises the interrupt on: the command's own line says it
CANCELLING = ("query cancellation ", "query not terminated after cancellation")


def _not_cancelling(record: logging.LogRecord) -> bool:
    """Drop psycopg's warnings about cancelling an interrupted query ("query cancellation
    interrupted (AdminShutdown): closing connection" above `interrupted`); others are kept."""
    return not str(record.msg).startswith(CANCELLING)


def _note_database(engine: Engine, db: str | URL) -> None:
    """Note on each error the engine raises the database it was opened on (as the user gave
    it): one met mid-command (a write the disk refused) reaches the command line's last
    handler, which names it with `refusal`, far from any code that knows the database."""

    @event.listens_for(engine, "handle_error")
    def _noted(context):
        if context.sqlalchemy_exception is not None:
            context.sqlalchemy_exception.database = db


# SQLite's result codes for a file that is damaged (a bad page, a truncated file) or is no database
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26
# ... and for a disk that refused a write: an I/O error (a -shm file it could not grow, say), full
SQLITE_IOERR, SQLITE_FULL = 10, 13
# PostgreSQL's SQLSTATEs for a full disk on the server (psycopg's DiskFull) and for its disk
# failing a read or write (IoError: SQLite's I/O error). Not 53200 (out_of_memory): that is
# the server's memory, and "its disk is full" would send the user to the wrong place
PG_DISK_REFUSED = ("53100", "58030")


def _disk_refused(e: BaseException) -> bool:
    """Whether the database failed on its disk (full, or refusing writes), not on its data."""
    if isinstance(e, sqlite3.Error):
        return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in (SQLITE_IOERR, SQLITE_FULL)
    # psycopg's sqlstate, psycopg2's pgcode
    return (getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)) in PG_DISK_REFUSED


def _disk_line(reason: str) -> str:
    return f"its disk is full or not writable ({reason})"


def _refuse_damaged(engine: Engine, db: str | URL) -> None:
    """A damaged page may be met by any query, long after the checks on opening (a `db copy`
    reading its last table, a report's one query): one line naming the database, wherever."""

    @event.listens_for(engine, "handle_error")
    def _damaged(context):
        e = context.original_exception
        if isinstance(e, sqlite3.DatabaseError) and (getattr(e, "sqlite_errorcode", 0) & 0xFF) in (
                SQLITE_CORRUPT, SQLITE_NOTADB):
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DamagedDatabase(f"{shown(db)} is not a usable database: {reason}")


def _connect_timeout(url: URL) -> str | None:
    """The connect timeout the user set (the URL's, else PGCONNECT_TIMEOUT's), in seconds."""
    return url.query.get("connect_timeout") or os.environ.get("PGCONNECT_TIMEOUT") or None


def _engine(url: URL, option: str = "--db", name: str | None = None, *, foreign_keys: bool = True,
            **kwargs) -> Engine:
    engine = _create_engine(url, option, name, **kwargs)
    if engine.dialect.name == "sqlite":
        _install_sqlite_settings(engine, foreign_keys=foreign_keys)
    return engine


# --- Alembic --------------------------------------------------------------------------------


def migrations_dir() -> Path:
    """The Alembic scripts: the installed `fibctl.migrations` package, or `migrations/`
    beside the `fibctl/` folder when running from a source checkout that is not installed."""
    spec = importlib.util.find_spec("fibctl.migrations")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    return Path(fibctl.__file__).resolve().parent.parent / "migrations"


def alembic_config(connection=None) -> Config:
    """An Alembic config built in code (no alembic.ini); env.py uses `connection` if given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision; None for a database fibctl has not written yet."""
    with engine.connect() as conn:
        return _stored_revision(conn, engine.url)


def _stored_revision(conn, db: str | URL) -> str | None:
    """The revision `alembic_version` holds. Alembic raises its CommandError for a table of
    several rows (a database edited by hand, or a copy's rows added to another's); fibctl's
    migrations are one line, so that is a damaged record, named here in one line."""
    revisions = MigrationContext.configure(conn).get_current_heads()
    for rev in revisions:  # SQLite keeps a blob in the text column: not a newer fibctl's revision
        if not isinstance(rev, str):
            raise FibctlError(f"{shown(db)}: alembic_version.version_num holds {sql_literal(rev)}, not a schema "
                              "revision's text (the database was edited by hand or is damaged)")
    if len(revisions) > 1:
        known = [r for r in _known_revisions() if r in revisions]
        keep = f", e.g. DELETE FROM alembic_version WHERE version_num <> '{known[0]}'" if known else ""
        raise FibctlError(
            f"{shown(db)} records {len(revisions)} schema revisions ({', '.join(sorted(revisions))}) in "
            "alembic_version, where a database has one (edited by hand?): delete the rows of those its "
            f"tables are not at{keep}")
    return revisions[0] if revisions else None


def _known_revisions() -> list[str]:
    """This fibctl's schema revisions, the newest first."""
    return [s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()]


def _check_revision(engine: Engine, db: str, *, reading: bool = False,
                    busy_timeout_ms: int | None = None) -> str | None:
    """The current revision, after refusing foreign or newer databases (nothing written).
    `reading`: the engine only reads, so a lock it waits out is another process's exclusive
    one (a writer's engine begins by taking the write lock itself)."""
    try:
        # one connection for both: between two, another process's first upgrade could commit,
        # and its tables would be read with no revision (a fibctl database refused as foreign)
        with engine.connect() as conn:
            rev = _stored_revision(conn, db)
            tables = inspect(conn).get_table_names() if rev is None else []
    except DatabaseError as e:
        if _timed_out(e):
            url = engine.url
            server = f"{url.host or url.query.get('host') or 'localhost'}:{url.port or 5432}"
            waited = _connect_timeout(url) or CONNECT_TIMEOUT_S
            raise FibctlError(f"the database server {server} did not answer within {waited} s "
                              f"({shown(db)}); is it up, and is that its address?") from None
        if "locked" in str(e.orig):
            waited = "to read it" if reading else "for its write lock"
            waited_ms = BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms
            raise FibctlError(f"{shown(db)} is locked by another process: waited {waited_ms / 1000:g} s "
                              f"{waited}; try again when it is done") from None
        reason = (str(e.orig).strip().splitlines() or [type(e.orig).__name__])[0]  # the driver's first line
        path = _sqlite_path(resolve_url(db))
        if path is not None and "unable to open" in reason \
                and not os.access(path.absolute().parent, os.W_OK | os.X_OK):
            # SQLite makes a new database, and a WAL one's -wal and -shm files, in its folder
            doing = "write to" if path.exists() else "create"
            raise FibctlError(f"cannot {doing} database {shown_path(path)}: directory "
                              f"{shown_path(path.absolute().parent)} is not writable") from None
        if _disk_refused(e.orig):  # the database may be whole: it is the disk to look at
            raise FibctlError(f"{shown(db)}: {_disk_line(reason)}") from None
        raise FibctlError(f"{shown(db)} is not a usable database: {reason}") from None
    if rev is None and tables:
        raise FibctlError(
            f"{shown(db)} is not a fibctl database: it has tables ({', '.join(sorted(tables)[:5])}) "
            "but no fibctl schema revision")
    known = _known_revisions()
    if rev is not None and rev not in known:
        if _NUMBERED.fullmatch(rev) and rev > known[0]:
            raise FibctlError(
                f"{shown(db)} has schema revision {rev}, unknown to this fibctl (latest {known[0]}): "
                "it was written by a newer fibctl; upgrade fibctl to use it")
        raise FibctlError(
            f"{shown(db)} has schema revision {sql_literal(rev)}, which no fibctl writes (this one's are "
            f"{known[-1]} to {known[0]}): alembic_version was edited by hand or is damaged")
    return rev


# fibctl numbers its migrations 0001, 0002, ...: a newer fibctl's revision is a later number,
# anything else in alembic_version a hand edit (`SET version_num = 42` is stored as '42')
_NUMBERED = re.compile(r"\d{4}")


def _timed_out(e: DatabaseError) -> bool:
    """Whether the server took the connection and did not answer within the connect timeout."""
    try:
        from psycopg.errors import ConnectionTimeout
    except ImportError:  # psycopg2's timeout, or none: the driver's own line names the server
        return False
    return isinstance(e.orig, ConnectionTimeout)


def upgrade(db: str, revision: str = "head", option: str = "--db", *,
            wal_if_current: bool = True) -> tuple[str | None, str]:
    """Bring `db` to `revision`; returns (revision before, revision after).

    The whole upgrade is one transaction. SQLite runs it with foreign keys off: batch
    migrations rebuild tables, and dropping a parent table with them on would cascade-delete
    its children's rows. A SQLite database is switched to WAL mode, one already at `revision`
    too unless not `wal_if_current` (`db upgrade` with nothing to do changes nothing).
    """
    url = resolve_url(db, option)
    path = _sqlite_path(url)
    if path is not None:
        check_sqlite_file(path, must_exist=False, option=option)
        check_writable(path)
    engine = _engine(url, option, db, foreign_keys=False, poolclass=NullPool)
    try:
        before = _check_revision(engine, db)
        target = head_revision() if revision == "head" else revision
        # a fibctl database (or a new one): now it may change mode
        if path is not None and (before != target or wal_if_current):
            _set_wal(engine)
        if before != target:
            try:
                with engine.begin() as conn:
                    if conn.dialect.name == "postgresql":
                        # processes upgrading at once (workers started together after an update)
                        # take turns: each next one finds the schema upgraded, as SQLite's
                        # BEGIN IMMEDIATE has it, instead of failing on the tables the first made
                        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK})
                    command.upgrade(alembic_config(conn), revision)
            except Exception as e:  # the transaction rolled back: the database is as it was
                # the driver's first line (e.g. permission denied), not the statement SQLAlchemy appends
                reason = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0]
                if _disk_refused(getattr(e, "orig", None) or e):
                    reason = _disk_line(reason)
                raise FibctlError(f"upgrading {shown(db)} to {target} failed, nothing changed: {reason}") from e
        return before, current_revision(engine)
    finally:
        engine.dispose()


def _set_wal(engine: Engine) -> None:
    """WAL mode, set outside any transaction (the mode cannot change inside one). Processes
    opening a new database at once (workers started together) find it locked: SQLite answers
    this PRAGMA 'database is locked' at once rather than through the busy timeout, so it is
    retried for as long as that timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        raw = engine.raw_connection()
        try:
            raw.driver_connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "readonly" in str(e) or "unable to open" in str(e):  # a read-only mount, say
                path = Path(engine.url.database)
                raise FibctlError(f"cannot write to database {shown_path(path)}: {e}") from None
            if _disk_refused(e):  # a full disk: it was a traceback
                raise FibctlError(f"{Path(engine.url.database)}: {_disk_line(str(e))}") from None
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        finally:
            raw.close()
        time.sleep(0.05)


def connect(db: str, *, create: bool = True, must_exist: bool = False, option: str = "--db",
            check: Callable[[Engine], None] | None = None) -> Engine:
    """An engine on `db`. With `create`, a missing database is created and an older schema
    upgraded to the latest revision; without it, the database must exist and be current.
    `must_exist` still upgrades but creates nothing: for commands that only make sense on a
    database with runs in it, where a mistyped path would otherwise be a new empty one.

    `check(engine)`: the command's own checks (the run it names exists, say), on a read-only
    engine on the database as it is, before it is upgraded or switched to WAL mode: what it
    raises leaves the database as it was. It may be of any schema revision, or none yet (a new
    or empty database): `check` reads only what every revision has."""
    url = resolve_url(db, option)
    path = _sqlite_path(url)
    if path is not None and must_exist:
        check_sqlite_file(path, must_exist=True, option=option)
    # a new file has nothing to check yet; another dialect is refused below as it always was
    if check is not None and url.get_backend_name() in ("sqlite", "postgresql") and (path is None or path.exists()):
        if path is not None:
            check_sqlite_file(path, must_exist=True, option=option)
            check_writable(path)  # refused for what it is before a check that reads it
        reader = connect_readonly(db, current=False, option=option)
        try:
            check(reader)
        finally:
            reader.dispose()
    if create:
        from fibctl.db.whole import upgraded_or_created  # it builds on this module

        upgraded_or_created(db, option)
    elif path is not None:
        check_sqlite_file(path, must_exist=True, option=option)
    engine = _engine(url, option, db)
    if not create and _check_revision(engine, db) != head_revision():
        engine.dispose()
        raise FibctlError(f"{shown(db)} is not at the latest schema revision; run `fibctl db upgrade --db "
                          f"{shell_word(shown(db))}`")
    return engine


def connect_readonly(db: str, *, current: bool = True, option: str = "--db",
                     busy_timeout_ms: int | None = None, pooled: bool = True) -> Engine:
    """An engine whose connections refuse writes (SQLite `mode=ro`, PostgreSQL read-only
    transactions), for reports and SQL a user typed. With `current`, the database must be a
    fibctl one at the latest revision (the reports' queries need its columns).
    `busy_timeout_ms`: how long a SQLite read waits out another process's exclusive lock
    (default BUSY_TIMEOUT_MS). Not `pooled`: each use opens its own connection and closes it
    (NullPool), for a command that reads now and then for hours (`status --watch`): a
    connection kept idle between its reads holds one of the server's, and a server restarted
    meanwhile (or one that ends idle sessions) would have ended it with the command."""
    url = resolve_url(db, option)
    path = _sqlite_path(url)
    pool = {} if pooled else {"poolclass": NullPool}
    if path is not None:
        check_sqlite_file(path, must_exist=True, option=option)
        engine = _create_engine(_readonly_sqlite_url(path), option, db, **pool)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms}")
            dbapi_conn.execute("PRAGMA query_only=ON")
    elif url.get_backend_name() == "postgresql":
        engine = _create_engine(url, option, db, execution_options={"postgresql_readonly": True}, **pool)
    else:
        raise FibctlError(f"{option} {shown(url)}: read-only access supports SQLite and PostgreSQL "
                          "databases only")
    rev = _check_revision(engine, db, reading=True, busy_timeout_ms=busy_timeout_ms)
    if current and rev != head_revision():
        engine.dispose()
        now = f"schema revision {rev}" if rev else "no fibctl schema (an empty database)"
        raise FibctlError(f"{shown(db)} has {now}; this command reads revision {head_revision()}: "
                          f"run `fibctl db upgrade --db {shell_word(shown(db))}`")
    return engine


def _readonly_sqlite_url(path: Path) -> URL:
    """`mode=ro`; in a folder this process cannot write, `immutable=1` as well while the -wal
    file holds nothing: a read-only WAL database needs its -shm file, which such a folder
    cannot get. Immutable skips the -wal, so one holding committed rows (a writer on another
    host, a killed worker) is read through its -shm file, or refused without one: the file
    alone would be read as it was before them. Likewise immutable for a file this process
    cannot write while no -wal or -shm file shows a writer: SQLite would make both, and
    `release` could not remove them (it needs to write the file)."""
    path = path.resolve()
    wal, shm = _wal_files(path)
    try:
        pending = wal.stat().st_size > 0
    except FileNotFoundError:
        pending = False
    if not os.access(path.parent, os.W_OK):
        if pending and not shm.exists():
            raise FibctlError(f"{shown_path(path)} has committed changes in {wal.name} that SQLite cannot read in a "
                              f"folder it cannot write (no {shm.name} there); copy {path.name} with {wal.name} to a "
                              "folder you can write, and read that copy")
        immutable = not pending
    else:
        immutable = not wal.exists() and not shm.exists() and not os.access(path, os.W_OK)
    # a URL, not its text: make_url decoded the quoted name (%3F back to '?'), and SQLite took a
    # '?' or '#' in a file name for the URI's query or fragment (`--db 'q?x.db'` created and
    # read an empty `q`), a '%41' for 'A' (`--db a%41.db` read aA.db)
    return URL.create("sqlite", database=f"file:{quote(str(path))}",
                      query={"mode": "ro", **({"immutable": "1"} if immutable else {}), "uri": "true"})


def refusal(e: BaseException) -> str | None:
    """One line for a database that refused an operation (locked past its busy timeout, full,
    gone): the driver's message, never the statement and parameters SQLAlchemy appends, and
    the database as the user gave it (noted on the error by its engine) where it is known; a
    full disk is said as on opening. None for any other exception."""
    if not isinstance(e, OperationalError):
        return None
    reason = (str(e.orig).strip().splitlines() or ["?"])[0]
    db = getattr(e, "database", None)
    if db is None:
        return f"the database refused the operation: {reason}"
    if _disk_refused(e.orig):
        return f"{shown(db)}: {_disk_line(reason)}"
    return f"the database {shown(db)} refused the operation: {reason}"
