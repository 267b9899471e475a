"""Shared fixtures: `db_url`, a fresh results database on each backend fibctl supports.

SQLite always (a file in the test's tmp_path); PostgreSQL when FIBCTL_TEST_PG names a server
(a URL whose user may create databases; `.ci/run` starts one with `.ci/postgres`): a new,
uniquely named database on that server for each test, dropped afterwards. Without the
variable the postgresql cases skip, saying why."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid

import pytest

# A suite started as a background job of a non-interactive shell (`... &`, as some CI
# runners and nohup do) inherits SIGINT ignored, and so would every fibctl the tests start
# (an ignored signal stays ignored across exec): the Ctrl-C tests would send SIGINT to
# processes that cannot get it. Take the default back here; an installed handler resets to
# the default in each child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Output width is each test's own choice (COLUMNS in the environment it gives a command), not
# the shell's: fibctl's consoles fix their width when COLUMNS is set as they are made, and a
# pytest-xdist worker starts with COLUMNS=80 from its launcher.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

PG_SERVER = os.environ.get("FIBCTL_TEST_PG")
NO_PG = "FIBCTL_TEST_PG names no PostgreSQL server"
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.skipif(not PG_SERVER, reason=NO_PG))]


@contextlib.contextmanager
def pg_server(exclusive: bool = False):
    """Hold the FIBCTL_TEST_PG server: shared by every test that uses it, alone for the one
    that restarts it (tests/test_postgres.py). Test processes run side by side (pytest-xdist),
    and a restart would break another process's connections mid-test."""
    import fcntl
    import hashlib
    import tempfile

    key = hashlib.sha256(PG_SERVER.encode()).hexdigest()[:16]
    with open(os.path.join(tempfile.gettempdir(), f"fibctl-test-pg-{key}.lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# The most connections one test holds on the server at once: 8 claiming processes and the
# test's own engine (tests/test_queue.py), a fibctl command beside a test's engines. With
# pytest-xdist's `-n logical` on a machine of many cores, each process running such a test,
# the tests together would pass the server's max_connections (100 by default): a test takes
# one of `pg_slots()` before it connects, so that at most that many use the server at once.
PG_TEST_CONNECTIONS = 12
PG_OTHER_CLIENTS = 5  # left to clients other than the tests (psql, a fibctl a developer runs)
_slot: list = []  # the slot's lock file, while this process holds one


def pg_slots() -> int:
    """How many tests may use the server at once: its connections (less those kept for
    superusers and other clients) over what one test holds; two at least (one test holds a
    module's database while it waits for a slot, another the slot while it waits for
    `pg_server(exclusive=True)`: with one slot, neither would go on)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    admin = create_engine(PG_SERVER, poolclass=NullPool)
    try:
        with admin.connect() as conn:
            most = int(conn.execute(text("SHOW max_connections")).scalar())
            kept = int(conn.execute(text("SHOW superuser_reserved_connections")).scalar())
    finally:
        admin.dispose()
    return max(2, (most - kept - PG_OTHER_CLIENTS) // PG_TEST_CONNECTIONS)


def hold_pg_slot() -> bool:
    """Take one of the server's `pg_slots()` for this process, waiting for one; kept until
    `let_go_pg_slot` (the end of the test, `pg_connections_bounded`). False where this process
    held one already."""
    import fcntl
    import hashlib
    import random
    import tempfile
    import time

    if _slot:
        return False
    key = hashlib.sha256(PG_SERVER.encode()).hexdigest()[:16]
    slots = [os.path.join(tempfile.gettempdir(), f"fibctl-test-pg-{key}.slot{i}") for i in range(_slots())]
    while True:
        for path in random.sample(slots, len(slots)):
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            _slot.append(f)
            return True
        time.sleep(0.1)


def let_go_pg_slot() -> None:
    while _slot:
        _slot.pop().close()  # closing the file lets go of its lock


_slot_count: list[int] = []


def _slots() -> int:
    if not _slot_count:  # asked once per process
        _slot_count.append(pg_slots())
    return _slot_count[0]


@pytest.fixture(autouse=True)
def pg_connections_bounded(request):
    """A test of the PostgreSQL backend holds a slot of the server (`hold_pg_slot`) while it
    runs; `pg_database` takes one too, for a test that makes its database itself. Afterwards
    the connections its forgotten engines keep in their pools are closed (they would stay
    open until the garbage collector took the engines, adding up over a module's tests),
    before the slot goes to another test."""
    if PG_SERVER and "postgres" in request.node.nodeid:  # [postgresql] cases, test_postgres.py
        hold_pg_slot()
    try:
        yield
    finally:
        engines = sys.modules.get("fibctl.db.engine")
        if engines is not None:
            engines.close_connections()
        let_go_pg_slot()


@contextlib.contextmanager
def pg_database(prefix: str = "fibctl_test", exclusive: bool = False):
    """A new database on the FIBCTL_TEST_PG server, dropped afterwards; its URL.

    Its own name prefix: tests/test_bench_queue.py checks that no `fibctl_bench_*` database
    is left over. `exclusive`: no other test uses the server meanwhile (`pg_server`). A slot
    of the server (`hold_pg_slot`) is held for the test that made it, and to drop it after
    the last test of a module whose fixture it is. The admin engine holds no connection
    between the two statements (NullPool): none stays open while the database is in use, and
    the drop works after a server restart (tests/test_postgres.py restarts it); WITH (FORCE)
    closes connections a test's engines still hold."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    hold_pg_slot()
    with pg_server(exclusive):
        admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
            yield make_url(PG_SERVER).set(database=name).render_as_string(hide_password=False)
        finally:
            took = hold_pg_slot()  # a module's fixture, dropped after its last test let go
            try:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            finally:
                admin.dispose()
                if took:
                    let_go_pg_slot()


READER = "fibctl_test_reader"


def reader_url(url: str) -> str:
    """`url` as `fibctl sql` must connect to it: SQLite as it is; on PostgreSQL as a role that
    only reads (the server's own login is a superuser, which fibctl sql refuses). The role is
    the server's, made once (under a lock: test processes run side by side) and kept."""
    if "://" not in url:
        return url
    import fcntl
    import tempfile

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    with open(os.path.join(tempfile.gettempdir(), "fibctl-test-pg-reader.lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                if conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": READER}).first() is None:
                    conn.execute(text(f"CREATE ROLE {READER} LOGIN"))
                    conn.execute(text(f"GRANT pg_read_all_data TO {READER}"))
        finally:
            admin.dispose()
            fcntl.flock(f, fcntl.LOCK_UN)
    return make_url(url).set(username=READER, password=None).render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_database(backend: str, folder):
    """The URL (SQLite: a bare path in `folder`) of an empty database on `backend`."""
    if backend == "sqlite":
        yield str(folder / "test.db")
    else:
        with pg_database() as url:
            yield url


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path) -> str:
    """An empty database fibctl has not written yet, for one test."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(scope="module", params=BACKENDS)
def module_backend(request) -> str:
    """The backend of a module's shared databases (e.g. the imported study in test_reports.py):
    every module-scoped database fixture that takes it is on the same backend in one test."""
    return request.param


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> tuple:
    """One finished `fibctl demo --quick` for the whole session (about 40 s): its folder and
    what it printed. tests/test_demo.py reads and resumes it; a test that changes it in
    other ways works on a copy (tests/test_docs_commands.py)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo") / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fibctl", "demo", "--quick", "--out", str(out), "--plain"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out, done.stdout
