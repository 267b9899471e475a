"""Real kills of the commands that write a whole thing at once: `fibctl data prepare`,
`import-study`, `db copy` and `db upgrade`. Each is stopped by SIGKILL (no handler, no
cleanup runs) at a point the test chooses: the command is held there, in a child process,
until the test sees the file it writes on arriving; never after a fixed sleep. Afterwards the
target is either as it was or complete, and the same command run again finishes it as an
uninterrupted run would (the same bytes, the same rows)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from fibctl.data import prepare as prepare_mod
from fibctl.data.prepare import prepare
from fibctl.data.recipe import load_recipe
from fibctl.db.engine import connect, head_revision, resolve_url, upgrade
from fibctl.db.importer import import_study
from fibctl.queue import add_runs
from conftest import fresh_database
from test_db import _insert_rev1_run
from test_import import make_study
from train_helpers import generated_recipe, micro_run

# Run in the child: `fibctl ARGS` with one function wrapped so that the Nth call whose
# arguments' repr holds MATCH writes MARK and waits there (before the call, or after it
# with AFTER) for the test's SIGKILL.
HOLD = r"""
import functools, importlib, sys, time
module, attr, n, match, after, mark, *args = sys.argv[1:]
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
real, seen = getattr(owner, name), [0]

def hold():
    open(mark, "w").close()
    time.sleep(600)  # the test kills this process here
    raise SystemExit("not killed")

@functools.wraps(real)
def held(*a, **k):
    hit = match in repr((a, k))
    seen[0] += hit
    if hit and seen[0] == int(n) and after != "after":
        hold()
    out = real(*a, **k)
    if hit and seen[0] == int(n) and after == "after":
        hold()
    return out

setattr(owner, name, held)
sys.argv = ["fibctl", *args]
from fibctl.__main__ import main
main()
"""


def killed_at(tmp_path: Path, where: str, *args: str, n: int = 1, match: str = "", after: bool = False) -> None:
    """Run `fibctl ARGS`, SIGKILL it at the Nth call of `where` ('module:Class.attr') whose
    arguments hold `match` (before that call, or after it), and check that it was killed there."""
    module, attr = where.split(":")
    mark = tmp_path / f"held-{time.monotonic_ns()}"
    child = subprocess.Popen([sys.executable, "-c", HOLD, module, attr, str(n), match,
                              "after" if after else "before", str(mark), *args],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not mark.exists():
            assert child.poll() is None, f"it ended before {where} (exit {child.returncode}): " \
                                         f"{child.communicate()}"
            assert time.monotonic() < deadline, f"it never reached {where}"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    mark.unlink()


def fibctl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "fibctl", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def beside(folder: Path) -> list[str]:
    """What lies in the data folder's parent, test files aside."""
    return sorted(p.name for p in folder.parent.iterdir() if not p.name.endswith(".toml"))


def _recipe(root: Path, train_tokens: int) -> Path:
    return generated_recipe(root / f"gen{train_tokens}.toml", train_tokens)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[int, dict[str, bytes]]:
    """Uninterrupted builds of the two recipes the tests prepare: their files' bytes."""
    root = tmp_path_factory.mktemp("whole")
    return {n: files(prepare(load_recipe(_recipe(root, n)), root / f"d{n}").manifest.data_dir)
            for n in (3000, 4000)}


# ---- data prepare, in-process: killed between its two renames -------------------------------

class _Killed(BaseException):
    """What SIGKILL does, in-process: nothing after it runs (no `finally` removes anything)."""


def _kill_the_swap(monkeypatch, out: Path) -> None:
    """The rename that puts the build in place (the second) kills the prepare; from then on
    nothing is removed, as after a real kill."""
    rename, rmtree, killed = os.rename, prepare_mod.shutil.rmtree, []

    def fatal_rename(src, dst, *a, **k):
        if Path(dst) == out and ".partial-" in Path(src).name:
            killed.append(src)
            raise _Killed
        return rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", fatal_rename)
    monkeypatch.setattr(prepare_mod.shutil, "rmtree", lambda *a, **k: None if killed else rmtree(*a, **k))


def _no_training(monkeypatch) -> list:
    """Count tokenizer trainings (each one a rebuild) and still train."""
    trained, train = [], prepare_mod.train_tokenizer
    monkeypatch.setattr(prepare_mod, "train_tokenizer", lambda *a: trained.append(1) or train(*a))
    return trained


@pytest.mark.parametrize("before", [None, 3000])
def test_a_prepare_killed_between_its_renames_is_finished_by_the_next_without_a_rebuild(
        tmp_path, monkeypatch, builds, before):
    """The old folder was moved away (or there was none), the new build not yet moved in: the
    data folder is missing. The next prepare puts the complete build in place instead of
    deleting it and building again; the same bytes as an uninterrupted build."""
    out = tmp_path / "d"
    if before:
        prepare(load_recipe(_recipe(tmp_path, before)), out)
    with monkeypatch.context() as m:
        _kill_the_swap(m, out)
        with pytest.raises(_Killed):
            prepare(load_recipe(_recipe(tmp_path, 4000)), out)
    assert not out.exists()
    assert len([p for p in tmp_path.iterdir() if ".d.partial-" in p.name]) == 1

    trained = _no_training(monkeypatch)
    again = prepare(load_recipe(_recipe(tmp_path, 4000)), out)
    assert trained == [] and again.finished and again.reused
    assert files(out) == builds[4000]
    assert beside(out) == ["d"]  # the old folder and the build's are gone
    assert prepare(load_recipe(_recipe(tmp_path, 4000)), out).reused and trained == []


def test_a_leftover_build_is_put_in_place_only_when_whole_and_for_these_inputs(tmp_path, monkeypatch, builds):
    """A half build (no manifest), a build whose stream does not match its hash or whose file
    is missing, and a build of another recipe: each is rebuilt from the recipe, never put in place."""
    out = tmp_path / "d"
    damages = {
        "no manifest": lambda b: (b / "manifest.json").unlink(),
        "a byte changed": lambda b: (b / "train.bin").write_bytes(
            (lambda d: d[:-3] + bytes([d[-3] ^ 1]) + d[-2:])((b / "train.bin").read_bytes())),
        "a stream missing": lambda b: (b / "stories_val.bin").unlink(),
        "a file more": lambda b: (b / "scratch").mkdir(),
        "no hashes": lambda b: (b / "manifest.json").write_text(
            (b / "manifest.json").read_text().replace('"stream_hashes"', '"older_field"')),
    }
    for why, damage in damages.items():
        with monkeypatch.context() as m:
            _kill_the_swap(m, out)
            with pytest.raises(_Killed):
                prepare(load_recipe(_recipe(tmp_path, 4000)), out)
        [build] = [p for p in tmp_path.iterdir() if ".d.partial-" in p.name]
        damage(build)
        with monkeypatch.context() as m:
            trained = _no_training(m)
            again = prepare(load_recipe(_recipe(tmp_path, 4000)), out)
        assert trained == [1] and not again.reused and not again.finished, why
        assert files(out) == builds[4000] and beside(out) == ["d"], why
        shutil.rmtree(out)
    # a complete build, but of another recipe: the recipe asked for is built
    with monkeypatch.context() as m:
        _kill_the_swap(m, out)
        with pytest.raises(_Killed):
            prepare(load_recipe(_recipe(tmp_path, 3000)), out)
    with monkeypatch.context() as m:
        trained = _no_training(m)
        assert not prepare(load_recipe(_recipe(tmp_path, 4000)), out).reused and trained == [1]
    assert files(out) == builds[4000] and beside(out) == ["d"]


# ---- data prepare, real kills ---------------------------------------------------------------

@pytest.mark.parametrize("where, n, match, after, left", [
    # mid-streams (the training stream written, the held-out one not): a half build beside
    # the old folder, which stands as it was
    ("fibctl.data.prepare:_Writer.close", 2, "", False, 3000),
    # between the two renames: the old folder moved away, the new build not yet in place
    ("pathlib:Path.rename", 1, ".d.partial-", False, None),
    # after them, before the old folder is removed: the new build is in place
    ("fibctl.data.prepare:fsync", 1, "PosixPath('.')", False, 4000),
])
def test_a_killed_prepare_leaves_the_old_data_or_the_new_and_the_rerun_finishes_it(
        tmp_path, builds, where, n, match, after, left):
    fibctl(tmp_path, "data", "prepare", _recipe(tmp_path, 3000).name, "--data", "d", "--plain")
    killed_at(tmp_path, where, "data", "prepare", _recipe(tmp_path, 4000).name, "--data", "d", "--plain",
              n=n, match=match, after=after)
    out = tmp_path / "d"
    if left is None:
        assert not out.exists()  # a report or worker reading it now is told to prepare the data
    else:
        assert files(out) == builds[left]  # never a mixture of the two
    done = fibctl(tmp_path, "data", "prepare", _recipe(tmp_path, 4000).name, "--data", "d", "--plain")
    assert files(out) == builds[4000] and beside(out) == ["d"], done.stdout
    if left is None:
        assert "finished the interrupted prepare" in " ".join(done.stdout.split())


# ---- the database commands ------------------------------------------------------------------

def dump(db: str) -> dict[str, list[tuple]]:
    """Every row of every table, what a report reads: a run's rows by its name, not its id,
    and the times of writing left out (they differ between two runs of one command; so do
    ids on PostgreSQL, whose sequences a rolled-back transaction still advances)."""
    engine = create_engine(resolve_url(db), poolclass=NullPool)
    try:
        out = {}
        with engine.connect() as conn:
            names = dict(conn.execute(text("SELECT id, name FROM runs")).all()) \
                if "runs" in inspect(conn).get_table_names() else {}
            for table in sorted(inspect(conn).get_table_names()):
                columns = [c["name"] for c in inspect(conn).get_columns(table)
                           if c["name"] not in ("id", "created_at", "time")]
                quoted = ", ".join(f'"{c}"' for c in columns)
                out[table] = sorted(tuple(repr(names[v] if c == "run_id" else v) for c, v in zip(columns, r))
                                    for r in conn.execute(text(f"SELECT {quoted} FROM {table}")))
        return out
    finally:
        engine.dispose()


@contextlib.contextmanager
def twin(db: str, tmp_path: Path):
    """Another new database on `db`'s backend, for the uninterrupted run (rows read back
    from two backends differ in small ways: compare like with like)."""
    folder = tmp_path / "whole"
    folder.mkdir()
    with fresh_database("sqlite" if "://" not in db else "postgresql", folder) as url:
        yield url


def _queued_db(db: str) -> None:
    """A database that holds a run already: what a copy or an import adds to."""
    engine = connect(db)
    add_runs(engine, [micro_run("mine")])
    engine.dispose()


@pytest.mark.parametrize("where, n", [("fibctl.db.importer:upsert", 3), ("fibctl.db.importer:_import_posloss", 1)])
def test_a_killed_import_leaves_the_database_as_it_was_and_the_rerun_imports_it_whole(db_url, tmp_path, where, n):
    fib_db, extrap, posloss = make_study(tmp_path)
    _queued_db(db_url)
    before = dump(db_url)
    args = ("import-study", "fib.db", "--lenextrap", extrap.name, "--posloss", posloss.name, "--db", db_url)
    killed_at(tmp_path, where, *args, n=n)
    assert dump(db_url) == before  # no run without its metrics, no metric without the rest
    fibctl(tmp_path, *args)
    with twin(db_url, tmp_path) as whole:
        _queued_db(whole)
        engine = connect(whole)
        import_study(engine, fib_db, extrap, posloss)
        engine.dispose()
        assert dump(db_url) == dump(whole)


@pytest.mark.parametrize("command, where, after", [
    ("import", "fibctl.db.importer:_import_probe", False),  # schema made, runs written
    ("copy", "fibctl.db.copy:_copy_events", True),  # everything written, not committed
    ("import", "fibctl.db.whole:fsync", False),  # committed, not yet in place
])
def test_a_command_killed_into_a_new_sqlite_file_leaves_none_and_the_rerun_makes_it_whole(tmp_path, command,
                                                                                         where, after):
    """A new SQLite target comes into being only whole: killed, there is no new.db (it was
    an empty fibctl database), only the dead process's temporary, which the rerun removes."""
    fib_db, _, _ = make_study(tmp_path)
    engine = connect(str(tmp_path / "whole.db"))
    import_study(engine, fib_db)
    engine.dispose()
    args = (("import-study", "fib.db", "--db", "new.db") if command == "import"
            else ("db", "copy", "--from", "whole.db", "--to", "new.db"))
    killed_at(tmp_path, where, *args, after=after)
    assert not (tmp_path / "new.db").exists()
    assert [p.name for p in tmp_path.glob(".new.db.partial-*")]  # what the kill left
    fibctl(tmp_path, *args)
    assert not list(tmp_path.glob(".new.db*"))
    assert dump(str(tmp_path / "new.db")) == dump(str(tmp_path / "whole.db"))


def test_a_new_sqlite_file_removes_only_dead_builders_temporaries_and_a_failed_one_its_own(tmp_path):
    import fcntl

    from fibctl.db.whole import created_whole

    target = tmp_path / "new.db"
    dead, live = tmp_path / ".new.db.partial-999998", tmp_path / ".new.db.partial-999999"
    for p in (dead, tmp_path / ".new.db.partial-999998-wal", live):
        p.write_bytes(b"")
    with open(live) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a builder alive now
        with pytest.raises(RuntimeError, match="stopped"), created_whole(str(target)) as into:
            connect(into).dispose()  # the schema, then a failure: nothing appears
            raise RuntimeError("stopped")
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
        with created_whole(str(target)) as into:
            engine = connect(into)
            add_runs(engine, [micro_run("mine")])
            engine.dispose()
            assert not target.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "new.db"]
    assert [r[0] for r in dump(str(target))["runs"]] == ["'mine'"]
    with created_whole(str(target)) as into:  # an existing file: written directly
        assert into == str(target)


def test_a_co_users_entries_at_a_new_sqlite_files_temporary_names_are_never_written_through(tmp_path):
    """In a shared folder a co-user could plant, at the temporary's name (.NAME.partial-PID,
    the next PIDs are foreseeable), a link: the new database was written through it, truncating
    or creating the file it pointed to; a pipe there: opening it waited forever. Now the
    temporary's name is unforeseeable and made new, and only plain files are taken for
    leftovers; the co-user's entries stay as they were."""
    from fibctl.db.whole import upgraded_or_created

    outside = tmp_path / "outside"
    outside.mkdir()
    shared = tmp_path / "shared"
    shared.mkdir()
    planted = [shared / f".other.db.partial-{os.getpid()}", shared / ".new.db.partial-1",
               shared / ".new.db.partial-2"]
    planted[0].symlink_to(outside / "victim.db")  # to nothing: the open made it
    os.mkfifo(planted[1])
    planted[2].mkdir()  # it was `error: .new.db.partial-2: Is a directory`
    code = "import sys; from fibctl.db.whole import upgraded_or_created as u; u(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(shared / "new.db")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    upgraded_or_created(str(shared / "other.db"))  # at this PID's name, the link
    assert not list(outside.iterdir())
    assert sorted(p.name for p in shared.iterdir()) == sorted([*(p.name for p in planted), "new.db", "other.db"])
    assert planted[0].is_symlink() and planted[1].is_fifo() and planted[2].is_dir()
    assert dump(str(shared / "new.db")) == dump(str(shared / "other.db"))


@pytest.mark.parametrize("where, n, after", [("fibctl.db.copy:upsert", 4, False),
                                             ("fibctl.db.copy:_copy_events", 1, True)])
def test_a_killed_copy_leaves_the_target_as_it_was_and_the_rerun_copies_it_whole(db_url, tmp_path, where, n,
                                                                                  after):
    fib_db, extrap, posloss = make_study(tmp_path)
    source = str(tmp_path / "source.db")
    engine = connect(source)
    import_study(engine, fib_db, extrap, posloss)
    add_runs(engine, [micro_run("queued-there")])
    engine.dispose()
    _queued_db(db_url)
    before = dump(db_url)
    killed_at(tmp_path, where, "db", "copy", "--from", source, "--to", db_url, n=n, after=after)
    assert dump(db_url) == before
    fibctl(tmp_path, "db", "copy", "--from", source, "--to", db_url)
    with twin(db_url, tmp_path) as whole:
        _queued_db(whole)
        fibctl(tmp_path, "db", "copy", "--from", source, "--to", whole)
        assert dump(db_url) == dump(whole)


@pytest.mark.parametrize("where, n, after", [
    ("alembic.runtime.migration:HeadMaintainer.update_to_step", 4, True),  # half the migrations run
    ("alembic.command:upgrade", 1, True),  # every migration run, not yet committed
])
def test_a_killed_upgrade_leaves_the_database_as_it_was_and_the_rerun_upgrades_it(db_url, tmp_path, where, n,
                                                                                  after):
    from fibctl.config import RunConfig

    config = RunConfig.resolve("r1", "m", "micro", schedule="stagger", window=8).to_json()
    upgrade(db_url, "0001")
    _insert_rev1_run(db_url, "r1", config)
    before = dump(db_url)
    killed_at(tmp_path, where, "db", "upgrade", "--db", db_url, n=n, after=after)
    assert dump(db_url) == before and before["alembic_version"] == [("'0001'",)]
    done = fibctl(tmp_path, "db", "upgrade", "--db", db_url)
    assert f"upgraded from revision 0001 to {head_revision()}" in " ".join(done.stdout.split())
    with twin(db_url, tmp_path) as whole:
        upgrade(whole, "0001")
        _insert_rev1_run(whole, "r1", config)
        upgrade(whole)
        assert dump(db_url) == dump(whole)


def test_a_reuse_leaves_what_lies_beside_the_folder_while_a_prepare_holds_its_lock(tmp_path, monkeypatch):
    """A reuse removes a killed prepare's leftovers only when no prepare is building the folder
    now: with the lock held, the folder beside it may be that prepare's work."""
    import fcntl

    from fibctl.data.prepare import lock_path

    out = tmp_path / "d"
    prepare(load_recipe(_recipe(tmp_path, 3000)), out)
    work = tmp_path / ".d.partial-999999"
    (work / "scratch").mkdir(parents=True)
    with open(lock_path(out), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert prepare(load_recipe(_recipe(tmp_path, 3000)), out).reused
        assert work.is_dir()
    assert prepare(load_recipe(_recipe(tmp_path, 3000)), out).reused
    assert beside(out) == ["d"]
