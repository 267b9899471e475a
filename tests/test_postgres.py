"""The same queue, worker, reports and read-only SQL on a real PostgreSQL server, when
FIBCTL_TEST_PG names one (a URL whose user may create databases, e.g.
postgresql+psycopg://postgres@localhost:5433/postgres); `.ci/run` starts one. Skipped,
saying why, elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from test_queue import eight_claimers_take_each_of_200_runs_once

SERVER = os.environ.get("FIBCTL_TEST_PG")
pytestmark = pytest.mark.skipif(not SERVER, reason="FIBCTL_TEST_PG names no PostgreSQL server")


@pytest.fixture
def pg() -> str:
    """A fresh database on the server, dropped afterwards; its URL."""
    name = f"fibctl_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(SERVER).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


def test_eight_processes_claim_each_of_200_runs_exactly_once(pg, tmp_path):
    eight_claimers_take_each_of_200_runs_once(pg, tmp_path)


def test_queue_worker_eval_report_and_read_only_sql_end_to_end(pg, tmp_path):
    env = {**os.environ, "FIBCTL_DB": pg, "COLUMNS": "120"}

    def fibctl(*args, code=0):
        done = subprocess.run([sys.executable, "-m", "fibctl", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        return done.stdout + done.stderr

    (tmp_path / "m.toml").write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\n'
                                     'window = 4\n\n[[runs]]\nname = "b"\nschedule = "learned"\nwindow = 4\n')
    fibctl("data", "prepare", "quick", "--data", "data", "--plain")
    fibctl("queue", "add", "m.toml")
    assert "2 run(s)" in fibctl("worker", "--data", "data", "--runs-dir", "runs", "--plain")
    fibctl("eval", "a", "b", "--length", "128", "--data", "data")
    assert "docs_val" in fibctl("report", "table1")
    assert "a" in fibctl("sql", "SELECT name, status FROM runs WHERE status = 'done'")
    refused = fibctl("sql", "DELETE FROM runs", code=2)
    assert "read-only" in refused or "refused" in refused
    assert fibctl("sql", "SELECT count(*) AS n FROM runs", "--format", "json").count('"n": 2') == 1
