"""`fibctl sql`: read-only queries; writes are refused by the connection, the database unchanged."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.db.engine import connect
from fibctl.errors import FibctlError
from fibctl.reports.sql import run_query
from test_reports import add_eval, add_run


@pytest.fixture
def db(tmp_path) -> str:
    path = str(tmp_path / "results.db")
    engine = connect(path)
    with engine.begin() as conn:
        add_eval(conn, add_run(conn, "demo_stagger", "stagger"), 128, 23.0)
        add_eval(conn, add_run(conn, "demo_fixed", "fixed"), 128, 24.0)
    engine.dispose()
    return path


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_select_returns_rows(db):
    frame = run_query(db, "SELECT r.name, e.ppl FROM runs r JOIN evaluations e ON e.run_id = r.id ORDER BY e.ppl")
    assert frame.values.tolist() == [["demo_stagger", 23.0], ["demo_fixed", 24.0]]
    # text is passed as written: a colon inside a string literal is not a bind parameter
    assert run_query(db, "SELECT 'at 12:30' AS t").values.tolist() == [["at 12:30"]]


def test_writes_are_refused_by_the_connection_and_nothing_changes(db):
    before = _digest(db)
    for statement in ("INSERT INTO runs (name) VALUES ('x')", "DELETE FROM evaluations",
                      "UPDATE runs SET status = 'failed'", "DROP TABLE runs", "CREATE TABLE t (a INTEGER)"):
        with pytest.raises(FibctlError, match="refused: the database is opened read-only"):
            run_query(db, statement)
    assert _digest(db) == before
    assert run_query(db, "SELECT COUNT(*) AS n FROM evaluations").values.tolist() == [[2]]


def test_bad_sql_and_missing_database_are_one_line_errors(db, tmp_path):
    with pytest.raises(FibctlError, match="SQL error: no such table: nope"):
        run_query(db, "SELECT * FROM nope")
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


def test_cli_insert_exits_2_with_one_clear_line(db):
    before = _digest(db)
    r = subprocess.run([sys.executable, "-m", "fibctl", "sql", "INSERT INTO runs (name) VALUES ('x')", "--db", db],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: refused: the database is opened read-only")
    assert len(r.stderr.strip().splitlines()) == 1
    assert _digest(db) == before
