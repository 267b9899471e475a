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


def test_bad_input_is_one_line():
    with pytest.raises(FibctlError, match="--processes must be >= 1"):
        bench_queue(None, processes=4, runs=2)
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
