"""Writing a report's files. Each is written beside its final path and then renamed onto
it, so a file already there, or a link (to a file outside the report's folder, say), is
replaced, never written through; and a reader never sees half of a file."""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fibctl import durable
from fibctl.errors import FibctlError


def replace_file(path: Path, write: Callable[[Path], None]) -> Path:
    """Call `write` with a new file's path in path's folder (same suffix), then rename it to `path`.
    The temporary file's name holds the writer's process id and PID space: `remove_leftovers`
    tells from it whether a process killed mid-write left it."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{durable.owner()}-{secrets.token_hex(4)}.part{path.suffix}")
    try:  # from its making: a Ctrl-C landing between the two would leave it behind
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode, as open() gives
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """`text` as UTF-8, whatever the locale's encoding (LANG=C: ASCII, which has no Δ)."""
    return replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def remove_leftovers(paths: Iterable[Path]) -> list[Path]:
    """Delete the temporary files of `paths` that a writer killed mid-write left (its process
    is gone); returns them. One of a process still running (another report writing into the
    same folder), or of another PID space (another container's, into a shared folder), stays,
    as does any other file."""
    gone = []
    for path in paths:
        if not path.parent.is_dir():
            continue
        own = re.compile(rf"\.{re.escape(path.stem)}\.{durable.OWNER}-[0-9a-f]{{8}}\.part{re.escape(path.suffix)}")
        for tmp in path.parent.glob(f".{glob.escape(path.stem)}.*.part{glob.escape(path.suffix)}"):
            m = own.fullmatch(tmp.name)
            if m and durable.owner_ended(*m.groups()) and tmp.is_file() and not tmp.is_symlink():
                tmp.unlink(missing_ok=True)
                gone.append(tmp)
    return gone


# the folders this process holds exclusively (report all's), by device and inode: the report's
# own figures are saved into one without a second lock, which flock would refuse them
_held: set[tuple[int, int]] = set()


@contextmanager
def holding(folder: Path, *, exclusive: bool, busy: str) -> Iterator[None]:
    """`folder` held by flock on the folder itself (no lock file left behind): exclusively by
    `report all` while it writes a report there, which removes an earlier report's files as
    stale; shared by `figure` while it writes a figure there. Where the other kind holds it,
    FibctlError(`busy`) at once, nothing done."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:
        if exclusive:
            raise
        yield  # a figure into a folder it may write but not read (-wx): as before, unguarded
        return
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        if key in _held:
            yield
            return
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FibctlError(busy) from None
            # a file system that cannot lock a folder (NFS may refuse one opened read-only):
            # the files are written unguarded, as they were before there was a lock
        if exclusive:
            _held.add(key)
        try:
            yield
        finally:
            if exclusive:
                _held.discard(key)
    finally:
        os.close(fd)
