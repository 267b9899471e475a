"""`fibctl db copy`: a whole database into another, idempotent, counts equal afterwards;
SQLite to SQLite always; to and from PostgreSQL when FIBCTL_TEST_PG names a server (the
source is test_reports.py's study, on each backend)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import text

from fibctl.db.copy import copy_database, counts
from fibctl.db.engine import connect
from fibctl.errors import FibctlError
from fibctl.queue import add_runs
from test_reports import study  # noqa: F401  (the small imported study: every table has rows)
from train_helpers import micro_run


def fibctl(monkeypatch, capsys, *args: str) -> subprocess.CompletedProcess:
    """`fibctl ARGS` run by its main in this process (a new Python cost seconds of imports), as
    the CompletedProcess a process would have given."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["fibctl", *args], done.value.code, out.out, out.err)


@pytest.fixture
def target(db_url):
    return db_url


def test_copy_is_whole_and_idempotent(study, target):  # noqa: F811
    source = connect(study)
    first = copy_database(source, connect(target))
    assert counts(connect(target)) == counts(source) and first.rows["evaluations"] > 0
    again = copy_database(source, connect(target))
    assert again.written == 0 and counts(connect(target)) == counts(source)
    with connect(target).connect() as conn:  # a metric landed on its run, by name
        assert conn.execute(text(
            "SELECT COUNT(*) FROM evaluations e JOIN runs r ON r.id = e.run_id "
            "WHERE r.name = 'f13__fib_stagger_w12'")).scalar() > 0


def test_a_target_run_with_another_config_is_refused_and_nothing_copied(study, tmp_path):  # noqa: F811
    target = connect(str(tmp_path / "t.db"))
    clash = micro_run("f13__fib_stagger_w12")
    add_runs(target, [clash])
    with pytest.raises(FibctlError, match="already has run.*f13__fib_stagger_w12.*nothing was copied"):
        copy_database(connect(study), target)
    assert counts(target)["runs"] == 1


def test_cli_copy(study, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = str(tmp_path / "c.db")
    done = fibctl(monkeypatch, capsys, "db", "copy", "--from", study, "--to", out)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and counts(connect(out)) == counts(connect(study))
    again = fibctl(monkeypatch, capsys, "db", "copy", "--from", study, "--to", out)
    assert "nothing (already copied)" in " ".join(again.stdout.split())


def test_cli_copy_onto_itself_is_refused_and_changes_nothing(study, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The same SQLite file by another path, or the same server database: refused, untouched."""
    import hashlib
    import shutil

    from fibctl.db.engine import shown

    if "://" in study:  # a server database: the same URL again
        source = target = study
        state = lambda: counts(connect(study))  # noqa: E731
    else:
        source, target = str(tmp_path / "self.db"), f"{tmp_path}/../{tmp_path.name}/self.db"
        shutil.copy(study, source)
        state = lambda: (sorted(p.name for p in tmp_path.iterdir()),  # noqa: E731
                         hashlib.sha256((tmp_path / "self.db").read_bytes()).hexdigest())
    before = state()
    done = fibctl(monkeypatch, capsys, "db", "copy", "--from", source, "--to", target)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: --from and --to are the same database ({shown(source)}); nothing to copy"]
    assert state() == before
