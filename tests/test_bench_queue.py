"""`fibctl bench queue`: fibctl's claim against a plain claim loop, in a scratch database;
structure only (numbers are measured by the command, never asserted)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from fibctl.errors import FibctlError
from fibctl.flows.bench_queue import bench_queue


def test_every_run_is_claimed_by_both_loops_and_the_ratios_are_reported():
    b = bench_queue(None, processes=2, runs=20)
    assert (b.backend, b.processes, b.runs) == ("sqlite", 2, 20)
    for value in (b.solo_claim_ms, b.solo_plain_ms, b.claims_per_s, b.plain_per_s, b.claim_ms, b.step_ms):
        assert math.isfinite(value) and value > 0
    assert b.ratio == pytest.approx(b.claims_per_s / b.plain_per_s)
    assert b.solo_ratio == pytest.approx(b.solo_plain_ms / b.solo_claim_ms)
    assert b.solo_vs_step == pytest.approx(b.solo_claim_ms / b.step_ms)


def test_cli_prints_one_process_and_several_within_80_columns():
    done = subprocess.run([sys.executable, "-m", "fibctl", "bench", "queue", "--processes", "2", "--runs", "10"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    rows = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert rows == ["1", "2"]  # the uncontended row, then the contended one
    assert "micro step:" in done.stdout and "%" in done.stdout


@pytest.mark.skipif(not os.environ.get("FIBCTL_TEST_PG"), reason="FIBCTL_TEST_PG names no PostgreSQL server")
def test_on_postgresql_the_scratch_database_is_dropped_afterwards():
    from sqlalchemy import create_engine, text

    from conftest import pg_server

    with pg_server():
        b = bench_queue(os.environ["FIBCTL_TEST_PG"], processes=2, runs=20)
        assert b.backend == "postgresql"
        with create_engine(os.environ["FIBCTL_TEST_PG"]).connect() as conn:
            assert not conn.execute(text("SELECT datname FROM pg_database WHERE datname LIKE 'fibctl_bench_%'")).all()


def test_bad_input_is_one_line(monkeypatch):
    with pytest.raises(FibctlError, match="--processes must be >= 1"):
        bench_queue(None, processes=4, runs=2)
    # --runs 99999999999 resolved configs for hours, then ran out of memory; --processes forked as many
    monkeypatch.setattr("fibctl.flows.bench_queue.RunConfig", None)  # nothing may be resolved
    for processes, runs in ((8, 99_999_999_999), (100_000, 100_000)):
        with pytest.raises(FibctlError, match="--processes and --runs are at most 256 and 1,000,000"):
            bench_queue(None, processes=processes, runs=runs)
    done = subprocess.run([sys.executable, "-m", "fibctl", "bench", "queue", "--db", "mysql://x@h/db"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "SQLite or PostgreSQL" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("db", ["adir", "sqlite:///x.db"])
def test_a_sqlite_db_which_would_be_ignored_is_refused(db, tmp_path, monkeypatch):
    """SQLite is benchmarked in a temporary file: `--db adir` was silently ignored."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FibctlError, match=r"bench queue takes --db for a PostgreSQL server only"):
        bench_queue(db, processes=2, runs=20)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("child, words", [
    # a connection refused (too many clients on a PostgreSQL server, say)
    ("def connect(db, **kw):\n"
     "    if os.getpid() != parent:\n"
     "        raise bq.FibctlError('too many connections (a test)')\n"
     "    return real(db, **kw)\n"
     "bq.connect = connect\n", "a claiming process failed: too many connections (a test)"),
    ("bq._claimer = lambda *a: os._exit(3)\n", "a claiming process ended with exit code 3"),  # killed, say
])
def test_a_claiming_process_that_fails_is_one_line_not_a_wait(child, words):
    """It printed a traceback per failed process, and the command waited 600 s for it, the
    other processes at the barrier, then ended in a traceback of its own."""
    script = ("import os, sys\nimport fibctl.flows.bench_queue as bq\nparent, real = os.getpid(), bq.connect\n"
              + child + "from fibctl.cli import main\n"
              "sys.argv = ['fibctl', 'bench', 'queue', '--processes', '2', '--runs', '4']\nmain()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith(f"error: bench queue: {words}"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_the_help_gives_the_limits_that_are_enforced():
    from fibctl.flows.bench_queue import MAX_PROCESSES, MAX_RUNS

    done = subprocess.run([sys.executable, "-m", "fibctl", "bench", "queue", "--help"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert f"(at most {MAX_PROCESSES})" in done.stdout and f"(at most {MAX_RUNS:,})" in done.stdout, done.stdout
