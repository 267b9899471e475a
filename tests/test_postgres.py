"""The queue, worker, eval, reports and read-only SQL end to end on a real PostgreSQL server,
and a server restart mid-run, when FIBCTL_TEST_PG names one (a URL whose user may create
databases, e.g. postgresql+psycopg://postgres@localhost:5433/postgres); `.ci/run` starts one.
Skipped, saying why, elsewhere. The database-layer tests (queue, schema, SQL, import,
reports) run on both backends through the `db_url` fixture in tests/conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text

from conftest import NO_PG, PG_SERVER as SERVER, pg_database, reader_url

pytestmark = pytest.mark.skipif(not SERVER, reason=NO_PG)


@pytest.fixture
def pg() -> str:
    """A fresh database on the server, dropped afterwards; its URL."""
    with pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """`fibctl data prepare quick`, once for the module: both tests train on it and neither
    writes to it (its tokenizer's BPE training is the slow part)."""
    root = tmp_path_factory.mktemp("pgdata")
    done = subprocess.run([sys.executable, "-m", "fibctl", "data", "prepare", "quick", "--data", "data", "--plain"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return str(root / "data")


def test_queue_worker_eval_report_and_read_only_sql_end_to_end(pg, data, tmp_path):
    env = {**os.environ, "FIBCTL_DB": pg, "COLUMNS": "120"}

    def fibctl(*args, code=0):
        done = subprocess.run([sys.executable, "-m", "fibctl", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        return done.stdout + done.stderr

    (tmp_path / "m.toml").write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\n'
                                     'window = 4\n\n[[runs]]\nname = "b"\nschedule = "learned"\nwindow = 4\n')
    fibctl("queue", "add", "m.toml")
    assert "2 run(s)" in fibctl("worker", "--data", data, "--runs-dir", "runs", "--plain")
    fibctl("eval", "a", "b", "--length", "128", "--data", data)
    assert "docs_val" in fibctl("report", "table1")
    reader = ["--db", reader_url(pg)]  # fibctl sql refuses the server's superuser login
    assert "a" in fibctl("sql", "SELECT name, status FROM runs WHERE status = 'done'", *reader)
    refused = fibctl("sql", "DELETE FROM runs", *reader, code=2)
    assert "read-only" in refused or "refused" in refused
    assert fibctl("sql", "SELECT count(*) AS n FROM runs", "--format", "json", *reader).count('"n": 2') == 1


def _server_control():
    """`control(action)`: pg_ctl's restart, stop or start of the server under test (it runs as
    the `postgres` user; we are root in CI), waiting for it to be done. Asked for before the
    server goes down: its data folder is asked of the server."""
    import glob
    import shlex
    import shutil
    from pathlib import Path

    with create_engine(SERVER).connect() as conn:
        data = conn.execute(text("SHOW data_directory")).scalar()
    pg_ctl = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if os.geteuid() != 0 or not pg_ctl or not shutil.which("runuser"):
        pytest.skip("restarting the server needs root and Debian's pg_ctl")

    # the options it was started with (.ci/postgres: its port, its socket folder): a restart
    # reuses them, a start is given them again, else it would listen on the default port
    options = shlex.split(Path(data, "postmaster.opts").read_text())[1:]  # the program's name first
    if "-D" in options:  # given apart
        del options[options.index("-D"):options.index("-D") + 2]

    def control(action: str) -> None:
        how = ["-o", shlex.join(options)] if action == "start" else ["-m", "fast"]
        # the server's output goes to a log file: on a pipe it would keep this call waiting
        subprocess.run(["runuser", "-u", "postgres", "--", pg_ctl[-1], "-D", data, "-l", f"{data}/../restart.log",
                        action, *how, "-w"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=120)
    return control


def _restart_server() -> None:
    _server_control()("restart")


@pytest.fixture
def pg_alone() -> str:
    """A fresh database on a server no other test uses meanwhile (this one restarts it)."""
    with pg_database(exclusive=True) as url:
        yield url


def test_a_server_restart_mid_run_loses_no_metric_row(pg_alone, data, tmp_path):
    import time

    pg = pg_alone

    env = {**os.environ, "FIBCTL_DB": pg}
    (tmp_path / "m.toml").write_text(
        '[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\nwindow = 4\n'
        'train = { steps = 300, log_interval = 2, eval_interval = 100, checkpoint_interval = 100 }\n')
    run = lambda *a: subprocess.run([sys.executable, "-m", "fibctl", *a], cwd=tmp_path, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    assert run("queue", "add", "m.toml").returncode == 0
    worker = subprocess.Popen([sys.executable, "-m", "fibctl", "worker", "--data", data, "--runs-dir", "runs",
                               "--plain"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    engine = create_engine(pg)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # restart once training is under way
        with engine.connect() as conn:
            if conn.execute(text("SELECT COUNT(*) FROM train_steps")).scalar() >= 10:
                break
        time.sleep(0.2)
    engine.dispose()
    _restart_server()
    engine = create_engine(pg)
    with engine.connect() as conn:  # the server is back before the run is over: it went down mid-run
        assert conn.execute(text("SELECT MAX(step) FROM train_steps")).scalar() < 300
    engine.dispose()
    out, err = worker.communicate(timeout=300)
    assert worker.returncode == 0, err[-2000:]
    engine = create_engine(pg)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT status FROM runs")).scalar() == "done"
        steps = [s for (s,) in conn.execute(text("SELECT step FROM train_steps ORDER BY step"))]
    engine.dispose()
    assert steps == list(range(2, 301, 2))  # every logged step, the restart notwithstanding


def test_status_watch_rides_out_the_server_going_down(pg_alone, tmp_path):
    """`status --watch` ended, exit code 2, when the server was down as it drew a view: a
    server restart ended every watch on it. The view says the database does not answer, and
    since when, and the watch tries again at its interval until Ctrl-C; a server that does
    not answer at the start is still one line, exit code 2."""
    import select
    import signal
    import time

    from sqlalchemy.engine import make_url

    from fibctl import queue
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect

    env = {**os.environ, "COLUMNS": "80"}
    nowhere = make_url(pg_alone).set(port=1).render_as_string(hide_password=False)  # nothing listens
    done = subprocess.run([sys.executable, "-m", "fibctl", "status", "--watch", "--db", nowhere], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    engine = connect(pg_alone)
    queue.add_runs(engine, [RunConfig.resolve("a", "test", "micro", schedule="fixed")])
    engine.dispose()
    control = _server_control()
    watch = subprocess.Popen([sys.executable, "-m", "fibctl", "status", "--db", pg_alone, "--watch", "--every",
                              "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    shown = b""

    def until(said: bytes) -> bytes:  # what the watch writes from now until it says `said`
        nonlocal shown
        start, deadline = len(shown), time.monotonic() + 60
        while said not in shown[start:] and time.monotonic() < deadline:
            if select.select([watch.stdout], [], [], 1)[0]:
                chunk = os.read(watch.stdout.fileno(), 4096)
                if not chunk:
                    break
                shown += chunk
        return shown[start:]

    try:
        assert b"1 queued" in until(b"1 queued")
        control("stop")
        try:
            down = until(b"trying again every 0.2 s")
        finally:
            control("start")
        assert watch.poll() is None, watch.stderr.read()
        back = until(b"1 queued")
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=60)
    said = " ".join(down.decode().split())
    assert "refused the operation:" in said and "trying again every 0.2 s" in said, down
    assert b"1 queued" in back and watch.returncode == 130 and err == b"interrupted\n", (back, err)


def test_probe_names_the_database_it_queued_into_with_the_password_masked(pg, tmp_path):
    """`fibctl probe` ends with the command that trains its runs, naming --db: it printed the URL
    as given, password and all, to a terminal (and any log of it)."""
    from sqlalchemy.engine import make_url

    url = make_url(pg)
    secret = url.password or "s3cret-unused"  # the test server trusts its clients: any will do
    url = url.set(password=secret).render_as_string(hide_password=False)
    done = subprocess.run([sys.executable, "-m", "fibctl", "probe", "--quick", "--steps", "2", "--db", url],
                          cwd=tmp_path, env={**os.environ, "COLUMNS": "300"},  # the URL on one line
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "queued 2 probe run(s)" in done.stdout, done.stderr[-2000:]
    assert secret not in done.stdout + done.stderr and "fibctl worker --db" in done.stdout


# the server's own words when a write cannot extend a table's file (disk_full), and when the
# disk fails a write (io_error, SQLite's I/O error)
DISK_REFUSALS = [("53100", 'could not extend file "base/16384/16385": No space left on device'),
                 ("58030", 'could not write to file "pg_wal/xlogtemp.52": Input/output error')]


@pytest.mark.parametrize("sqlstate, said_by_server", DISK_REFUSALS, ids=[c for c, _ in DISK_REFUSALS])
@pytest.mark.parametrize("args", [["queue", "add", "paper"], ["db", "upgrade"]], ids=lambda a: " ".join(a))
def test_a_full_disk_on_the_server_is_one_line_naming_the_database(pg, args, sqlstate, said_by_server,
                                                                    monkeypatch, capsys):
    """SQLSTATE 53100 (disk_full) and 58030 (io_error) read "the database refused the operation:
    ..." mid-command and "upgrading ... failed, nothing changed: could not extend ..." in an
    upgrade, where SQLite's full disk and I/O error are said as the disk's. The server raises
    them for real here, from a trigger (a full or failing disk itself is not made in a test):
    the driver's DiskFull and IoError, as they come."""
    from cli_helpers import refused
    from fibctl.db.engine import head_revision, shown, upgrade

    raise_it = f"BEGIN RAISE EXCEPTION '{said_by_server}' USING ERRCODE = '{sqlstate}'; END"
    with create_engine(pg, isolation_level="AUTOCOMMIT").connect() as conn:
        if args[0] == "queue":  # a write once the database is open
            upgrade(pg)
            conn.execute(text(f"CREATE FUNCTION full_disk() RETURNS trigger LANGUAGE plpgsql AS $${raise_it}$$"))
            conn.execute(text("CREATE TRIGGER full_disk BEFORE INSERT ON runs EXECUTE FUNCTION full_disk()"))
        else:  # the upgrade's first table
            conn.execute(text(f"CREATE FUNCTION full_disk() RETURNS event_trigger LANGUAGE plpgsql AS $${raise_it}$$"))
            conn.execute(text("CREATE EVENT TRIGGER full_disk ON ddl_command_start EXECUTE FUNCTION full_disk()"))
    err = refused(monkeypatch, capsys, *args, "--db", pg)
    said = f"its disk is full or not writable ({said_by_server})"
    if args[0] == "queue":
        assert err == f"error: {shown(pg)}: {said}\n"
    else:
        assert err == f"error: upgrading {shown(pg)} to {head_revision()} failed, nothing changed: {said}\n"


# ----------------------------------------------------------------------------- the tests' own connections


def test_a_tests_forgotten_engines_are_closed_before_the_next_test(pg, tmp_path):
    """Engines a test never disposed kept their connections open in their pools until the
    garbage collector took them: test_reports.py, which reads through a new engine in each
    test, held 11 of the server's connections in one test process by its last tests
    (`tests/conftest.py`'s pg_connections_bounded closes them as each test ends)."""
    from sqlalchemy.engine import make_url

    (tmp_path / "test_inner.py").write_text(
        "import os\n"
        "from sqlalchemy import create_engine, text\n"
        "from sqlalchemy.pool import NullPool\n"
        "from fibctl.db.engine import connect\n\n"
        "KEPT = []  # alive: the garbage collector does not close them either\n\n\n"
        "def test_forgets_its_engines():\n"
        "    for _ in range(3):\n"
        "        KEPT.append(connect(os.environ['INNER_DB']))\n"
        "        with KEPT[-1].connect() as conn:\n"
        "            conn.execute(text('SELECT 1'))\n\n\n"
        "def test_then_none_is_open():\n"
        "    admin = create_engine(os.environ['FIBCTL_TEST_PG'], poolclass=NullPool)\n"
        "    with admin.connect() as conn:\n"
        "        n = conn.execute(text('SELECT count(*) FROM pg_stat_activity WHERE datname = :d'),\n"
        "                         {'d': os.environ['INNER_NAME']}).scalar()\n"
        "    assert n == 0\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "INNER_DB": pg, "INNER_NAME": make_url(pg).database,
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                           "-n", "0", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:]


def test_no_more_tests_use_the_server_at_once_than_it_has_connections_for(tmp_path):
    """With pytest-xdist's `-n logical` on a machine of many cores, a test process each, the
    tests together could pass the server's max_connections (PostgreSQL's default is 100; one
    test holds up to 10 connections): each takes one of the server's slots first, which are
    as many as the server has connections for."""
    import time

    import conftest

    slots = conftest.pg_slots()
    admin = create_engine(SERVER)
    with admin.connect() as conn:
        most = int(conn.execute(text("SHOW max_connections")).scalar())
        kept = int(conn.execute(text("SHOW superuser_reserved_connections")).scalar())
    admin.dispose()
    assert slots == 2 or slots * conftest.PG_TEST_CONNECTIONS <= most - kept - conftest.PG_OTHER_CLIENTS
    # more processes than slots, all asking for one at once: no more than the slots hold one
    start = tmp_path / "start"
    child = ("import conftest, os, sys, time\n"
             "conftest._slots()\n"  # asks the server first: then all are ready together
             "print('ready', flush=True)\n"
             "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
             "conftest.hold_pg_slot(); a = time.time(); time.sleep(1); print(a, time.time(), flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", child, str(start)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(slots + 2)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        start.touch()
        held = [tuple(map(float, p.communicate(timeout=120)[0].split())) for p in procs]
    finally:
        for p in procs:
            p.kill()
    at_once = max(sum(a <= t < b for a, b in held) for t, _ in held)
    mine = 1 if conftest._slot else 0  # this test's own, as a test of test_postgres.py
    assert 1 <= at_once <= slots - mine, (at_once, slots, held)
