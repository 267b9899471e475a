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
    for value in (b.claims_per_s, b.plain_per_s, b.claim_ms, b.step_ms):
        assert math.isfinite(value) and value > 0
    assert b.ratio == pytest.approx(b.claims_per_s / b.plain_per_s)


@pytest.mark.skipif(not os.environ.get("FIBCTL_TEST_PG"), reason="FIBCTL_TEST_PG names no PostgreSQL server")
def test_on_postgresql_the_scratch_database_is_dropped_afterwards():
    from sqlalchemy import create_engine, text

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
