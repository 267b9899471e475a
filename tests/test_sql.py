"""`fibctl sql`: read-only queries; writes are refused by the connection, the database unchanged."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.db.engine import connect, resolve_url
from fibctl.errors import FibctlError
from fibctl.reports.sql import query_rows, run_query
from conftest import NO_PG, PG_SERVER, pg_database, reader_url
from test_reports import add_eval, add_run, fails_in_one_line


def _filled(db: str) -> str:
    engine = connect(db)
    with engine.begin() as conn:
        add_eval(conn, add_run(conn, "demo_stagger", "stagger"), 128, 23.0)
        add_eval(conn, add_run(conn, "demo_fixed", "fixed"), 128, 24.0)
    engine.dispose()
    return db


@pytest.fixture
def db(db_url) -> str:
    """Two runs with an evaluation each: a SQLite file, and on the FIBCTL_TEST_PG server (read
    as a role that only reads; its login `db_url` is a superuser)."""
    return reader_url(_filled(db_url))


@pytest.fixture
def sqlite_db(tmp_path) -> str:
    """The same, SQLite only: for the tests of SQLite's own statements, files and modes."""
    return _filled(str(tmp_path / "results.db"))


def _is_sqlite(db: str) -> bool:
    return resolve_url(db).get_backend_name() == "sqlite"


def _digest(db: str):
    """What a write would change. SQLite: the file's bytes. PostgreSQL: every table's
    columns and rows (read through a connection of its own)."""
    if _is_sqlite(db):
        return hashlib.sha256(Path(db).read_bytes()).hexdigest()
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    names = inspect(engine).get_table_names()
    with engine.connect() as conn:
        return {t: ([c["name"] for c in inspect(conn).get_columns(t)],
                    sorted(map(repr, conn.execute(text(f'SELECT * FROM "{t}"')))))
                for t in names}


def test_select_returns_rows(db):
    frame = run_query(db, "SELECT r.name, e.ppl FROM runs r JOIN evaluations e ON e.run_id = r.id ORDER BY e.ppl")
    assert frame.values.tolist() == [["demo_stagger", 23.0], ["demo_fixed", 24.0]]
    # text is passed as written: a colon inside a string literal is not a bind parameter
    assert run_query(db, "SELECT 'at 12:30' AS t").values.tolist() == [["at 12:30"]]
    # nor is a percent sign (psycopg's placeholder mark when given parameters)
    assert run_query(db, "SELECT name, '100%' AS p FROM runs WHERE name LIKE '%stagger'").values.tolist() == [
        ["demo_stagger", "100%"]]
    none = query_rows(db, "SELECT name AS n FROM runs WHERE id < 0")  # no rows, still its columns
    assert (none.columns, none.rows, none.truncated) == (["n"], [], False)


def test_writes_are_refused_by_the_connection_and_nothing_changes(db):
    before = _digest(db)
    for statement in ("INSERT INTO runs (name) VALUES ('x')", "DELETE FROM evaluations",
                      "UPDATE runs SET status = 'failed'", "DROP TABLE runs", "CREATE TABLE t (a INTEGER)"):
        with pytest.raises(FibctlError, match="refused: .*nothing was written"):
            run_query(db, statement)
    assert _digest(db) == before
    assert run_query(db, "SELECT COUNT(*) AS n FROM evaluations").values.tolist() == [[2]]


def test_bad_sql_and_missing_database_are_one_line_errors(db, tmp_path):
    # the driver's own first line
    reason = "no such table: nope" if _is_sqlite(db) else 'relation "nope" does not exist'
    # and, for a table not there, the names of those that are
    tables = "alphas, aux_metrics, evaluations, events, position_losses, runs, train_steps"
    with pytest.raises(FibctlError, match=re.escape(f"SQL error: {reason} (fibctl's tables: {tables})") + "$"):
        run_query(db, "SELECT * FROM nope")
    with pytest.raises(FibctlError, match=r"^SQL error: no such column: nme$|^SQL error: column \"nme\" does not exist$"):
        run_query(db, "SELECT nme FROM runs")
    with pytest.raises(FibctlError, match="no database at"):
        run_query(str(tmp_path / "absent.db"), "SELECT 1")
    assert not (tmp_path / "absent.db").exists()


def test_cli_sql_table_csv_and_json(db):
    runner = CliRunner()
    query = "SELECT name, schedule FROM runs ORDER BY name"
    r = runner.invoke(app, ["sql", query, "--db", db, "--csv"])
    assert r.exit_code == 0 and r.output == "name,schedule\ndemo_fixed,fixed\ndemo_stagger,stagger\n"
    r = runner.invoke(app, ["sql", query, "--db", db, "--json"])
    assert json.loads(r.output) == [{"name": "demo_fixed", "schedule": "fixed"},
                                    {"name": "demo_stagger", "schedule": "stagger"}]
    r = runner.invoke(app, ["sql", query, "--db", db])
    assert r.exit_code == 0 and "demo_stagger" in r.output and "schedule" in r.output


def test_cli_insert_exits_2_with_one_clear_line(db, monkeypatch, capsys):
    from fibctl.cli import main

    before = _digest(db)
    monkeypatch.setattr(sys, "argv", ["fibctl", "sql", "INSERT INTO runs (name) VALUES ('x')", "--db", db])
    with pytest.raises(SystemExit) as done:  # fibctl's main in this process: no new Python to start
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2
    # SQLite's authorizer refuses it before the read-only file would; PostgreSQL's read-only transaction
    refusal = "fibctl sql only reads" if _is_sqlite(db) else "the database is opened read-only"
    assert err.strip().startswith(f"error: refused: {refusal}")
    assert len(err.strip().splitlines()) == 1
    assert _digest(db) == before


@pytest.mark.parametrize("statement", [
    "ATTACH DATABASE '{out}/attached.db' AS other", "VACUUM INTO '{out}/copy.db'", "VACUUM",
    "PRAGMA journal_mode=DELETE", "PRAGMA user_version = 7", "SELECT load_extension('x')",
])
def test_statements_that_create_files_or_change_settings_are_refused(sqlite_db, tmp_path, statement):
    db = sqlite_db  # SQLite's statements and its authorizer
    out = tmp_path / "out"
    out.mkdir()
    before = _digest(db)
    with pytest.raises(FibctlError, match="refused: fibctl sql only reads .*nothing was written"):
        run_query(db, statement.format(out=out))
    assert _digest(db) == before and list(out.iterdir()) == []
    # reading PRAGMAs, with or without an argument, still work
    assert run_query(db, "PRAGMA table_info(runs)")["name"].iloc[0] == "id"
    assert run_query(db, "PRAGMA user_version").values.tolist() == [[0]]


def test_table_valued_pragmas_read_and_the_schema_table_stays_unwritable(sqlite_db):
    """`pragma_table_info('runs')` (a PRAGMA in a SELECT, to join or filter) reads the schema
    as SQLite asks to; writing the schema table is still refused, and nothing changes."""
    before = _digest(sqlite_db)
    columns = run_query(sqlite_db, "SELECT name FROM pragma_table_info('runs') WHERE pk = 1")
    assert columns.values.tolist() == [["id"]]
    assert "ix_runs_matrix" in run_query(sqlite_db, "SELECT name FROM pragma_index_list('runs')")["name"].tolist()
    for statement in ("UPDATE sqlite_master SET sql = 'x' WHERE name = 'runs'", "DELETE FROM sqlite_schema",
                      "PRAGMA writable_schema = ON"):
        with pytest.raises(FibctlError):
            run_query(sqlite_db, statement)
    assert _digest(sqlite_db) == before


def test_rows_and_time_are_bounded(db):
    endless = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c) "
    frame = run_query(db, endless + "SELECT i FROM c", max_rows=5)
    assert frame["i"].tolist() == [1, 2, 3, 4, 5] and frame.attrs["truncated"]
    assert not run_query(db, "SELECT 1 AS one").attrs["truncated"]
    with pytest.raises(FibctlError, match="ran past --timeout 0.3 s"):
        run_query(db, endless + "SELECT max(i) FROM c", timeout_s=0.3)
    r = CliRunner().invoke(app, ["sql", endless + "SELECT i FROM c", "--db", db, "--csv", "--max-rows", "2"])
    assert r.exit_code == 0 and r.stdout == "i\n1\n2\n" and "only the first 2 rows" in r.stderr
    r = CliRunner().invoke(app, ["sql", endless + "SELECT i FROM c", "--db", db, "--csv", "--max-rows", "1"])
    assert r.exit_code == 0 and "note: only the first row;" in r.stderr  # not "the first 1 rows"
    # and the text and bytes printed: 70 rows of a megabyte each are refused, not printed for minutes
    many = (endless + "SELECT hex(zeroblob(500000)) FROM c LIMIT 70" if _is_sqlite(db)
            else "SELECT repeat('x', 1000000) FROM generate_series(1, 70)")
    with pytest.raises(FibctlError, match="the result holds over 64 MiB of text and bytes"):
        run_query(db, many)
    assert len(run_query(db, many.replace("70", "3")).iat[0, 0]) == 1_000_000


def test_another_processs_lock_is_waited_out_within_the_timeout_only(sqlite_db):
    """A writer in exclusive locking mode keeps readers out; --timeout bounds that wait too
    (it was SQLite's 30 s busy timeout, whatever --timeout said)."""
    holder = subprocess.Popen([sys.executable, "-c", f"""if True:
        import sqlite3, sys
        c = sqlite3.connect({sqlite_db!r}, isolation_level=None)
        c.execute("PRAGMA locking_mode=EXCLUSIVE")
        c.execute("BEGIN EXCLUSIVE"); c.execute("UPDATE runs SET name = name")
        print("locked", flush=True); sys.stdin.read()"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        started = time.monotonic()
        with pytest.raises(FibctlError, match=r"locked by another process: waited 1 s"):
            query_rows(sqlite_db, "SELECT count(*) FROM runs", timeout_s=1)
        assert time.monotonic() - started < 15  # not the 30 s busy timeout
    finally:
        holder.communicate("", timeout=60)
    assert query_rows(sqlite_db, "SELECT count(*) FROM runs", timeout_s=1).rows == [(2,)]


def test_a_wal_database_in_a_folder_that_cannot_be_written_is_read(sqlite_db, monkeypatch):
    import os
    db = sqlite_db
    from fibctl.db import engine as db_engine
    assert run_query(db, "PRAGMA journal_mode").values.tolist() == [["wal"]]
    for leftover in (db + "-shm", db + "-wal"):  # as a copy of the file alone would be
        if os.path.exists(leftover):
            os.remove(leftover)
    # the tests run as root, for whom every folder is writable: the check is what is replaced
    real = os.access
    monkeypatch.setattr(db_engine.os, "access", lambda path, mode: mode != os.W_OK and real(path, mode))
    assert run_query(db, "SELECT count(*) AS n FROM runs").values.tolist() == [[2]]
    assert not os.path.exists(db + "-shm")


def test_rows_still_in_the_wal_are_read_in_a_folder_that_cannot_be_written(sqlite_db, monkeypatch):
    """A writer's committed rows not yet checkpointed into the file (another host's worker, a
    killed one) were skipped: the folder's database was read immutable, the file alone."""
    import os

    from fibctl.db import engine as db_engine

    subprocess.run([sys.executable, "-c", f"""if True:
        import os, sqlite3
        c = sqlite3.connect({sqlite_db!r})
        c.execute("PRAGMA wal_autocheckpoint=0")
        c.execute("UPDATE runs SET status = 'failed' WHERE name = 'demo_fixed'")
        c.commit()
        os._exit(0)  # no checkpoint at close: the row stays in the -wal, as a killed writer leaves it"""],
                   check=True, timeout=60)
    assert os.path.getsize(sqlite_db + "-wal") > 0
    real = os.access  # the tests run as root, for whom every folder is writable
    monkeypatch.setattr(db_engine.os, "access", lambda path, mode: mode != os.W_OK and real(path, mode))
    assert query_rows(sqlite_db, "SELECT status FROM runs WHERE name = 'demo_fixed'").rows == [("failed",)]
    os.remove(sqlite_db + "-shm")  # without it SQLite cannot read the -wal there: refused, not read stale
    with pytest.raises(FibctlError, match=r"has committed changes in results.db-wal that SQLite cannot read"):
        query_rows(sqlite_db, "SELECT status FROM runs")


def test_markup_and_blobs_from_data_are_printed_as_they_are(db):
    blob = "x'00ff'" if _is_sqlite(db) else "'\\x00ff'::bytea"  # each dialect's blob literal
    query = f"SELECT '[/]' AS a, '[bold red]boom[/bold red]' AS \"[b]\", {blob} AS blob"
    r = CliRunner().invoke(app, ["sql", query, "--db", db])
    assert r.exit_code == 0 and "[/]" in r.output and "[bold red]boom[/bold red]" in r.output and "[b]" in r.output
    r = CliRunner().invoke(app, ["sql", query, "--db", db, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)[0]["blob"] == "x'00ff'"


def test_values_are_written_as_the_database_returns_them(db):
    """NULL is NULL (not nan), an integer column beside a NULL stays integers, slashes are
    not escaped; --format is the one name, --csv and --json its older spellings."""
    runner = CliRunner()
    query = ("SELECT id, CASE WHEN id = 1 THEN NULL ELSE 8 END AS steps, 'runs/a/step_1.pt' AS path, 2.5 AS x "
             "FROM runs ORDER BY id")
    r = runner.invoke(app, ["sql", query, "--db", db])
    assert r.exit_code == 0, r.output
    assert "NULL" in r.output and "nan" not in r.output and "8.0" not in r.output and "runs/a/step_1.pt" in r.output
    for args in (["--csv"], ["--format", "csv"]):
        r = runner.invoke(app, ["sql", query, "--db", db, *args])
        assert r.exit_code == 0 and r.stdout == "id,steps,path,x\n1,,runs/a/step_1.pt,2.5\n2,8,runs/a/step_1.pt,2.5\n"
    for args in (["--json"], ["--format", "json"]):
        r = runner.invoke(app, ["sql", query, "--db", db, *args])
        assert r.exit_code == 0 and "runs/a/step_1.pt" in r.stdout and "\\/" not in r.stdout
        assert json.loads(r.stdout) == [{"id": 1, "steps": None, "path": "runs/a/step_1.pt", "x": 2.5},
                                        {"id": 2, "steps": 8, "path": "runs/a/step_1.pt", "x": 2.5}]
    frame = run_query(db, query)
    assert frame.values.tolist() == [[1, None, "runs/a/step_1.pt", 2.5], [2, 8, "runs/a/step_1.pt", 2.5]]
    assert all(type(v) is int for v in frame["id"])
    # a NUMERIC (PostgreSQL's 2.5 above, and sums and averages of integers) is a JSON number
    r = runner.invoke(app, ["sql", "SELECT CAST(3 AS NUMERIC) AS n, CAST(0.25 AS NUMERIC) AS q", "--db", db, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"n": 3, "q": 0.25}]
    for args, message in ((["--format", "xml"], "--format 'xml': allowed: table, csv, json"),
                          (["--csv", "--json"], "give one output format")):
        r = runner.invoke(app, ["sql", "SELECT 1", "--db", db, *args])
        assert r.exit_code != 0 and message in str(r.exception), r.output


@pytest.mark.parametrize("statement", ["COPY (SELECT 1) TO '{out}'", "COPY (SELECT 1) TO PROGRAM 'touch {out}'",
                                       "SELECT pg_read_file('/etc/hostname')"])
def test_postgresql_server_files_and_programs_are_out_of_reach(db, tmp_path, statement):
    """A role that only reads (pg_read_all_data) can neither write server files nor run programs."""
    if _is_sqlite(db):
        pytest.skip("PostgreSQL's COPY and server file functions")
    out = tmp_path / "written-by-sql"
    with pytest.raises(FibctlError, match="permission denied|must be superuser|privileges"):
        run_query(db, statement.format(out=out))
    assert not out.exists()
    assert run_query(db, "SELECT COUNT(*) AS n FROM runs")["n"].iloc[0] == 2  # tables still read


# a statement that takes the login's role back first: fibctl's SET ROLE pg_read_all_data held
# against none of them (a superuser read the server's files and ran a program)
ESCAPES = ["DO $$BEGIN PERFORM set_config('role', 'none', false); "
           "EXECUTE 'COPY (SELECT 1) TO PROGRAM ''touch {out}'''; END$$",
           "SELECT set_config('role', 'none', false), "
           "query_to_xml('SELECT pg_read_file(''/etc/hostname'')', true, true, '') AS x",
           "SELECT set_config('session_authorization', session_user, false), "
           "query_to_xml('SELECT pg_ls_dir(''/'')', true, true, '') AS x"]


@pytest.mark.skipif(not PG_SERVER, reason=NO_PG)
@pytest.mark.parametrize("statement", ESCAPES)
def test_a_login_that_may_reach_the_servers_files_is_refused(tmp_path, statement, monkeypatch, capsys):
    """No setting holds a superuser to reading: fibctl sql refuses such a login (the test
    server's own) in one line, exit 2, running nothing; a role that only reads gets the same
    statement refused by the server, nothing run."""
    from fibctl.cli import main

    out = "/tmp/fibctl-test-sql-ran"  # the server's user writes there, not into tmp_path
    Path(out).unlink(missing_ok=True)
    with pg_database() as url:
        _filled(url)
        with create_engine(url, poolclass=NullPool).connect() as conn:
            login, superuser = conn.execute(text("SELECT rolname, rolsuper FROM pg_roles "
                                                 "WHERE rolname = current_user")).one()
        if not superuser:
            pytest.skip("the FIBCTL_TEST_PG login is not a superuser")
        before = _digest(url)
        monkeypatch.setattr(sys, "argv", ["fibctl", "sql", statement.format(out=out), "--db", url])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.strip().splitlines() == [
            f"error: fibctl sql: role {login!r} is a superuser: a statement run as it reaches the server's files "
            "and programs whatever fibctl sets; connect as a role that only reads (CREATE ROLE reader LOGIN; "
            "GRANT pg_read_all_data TO reader)"], err
        with pytest.raises(FibctlError, match="permission denied|must be superuser|privileges"):
            run_query(reader_url(url), statement.format(out=out))
        assert not Path(out).exists() and _digest(url) == before


@pytest.mark.parametrize("statement", [
    "SELECT 1; ROLLBACK; INSERT INTO runs (name) VALUES ('x')",  # the transaction and SET ROLE undone
    "END; RESET ROLE; COPY (SELECT 1) TO '{out}'",
    "SELECT 1; SELECT 2",
])
def test_one_statement_at_a_time(db, tmp_path, statement):
    """PostgreSQL ran a string of statements as it was: one that ended the read-only
    transaction ran the rest as the login role (a superuser wrote a server file, a row)."""
    out = tmp_path / "written-by-sql"
    before = _digest(db)
    with pytest.raises(FibctlError, match="one statement at a time|refused: "):  # SQLite: END is a write
        run_query(db, statement.format(out=out))
    assert not out.exists() and _digest(db) == before


def test_copy_to_stdout_is_one_line(db, tmp_path, monkeypatch, capsys):
    """COPY ... TO STDOUT left PostgreSQL's connection mid-copy: its reset logged tracebacks."""
    if _is_sqlite(db):
        pytest.skip("PostgreSQL's COPY")
    fails_in_one_line(["sql", "COPY runs TO STDOUT", "--db", db], tmp_path, "not COPY", monkeypatch, capsys)


def test_a_statement_past_the_heap_limit_is_one_line(sqlite_db, tmp_path, monkeypatch, capsys):
    """SQLite's driver raises MemoryError past the heap limit: it was a traceback, exit 1."""
    monkeypatch.setattr("fibctl.reports.sql.HEAP_LIMIT_BYTES", 64 << 20)
    fails_in_one_line(["sql", "SELECT length(hex(zeroblob(50000000)))", "--db", sqlite_db], tmp_path,
                      "stopped: the statement needed more than", monkeypatch, capsys)


@pytest.mark.parametrize("args, words", [
    (["select 1", "--max-rows", "99999999999999999999"], "--max-rows must be 1 to 1,000,000,000"),
    (["select 1", "--max-rows", "9223372036854775807"], "--max-rows must be 1 to"),
    (["select 1", "--timeout", "inf"], "--timeout must be above 0"),
    (["select 1", "--timeout", "nan"], "--timeout must be above 0"),
    # nothing to run: "(no rows)" and exit 0 said it had worked
    ([""], "the SQL statement is empty"),
    ([" \n\t "], "the SQL statement is empty"),
    (["/* only a comment */"], "returned no result set"),
    ([";"], "returned no result set"),
    # two output formats: --format table is no default to override
    (["select 1", "--format", "table", "--csv"], "give one output format"),
    # the driver's message carries the query's names: shown, not obeyed
    (['select * from "a\x1b[31m"', "--max-rows", "5"], "SQL error: no such table: a\\x1b[31m"),
])
def test_cli_bad_input_is_one_line_exit_2(sqlite_db, args, words, monkeypatch, capsys):
    line = fails_in_one_line(["sql", *args, "--db", sqlite_db], Path(sqlite_db).parent, words, monkeypatch, capsys)
    assert "\x1b" not in line


def test_control_characters_are_escaped_in_the_table_and_exact_in_csv_and_json(db):
    """The table is for a terminal, which obeys ESC (colours, clearing), CR (overwriting) and
    bidi overrides: it shows them escaped, and keeps line breaks. CSV and JSON are data: exact."""
    char = "char" if _is_sqlite(db) else "chr"
    value = "\x1b[31mRED\rx\ty\u202e\nnext"
    query = (f"SELECT {char}(27) || '[31mRED' || {char}(13) || 'x' || {char}(9) || 'y' || {char}(8238) || "
             f"{char}(10) || 'next' AS \"v\x1b\"")
    r = CliRunner().invoke(app, ["sql", query, "--db", db])
    assert r.exit_code == 0, r.output
    assert "v\\x1b" in r.stdout and "\\x1b[31mRED\\rx\\ty\\u202e" in r.stdout and "next" in r.stdout
    assert not any(c in r.stdout for c in "\x1b\r\t\u202e")
    r = CliRunner().invoke(app, ["sql", query, "--db", db, "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == [{"v\x1b": value}]
    r = CliRunner().invoke(app, ["sql", query, "--db", db, "--csv"])
    assert r.exit_code == 0 and "\x1b[31mRED\rx\ty\u202e" in r.stdout


@pytest.mark.parametrize("signum,code,said", [
    (signal.SIGTERM, 128 + signal.SIGTERM, ""),
    (signal.SIGINT, 130, "interrupted: the statement was stopped; nothing was written"),
])
def test_a_statement_stopped_by_a_signal_exits_as_the_signal_and_leaves_the_folder_as_it_was(
        tmp_path, signum, code, said):
    """SQLite took the signal for the deadline ('ran past --timeout', exit 2), and SIGTERM
    killed the command before it removed the -wal and -shm files its reading had made."""
    connect(str(tmp_path / "r.db")).dispose()  # a WAL database: reading it makes -wal and -shm
    before = sorted(p.name for p in tmp_path.iterdir())
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    proc = subprocess.Popen([sys.executable, "-m", "fibctl", "sql", endless, "--db", "r.db", "--timeout", "120"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "r.db-wal").exists() and time.monotonic() < deadline:  # the statement runs
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.strip() == said, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_result_refused_with_rows_still_pending_leaves_the_folder_as_it_was(sqlite_db, monkeypatch, capsys):
    """Refused past the size cap with rows left to fetch, the statement stayed open on its
    connection (the error's traceback held it) until after the command had tidied the folder:
    the WAL database's -wal and -shm files were left beside it."""
    folder = Path(sqlite_db).parent
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setattr("fibctl.reports.sql.MAX_RESULT_BYTES", 1000)
    query = "SELECT hex(zeroblob(1000)) FROM runs a, runs b"  # 4 rows: some still to fetch when refused
    fails_in_one_line(["sql", query, "--db", sqlite_db, "--max-rows", "1"], folder, "the result holds over",
                      monkeypatch, capsys)
    assert sorted(p.name for p in folder.iterdir()) == before  # -wal and -shm too


def test_a_result_past_the_size_cap_is_refused_before_all_of_it_is_fetched(sqlite_db, monkeypatch):
    """The size was counted after every row (up to --max-rows) had been fetched: 929 MB of
    memory to refuse a 64 MiB result. Rows are counted as they arrive, and stopped at the cap."""
    from sqlalchemy.engine import CursorResult

    fetched = []
    fetchmany = CursorResult.fetchmany

    def counted(self, size=None):
        rows = fetchmany(self, size)
        fetched.append(len(rows))
        return rows

    monkeypatch.setattr(CursorResult, "fetchmany", counted)
    monkeypatch.setattr("fibctl.reports.sql.MAX_RESULT_BYTES", 20_000)
    rows = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c LIMIT 1000) "
    with pytest.raises(FibctlError, match="the result holds over"):
        query_rows(sqlite_db, rows + "SELECT hex(zeroblob(500)) FROM c")  # 1,000 characters a row
    assert 21 <= sum(fetched) <= 40  # not all 1,000
    # under the cap, every row, fetched in batches as large as the cap leaves room for
    fetched.clear()
    assert len(query_rows(sqlite_db, rows + "SELECT hex(zeroblob(5)) FROM c").rows) == 1000
    assert max(fetched) <= 1000 and len(fetched) < 20


def test_csv_and_json_are_written_as_they_are_made(sqlite_db, monkeypatch):
    """Both were made whole, then written: 100,000 rows of 47 columns as json held 1 GB."""
    import typer

    from fibctl.reports import sql as sql_module

    made, written = [0], []
    cell = sql_module.cell

    def counted(v):
        made[0] += 1
        return cell(v)

    monkeypatch.setattr(sql_module, "cell", counted)
    monkeypatch.setattr(typer, "echo", lambda message=None, **kw: written.append((made[0], message)))
    query = ("WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c LIMIT 20000) "
             "SELECT i, 'some text' AS t FROM c")
    for fmt, parse in (("csv", lambda out: out.splitlines()[1:]), ("json", json.loads)):
        made[0], written[:] = 0, []
        r = CliRunner().invoke(app, ["sql", query, "--db", sqlite_db, "--format", fmt])
        assert r.exit_code == 0, r.output
        assert made[0] == 40_000 and len(written) > 2 and written[0][0] < made[0] / 2  # begun before the end
        assert len(parse("".join(text for _, text in written))) == 20_000


@pytest.mark.parametrize("rows", [[], [(1, None, "a\nb \u2028 \"q\" /", 2.5)], [(1, None, "x", 2.5), (2, 8, "", -1.0)],
                                  [(), ()]])
def test_json_a_record_at_a_time_is_json_dumps_of_the_list(rows):
    from fibctl.reports.sql import Rows, json_lines

    columns = ["a", "b", "c", "d"][:len(rows[0]) if rows else 4]
    whole = json.dumps([dict(zip(columns, row)) for row in rows], indent=2, ensure_ascii=False)
    assert "".join(json_lines(Rows(columns, rows, False))) == whole


def test_json_refuses_two_columns_named_alike(sqlite_db, monkeypatch, capsys):
    """A record holds one value per name: the first `id` of `SELECT r.id, e.id` was dropped unsaid."""
    query = "SELECT r.id, e.id FROM runs r JOIN evaluations e ON e.run_id = r.id"
    fails_in_one_line(["sql", query, "--db", sqlite_db, "--format", "json"], Path(sqlite_db).parent,
                      "the result has more than one column named 'id', and a JSON record holds one value per name",
                      monkeypatch, capsys)
    r = CliRunner().invoke(app, ["sql", query, "--db", sqlite_db, "--format", "csv"])
    assert r.exit_code == 0 and r.stdout.startswith("id,id\n"), r.output


def test_the_table_format_is_bounded(sqlite_db, monkeypatch, capsys):
    """rich draws a table whole: 30,000 rows of 8 columns took 30 s and 645 MB, 100,000 rows
    of 80 columns minutes and 4.7 GB. Past its bounds the table is refused before anything is
    printed, saying what to do; csv and json still write it."""
    monkeypatch.setattr("fibctl.cli.report.TABLE_MAX_VALUES", 10)
    monkeypatch.setattr("fibctl.cli.report.TABLE_MAX_CHARACTERS", 100)
    rows = "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c LIMIT {}) "
    runner = CliRunner()
    for query, words in ((rows.format(6) + "SELECT i, i AS j FROM c", "(6 rows of 2 columns)"),  # 12 values
                         (rows.format(5) + "SELECT printf('%030d', i) FROM c", "or --max-rows 3"),  # 150 characters
                         ("SELECT hex(zeroblob(51))", "or select part of each value (substr)")):
        r = runner.invoke(app, ["sql", query, "--db", sqlite_db])
        assert r.exit_code != 0 and r.stdout == "" and words in str(r.exception), r.output
        assert "use --format csv or --format json" in str(r.exception)
        assert runner.invoke(app, ["sql", query, "--db", sqlite_db, "--csv"]).exit_code == 0
    # at the bounds, drawn; through the command line, one line and exit 2 past them
    r = runner.invoke(app, ["sql", rows.format(5) + "SELECT i, i AS j FROM c", "--db", sqlite_db])
    assert r.exit_code == 0 and r.stdout.splitlines()[-2] == "│ 5 │ 5 │"
    fails_in_one_line(["sql", rows.format(6) + "SELECT i, i AS j FROM c", "--db", sqlite_db], Path(sqlite_db).parent,
                      "is more than the table format draws (10 values or 100 characters); use --format csv or "
                      "--format json, or --max-rows 5", monkeypatch, capsys)


def test_the_table_right_aligns_columns_of_numbers(sqlite_db):
    """As every other table fibctl prints: digits line up; text, and a column mixing text and
    numbers, stay left."""
    query = "SELECT 1 AS n, 'a' AS t, 1 AS mixed UNION ALL SELECT 100, 'bbb', 'x' UNION ALL SELECT NULL, 'c', 2"
    r = CliRunner().invoke(app, ["sql", query, "--db", sqlite_db], env={"COLUMNS": "80"})
    rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert [line.split("│")[1:4] for line in rows] == [
        ["    1 ", " a   ", " 1     "], ["  100 ", " bbb ", " x     "], [" NULL ", " c   ", " 2     "]], r.stdout
