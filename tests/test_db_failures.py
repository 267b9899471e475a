"""Write commands that fail leave the database as it was: an unwritable file or folder is one
line, before SQLite opens it; a refused command neither upgrades a database nor switches it to
WAL mode; a damaged file is one line wherever a query meets its bad page."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from cli_helpers import refused
from fibctl.db.engine import current_revision, head_revision, upgrade

EXAMPLE = Path(__file__).resolve().parent.parent / "results.db.example"  # rollback-journal mode
MATRIX = """[matrix]
preset = "micro"

[[runs]]
name = "r1"
schedule = "stagger"
window = 8
"""


@contextlib.contextmanager
def immutable(path: Path):
    """chattr +i on `path` for the block (it refuses root too); skipped where chattr cannot."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here to make a file immutable")
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"chattr +i is refused here (not root, or a file system without it): {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _state(folder: Path) -> dict:
    """Every file in `folder` with a hash of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _journal_mode(db: Path) -> str:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()


def _rollback_db(tmp_path: Path, name: str = "t.db") -> Path:
    """A current fibctl database in rollback-journal mode, with run r1 queued."""
    db = tmp_path / name
    (tmp_path / "m.toml").write_text(MATRIX)
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect, release
    from fibctl.queue import add_runs

    add_runs(connect(str(db)), [RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=8)])
    release()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    assert _journal_mode(db) == "delete"
    return db


WRITES = [["queue", "add", "m.toml"], ["queue", "cancel", "r1"], ["queue", "retry", "r1"], ["queue", "rm", "r1"],
          ["db", "upgrade"]]


@pytest.mark.parametrize("args", WRITES, ids=lambda a: " ".join(a[:2]))
def test_a_write_to_an_immutable_rollback_journal_database_is_one_line(args, tmp_path, monkeypatch, capsys):
    """It was a traceback (attempt to write a readonly database) from the WAL switch."""
    db = _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    with immutable(db):
        err = refused(monkeypatch, capsys, *args, "--db", "t.db")
    assert "cannot write to database t.db: the file is not writable" in err
    assert _state(tmp_path) == before


def test_a_copy_into_an_immutable_database_is_one_line(tmp_path, monkeypatch, capsys):
    _rollback_db(tmp_path, "src.db")
    db = _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    with immutable(db):
        err = refused(monkeypatch, capsys, "db", "copy", "--from", "src.db", "--to", "t.db")
    assert "cannot write to database t.db: the file is not writable" in err
    assert _state(tmp_path) == before


@pytest.mark.parametrize("args", WRITES, ids=lambda a: " ".join(a[:2]))
def test_a_write_to_a_rollback_journal_database_in_an_immutable_folder_is_one_line(args, tmp_path, monkeypatch,
                                                                                  capsys):
    """It was a traceback (unable to open database file): SQLite needs a -journal file there."""
    folder = tmp_path / "d"
    folder.mkdir()
    _rollback_db(folder)
    monkeypatch.chdir(folder)
    before = _state(folder)
    with immutable(folder):
        err = refused(monkeypatch, capsys, *args, "--db", "t.db")
    assert f"cannot write to database t.db: directory {folder} is not writable" in err
    assert _state(folder) == before


def test_a_write_to_an_immutable_wal_database_leaves_no_files_beside_it(tmp_path, monkeypatch, capsys):
    """`queue add` with nothing new to add succeeded, leaving -wal and -shm files that nothing
    removed (SQLite opened the file read-only and made them in the folder)."""
    db = _rollback_db(tmp_path)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    with immutable(db):
        err = refused(monkeypatch, capsys, "queue", "add", "m.toml", "--db", "t.db")
    assert "cannot write to database t.db: the file is not writable" in err
    assert _state(tmp_path) == before


REFUSED = [["queue", "cancel", "nosuch"], ["queue", "retry", "nosuch"], ["queue", "rm", "nosuch"],
           ["queue", "retry", "r1"],  # queued, not failed
           ["queue", "rm", "r1", "--checkpoints", "--runs-dir", "nowhere"],
           ["train", "nosuch"], ["eval", "nosuch", "--length", "64"]]


@pytest.mark.parametrize("args", REFUSED, ids=" ".join)
def test_a_refused_command_leaves_a_rollback_journal_database_as_it_was(args, tmp_path, monkeypatch, capsys):
    """`queue cancel nosuch` failed, having switched the database to WAL mode."""
    db = _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    refused(monkeypatch, capsys, *args, "--db", "t.db")
    assert _state(tmp_path) == before and _journal_mode(db) == "delete"


@pytest.mark.parametrize("args", [["queue", "retry", "r1", "--from-start"], ["queue", "rm", "r1", "--checkpoints"]],
                         ids=" ".join)
def test_a_refusal_about_the_run_s_folder_leaves_a_rollback_journal_database_as_it_was(args, tmp_path, monkeypatch,
                                                                                        capsys):
    """retry --from-start with a checkpoint still there, and rm --checkpoints on a folder that
    is a link, were refused inside the command's transaction: after the WAL switch."""
    (tmp_path / "db").mkdir()
    db = _rollback_db(tmp_path / "db")
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE runs SET status = 'failed', runs_dir = ?", (str(tmp_path / "runs"),))
    conn.close()
    (tmp_path / "runs").mkdir()
    if "--from-start" in args:
        (tmp_path / "runs" / "r1").mkdir()
        (tmp_path / "runs" / "r1" / "step_00000010.pt").write_bytes(b"weights")
        words = "step_00000010.pt is still there"
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "runs" / "r1").symlink_to(tmp_path / "elsewhere")
        words = "is not a checkpoint folder (a link or a file)"
    before = _state(tmp_path / "db")
    assert words in refused(monkeypatch, capsys, *args, "--db", str(db))
    assert _state(tmp_path / "db") == before and _journal_mode(db) == "delete"


def _old_db(tmp_path: Path) -> Path:
    """A WAL database at revision 0004 with run r1 queued under another config than m.toml's."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    from fibctl.config import RunConfig

    db = tmp_path / "o.db"
    upgrade(str(db), "0004")
    other = RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=16)
    engine = create_engine(f"sqlite:///{db}", poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text(
            'INSERT INTO runs (name, matrix, preset, base, schedule, "window", seed, train_length, config_json,'
            " config_hash, status, attempts, created_at, source) VALUES ('r1', 'm', 'micro', 'fib', 'stagger',"
            " 16, 42, 64, :c, :h, 'queued', 0, '2026-01-01 00:00:00', 'fibctl')"), {"c": other.to_json(), "h": other.config_hash})
    engine.dispose()
    (tmp_path / "m.toml").write_text(MATRIX)
    return db


@pytest.mark.parametrize("args", [*REFUSED, ["queue", "add", "m.toml"]], ids=" ".join)
def test_a_refused_command_does_not_upgrade_an_older_database(args, tmp_path, monkeypatch, capsys):
    """`queue cancel nosuch` on a database of an older revision migrated it to the newest, then
    failed."""
    from sqlalchemy import create_engine

    db = _old_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    err = refused(monkeypatch, capsys, *args, "--db", "o.db")
    assert "differs in" in err if args[1] == "add" else True
    assert _state(tmp_path) == before
    engine = create_engine(f"sqlite:///{db}")
    assert current_revision(engine) == "0004"
    engine.dispose()


def test_a_copy_refused_for_a_clash_does_not_upgrade_the_target(tmp_path, monkeypatch, capsys):
    from fibctl.config import RunConfig
    from fibctl.db.engine import connect, release
    from fibctl.queue import add_runs

    _old_db(tmp_path)
    add_runs(connect(str(tmp_path / "src.db")), [RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=8)])
    release()
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    err = refused(monkeypatch, capsys, "db", "copy", "--from", "src.db", "--to", "o.db")
    assert "the target already has run(s) 'r1' with another config" in err
    assert _state(tmp_path) == before


def test_a_command_that_succeeds_still_upgrades(tmp_path, monkeypatch, capsys):
    """The control: the checks before an upgrade refuse only what the command would."""
    from fibctl.cli import main
    import sys

    db = _old_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "cancel", "r1", "--db", "o.db"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    assert "cancelled r1" in capsys.readouterr().out
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{db}")
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_db_upgrade_with_nothing_to_do_leaves_the_database_as_it_was(tmp_path, monkeypatch, capsys):
    """`db upgrade` on a database at the latest revision switched it to WAL mode (its header's
    bytes changed) though it upgraded nothing."""
    from cli_helpers import ran

    db = _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    code, out, _ = ran(monkeypatch, capsys, "db", "upgrade", "--db", "t.db")
    assert code == 0 and f"t.db: already at revision {head_revision()}" in out
    assert _state(tmp_path) == before and _journal_mode(db) == "delete"


def test_db_upgrade_of_an_older_database_switches_it_to_wal(tmp_path, monkeypatch, capsys):
    """The control: an upgrade that has work to do still leaves it in WAL mode."""
    from cli_helpers import ran

    db = _old_db(tmp_path)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    monkeypatch.chdir(tmp_path)
    code, out, _ = ran(monkeypatch, capsys, "db", "upgrade", "--db", "o.db")
    assert code == 0 and "upgraded from revision 0004" in out
    assert _journal_mode(db) == "wal"


def _damaged(tmp_path: Path) -> Path:
    """The example database with a page of its aux_metrics overwritten: it opens, and its
    first queries work; reading that table finds the damage."""
    db = tmp_path / "corrupt.db"
    shutil.copyfile(EXAMPLE, db)
    with db.open("r+b") as f:
        f.seek(50_000)
        f.write(b"\xde\xad" * 2000)
    with pytest.raises(sqlite3.DatabaseError, match="malformed"):
        sqlite3.connect(db).execute("SELECT * FROM aux_metrics").fetchall()
    return db


@pytest.mark.parametrize("args", [["db", "copy", "--from", "corrupt.db", "--to", "out.db"],
                                  ["sql", "SELECT * FROM aux_metrics", "--db", "corrupt.db"],
                                  ["report", "table2", "--db", "corrupt.db"]], ids=lambda a: " ".join(a[:2]))
def test_a_damaged_database_is_one_line_wherever_a_query_meets_it(args, tmp_path, monkeypatch, capsys):
    """`db copy --from` a database with a damaged page was a traceback (database disk image is
    malformed), and so was `report table2`."""
    if not EXAMPLE.exists():
        pytest.skip("results.db.example is not in this checkout")
    _damaged(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    err = refused(monkeypatch, capsys, *args)
    assert "corrupt.db is not a usable database: database disk image is malformed" in err
    assert _state(tmp_path) == before  # no out.db either


def _sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    e = sqlite3.OperationalError(message)
    e.sqlite_errorcode = code  # as the driver sets it: the extended code, its low byte the primary
    return e


DISK = [("disk I/O error", 10 | 19 << 8), ("database or disk is full", 13)]  # SQLITE_IOERR_SHMSIZE, SQLITE_FULL


@pytest.mark.parametrize("message, code", DISK, ids=["io", "full"])
@pytest.mark.parametrize("args", [["db", "upgrade"], ["queue", "ls"], ["queue", "add", "m.toml"]],
                         ids=lambda a: " ".join(a[:2]))
def test_a_disk_that_refuses_writes_is_named_not_the_database(args, message, code, tmp_path, monkeypatch, capsys):
    """A WAL database on a full disk (its -shm file cannot grow) was "t.db is not a usable
    database: disk I/O error", for a database that is whole: the line points at the disk."""
    from sqlalchemy.exc import OperationalError

    from fibctl.db import engine

    _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)

    def refuses(conn, db):
        raise OperationalError("SELECT version_num FROM alembic_version", {}, _sqlite_error(message, code))

    monkeypatch.setattr(engine, "_stored_revision", refuses)
    err = refused(monkeypatch, capsys, *args, "--db", "t.db")
    assert err == f"error: t.db: its disk is full or not writable ({message})\n"


@pytest.mark.parametrize("message, code", DISK, ids=["io", "full"])
@pytest.mark.parametrize("args", [["db", "upgrade"], ["queue", "add", "paper"]], ids=lambda a: " ".join(a[:2]))
def test_an_upgrade_the_disk_refuses_names_the_disk(args, message, code, tmp_path, monkeypatch, capsys):
    """... and leaves no new file: `queue add --db new.db` (any command that writes) left an
    empty new.db, which a report then read as an empty database rather than none."""
    from alembic import command

    monkeypatch.chdir(tmp_path)

    def refuses(*args, **kwargs):
        raise _sqlite_error(message, code)

    monkeypatch.setattr(command, "upgrade", refuses)
    err = refused(monkeypatch, capsys, *args, "--db", "new.db")
    assert err == (f"error: upgrading new.db to {head_revision()} failed, nothing changed: its disk is full or "
                   f"not writable ({message})\n")
    assert list(tmp_path.iterdir()) == []  # not an empty new.db, nor its temporary


def _on_the_command_s_connections(monkeypatch, pragma: str) -> None:
    """Every connection of the command's own engine (not the upgrade's, which runs with
    foreign keys off) runs `pragma` first: a fault SQLite itself then raises mid-command."""
    from sqlalchemy import event

    from fibctl.db import engine

    install = engine._install_sqlite_settings

    def pinned(e, *, foreign_keys=True):
        install(e, foreign_keys=foreign_keys)
        if foreign_keys:
            event.listen(e, "connect", lambda conn, _record: conn.execute(pragma))

    monkeypatch.setattr(engine, "_install_sqlite_settings", pinned)


# the most pages it may have, below its size: SQLite keeps it at its size, and the first write
# that needs a page more fails with SQLITE_FULL, "database or disk is full", as on a disk
# that filled mid-command
FULL = "PRAGMA max_page_count=1"


# commands whose writes need new pages: the paper's 31 runs, the example study's rows
@pytest.mark.parametrize("args, db", [(["queue", "add", "paper", "--db", "t.db"], "t.db"),
                                      (["db", "copy", "--from", "example.db", "--to", "t.db"], "t.db"),
                                      (["db", "copy", "--from", "example.db", "--to", "new.db"], "new.db")],
                         ids=["queue add", "copy into a database", "copy into a new file"])
def test_a_write_the_disk_refuses_mid_command_names_the_database(args, db, tmp_path, monkeypatch, capsys):
    """A write that failed once the database was open read "the database refused the
    operation: database or disk is full", naming no database; a new file's (built under a
    temporary name) is named as given, and left behind neither."""
    if not EXAMPLE.exists():
        pytest.skip("results.db.example is not in this checkout")
    _rollback_db(tmp_path)
    shutil.copy(EXAMPLE, tmp_path / "example.db")
    monkeypatch.chdir(tmp_path)
    before = _state(tmp_path)
    _on_the_command_s_connections(monkeypatch, FULL)
    err = refused(monkeypatch, capsys, *args)
    assert err == f"error: {db}: its disk is full or not writable (database or disk is full)\n"
    after = _state(tmp_path)
    assert after.keys() - {"t.db-wal", "t.db-shm"} == before.keys()  # no new.db, nor its temporary


def test_a_refusal_mid_command_names_the_database(tmp_path, monkeypatch, capsys):
    """Any other refusal of the driver's names the database as well (SQLite's own read-only
    refusal here)."""
    _rollback_db(tmp_path)
    monkeypatch.chdir(tmp_path)
    _on_the_command_s_connections(monkeypatch, "PRAGMA query_only=ON")
    err = refused(monkeypatch, capsys, "queue", "cancel", "r1", "--db", "t.db")
    assert err == "error: the database t.db refused the operation: attempt to write a readonly database\n"


@contextlib.contextmanager
def _small_disk(tmp_path: Path, monkeypatch):
    """A 3 MB tmpfs as the working folder, where this may mount one (root)."""
    import os

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        monkeypatch.chdir(disk)
        yield disk
    finally:
        monkeypatch.chdir(tmp_path)
        subprocess.run(["umount", str(disk)], check=True)


def _fill(disk: Path, leave: int = 0) -> None:
    """Fill `disk` to within `leave` bytes of full (0: to the last byte)."""
    import os

    with contextlib.suppress(OSError), open(disk / "fill", "wb") as fill:
        while leave == 0 or os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > leave:
            fill.write(b"\0" * 4096)
            fill.flush()


def test_a_database_on_a_full_disk_names_the_disk(tmp_path, monkeypatch, capsys):
    """The same on a real full disk. Switching a database to WAL mode there was a traceback,
    and `db upgrade` (or `queue add`) of a new file left it there, empty."""
    with _small_disk(tmp_path, monkeypatch) as disk:
        for wal in (False, True):
            shutil.copy(EXAMPLE, disk / f"{'wal' if wal else 'r'}.db")
        conn = sqlite3.connect(disk / "wal.db")
        conn.execute("PRAGMA journal_mode=WAL")  # its readers need a -shm file, its writers a -wal
        conn.close()
        _fill(disk)
        # a rollback-journal database a write switches to WAL mode (`db upgrade` leaves a current
        # one as it is); WAL ones to read and to write; a new one
        for args, db in ((["queue", "add", "demo"], "r.db"), (["db", "upgrade"], "wal.db"), (["queue", "ls"], "wal.db"),
                         (["queue", "cancel", "dense"], "wal.db"), (["db", "upgrade"], "new.db"),
                         (["queue", "add", "paper"], "new.db")):
            err = refused(monkeypatch, capsys, *args, "--db", db)
            assert err.startswith(f"error: {db}: its disk is full or not writable ("), err
        assert not [p.name for p in disk.iterdir() if "new.db" in p.name]


def test_a_disk_that_fills_mid_command_names_the_database(tmp_path, monkeypatch, capsys):
    """A disk with room to open the database but not for the paper's 31 runs: the write failed
    as "the database refused the operation: database or disk is full"."""
    with _small_disk(tmp_path, monkeypatch) as disk:
        upgrade("r.db")  # WAL: its -wal and -shm files are made on opening, not by the write
        _fill(disk, leave=32 * 1024)
        err = refused(monkeypatch, capsys, "queue", "add", "paper", "--db", "r.db")
        assert err.startswith("error: r.db: its disk is full or not writable ("), err
