"""A new SQLite database that comes into being only whole: `import-study`, `db copy`, `db
upgrade` and every command that writes (`connect`, `queue add` say) into a file that did not
exist build it under a hidden temporary name in its folder and rename it into place after
their commit, so that a kill (SIGKILL: no cleanup runs) or a full disk leaves no empty
fibctl database behind, only a temporary, which the next such command there removes (a full
disk's is removed at once).

PostgreSQL and an existing SQLite file take the writes directly, in the commands' one
transaction."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

from fibctl.db.engine import check_sqlite_file, check_writable, resolve_url, shown, upgrade
from fibctl.durable import fsync
from fibctl.errors import FibctlError, shown_path

# beside a database, what SQLite may write next to it
SIDE_FILES = ("-wal", "-shm", "-journal")


class CreatedMeanwhile(FibctlError):
    """Another process put the new database in place first: nothing was written to it."""


def _temporaries(path: Path) -> list[Path]:
    # PID-HEX; an older fibctl's had the PID alone
    pattern = re.compile(rf"\.{re.escape(path.name)}\.partial-\d+(?:-[0-9a-f]{{8}})?")
    return sorted(p for p in path.parent.glob(f".{path.name}.partial-*") if pattern.fullmatch(p.name))


def _remove(path: Path) -> None:
    for p in (path, *(path.with_name(path.name + s) for s in SIDE_FILES)):
        p.unlink(missing_ok=True)


def _remove_stale(path: Path) -> None:
    """Remove the temporaries of processes that died building `path`: a live builder holds a
    lock on its own, which a dead one's lock went with. Only a plain file is a builder's: a
    link, pipe or folder of that name (a co-user's, in a shared folder) is left alone, never
    opened through (a pipe's open waited forever)."""
    for tmp in _temporaries(path):
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # its builder finished or removed it meanwhile, or a link
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live builder's
            continue
        else:
            _remove(tmp)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _named_as(db: str, path: Path, into: str, tmp: Path) -> Iterator[None]:
    """An error that names the temporary (a full disk failing its upgrade, say) names the
    database the user gave instead: the temporary is gone once the error is said. So does a
    database's error that its engine noted with the temporary's name (`refusal` says it), as
    it is or as pandas wrapped it."""
    try:
        yield
    except FibctlError as e:
        e.args = tuple(a.replace(shown(into), shown(db)).replace(str(tmp), str(path)) if isinstance(a, str) else a
                       for a in e.args)
        raise
    except Exception as e:
        for error in (e, e.__cause__):
            if getattr(error, "database", None) == into:
                error.database = db
        raise


@contextlib.contextmanager
def created_whole(db: str, option: str = "--db") -> Iterator[str]:
    """The database to write `db` through. For a SQLite file that does not exist yet: a
    temporary one beside it, moved to `db` when the block ends normally (every engine on it
    disposed by then) and removed when it raises. Otherwise `db` itself."""
    url = resolve_url(db, option)
    # a link, even one to nothing, is written through as before
    if url.get_backend_name() != "sqlite" or os.path.lexists(url.database):
        yield db
        return
    path = Path(url.database)
    check_sqlite_file(path, must_exist=False, option=option)  # its folder is one: refused as connect refuses it
    check_writable(path)  # its folder's mode named, as connect names it, not the temporary's EACCES
    _remove_stale(path)
    # a name no one can foresee, made new (O_EXCL, which never follows a link): a co-user's
    # link planted at a PID's name had it truncate and write the file it pointed to, and two
    # containers' processes of one PID shared one temporary
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # SQLite takes an empty file
    except OSError as e:  # a folder this process cannot write, say
        raise FibctlError(f"cannot create database {shown_path(path)}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours while we live (flock: apart from SQLite's own locks)
        into = url.set(database=str(tmp)).render_as_string(hide_password=False)
        try:
            with _named_as(db, path, into, tmp):
                yield into
            last = sqlite3.connect(tmp)  # the last connection: WAL checkpointed into the file, -wal gone
            try:
                last.execute("PRAGMA schema_version")  # a read: closing checkpoints only a WAL it opened
            finally:
                last.close()
            if any(tmp.with_name(tmp.name + s).exists() for s in SIDE_FILES):
                raise FibctlError(f"{shown_path(path)}: another process has the new database open; nothing was written")
            fsync(tmp)
            raced = CreatedMeanwhile(f"{shown(db)} was created by another process meanwhile; nothing was "
                                     "written to it: run this again to write into it")
            try:
                os.link(tmp, path)  # unlike a rename, never replaces a database made meanwhile
            except FileExistsError:
                raise raced from None
            except OSError:  # a file system without hard links: a rename, checked just before
                if os.path.lexists(path):
                    raise raced from None
                os.rename(tmp, path)
            fsync(path.absolute().parent)
        finally:
            _remove(tmp)
    finally:
        os.close(fd)


def upgraded_or_created(db: str, option: str = "--db", *,
                        wal_if_current: bool = True) -> tuple[str | None, str]:
    """`upgrade(db)` (its revisions before and after), where a new SQLite file comes into being
    only whole, as `created_whole` makes it (`connect`'s: `queue add --db new.db` on a full
    disk left an empty new.db). Processes creating one at once (workers started together)
    each build their own temporary: the first in place is the database, which the others
    then upgrade as any."""
    try:
        with created_whole(db, option) as into:
            return upgrade(into, option=option, wal_if_current=wal_if_current)
    except CreatedMeanwhile:
        return upgrade(db, option=option, wal_if_current=wal_if_current)
