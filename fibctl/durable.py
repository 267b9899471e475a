"""Writes that must outlive a crash or a power loss: a file's bytes, or a folder's entries
after a rename, flushed to the disk (checkpoints, data folders); and whether the process
that left a temporary behind still runs."""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush the writes to a file, or to a folder's entries (renames into it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (this process does): a temporary named
    after it is still in use."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except (ProcessLookupError, OverflowError):  # none has that number
        return False
    except PermissionError:  # another user's
        return True
    return True


@functools.cache
def pid_space() -> str:
    """Where this process's PIDs mean something, as 12 hex digits: the host name, the
    kernel's boot and the PID namespace. Two containers may share a host name (docker
    --network host, clusters) yet not see each other's processes: a PID recorded by one
    says nothing to `alive` in the other. Where Linux's parts cannot be read (macOS: no PID
    namespaces), the host name alone."""
    def read(what) -> str:
        try:
            return str(what())
        except OSError:
            return ""
    parts = (socket.gethostname(), read(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
             read(lambda: os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def ended(pid: int, space: str | None) -> bool:
    """Whether process `pid` of PID space `space` (pid_space where it ran) has ended, as far as
    this process can tell: never for another space's, or an unknown one's, whose process may
    run where this one cannot see it."""
    return space == pid_space() and not alive(pid)


# In a leftover's name, its maker: PID-SPACE (`owner`); an older fibctl's names had the PID alone.
OWNER = r"(\d+)(?:-([0-9a-f]{12}))?"


def owner() -> str:
    """This process as a leftover's name has it: PID-SPACE."""
    return f"{os.getpid()}-{pid_space()}"


def owner_ended(pid: str, space: str | None) -> bool:
    """Whether the maker of a leftover named with OWNER's groups has ended: one of another PID
    space is left alone; an older fibctl's, with no space, is taken as this one's, as it was."""
    return ended(int(pid), space or pid_space())
