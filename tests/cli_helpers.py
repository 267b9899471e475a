"""Running fibctl's CLI inside the test process, for tests about what a command says and
leaves behind rather than about the process boundary (a new Python for each costs seconds of
importing torch)."""

from __future__ import annotations

import sys

import pytest


def ran(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`fibctl ARGS` by its main: its exit code, stdout and stderr."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(monkeypatch, capsys, *args: str) -> str:
    """`fibctl ARGS` by its main, as the entry point calls it: exit 2 with one line and no
    traceback; that line."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    assert done.value.code == 2 and "Traceback" not in out.err + out.out, out
    assert len(out.err.strip().splitlines()) == 1, out.err
    return out.err


def close_stdout(monkeypatch, dup2=None) -> None:
    """fibctl's console as if its reader had gone (`fibctl ... | head -1`): every write fails
    with BrokenPipeError. Restored after the test: the console's own file (its `file` reads
    back sys.stdout), the quiet a closed pipe sets for good, and its buffer, which keeps the
    text the pipe refused for the next test's first line; fds 1 and 2, which fibctl points at
    /dev/null, are this process's own and left alone (`dup2` sees the calls instead)."""
    import io
    import os

    from fibctl.cli import common

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

    monkeypatch.setattr(common.console, "_file", Gone())
    monkeypatch.setattr(common.console, "quiet", common.console.quiet)
    monkeypatch.setattr(common.console._thread_locals, "buffer", [])
    monkeypatch.setattr(os, "dup2", dup2 or (lambda fd, to: None))


class Terminal:
    """A pty whose secondary end (`secondary`) is a command's stdout, a terminal to it, read
    all along as a terminal's window reads: a pty nobody reads (15 KB of it unread, on Linux)
    blocks the command's next write, rich's last frame as a watch ends included, and a test
    waiting for it to end then waits for ever. Use it as a context manager; `shown`: what the
    command wrote so far."""

    def __init__(self) -> None:
        import pty
        import threading

        self.primary, self.secondary = pty.openpty()
        self.shown = b""
        self._more = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> "Terminal":
        self._reader.start()
        return self

    def _read(self) -> None:
        import os

        while True:
            try:
                chunk = os.read(self.primary, 4096)
            except OSError:  # EIO: every secondary end is closed, the command has ended
                chunk = b""
            with self._more:
                self.shown += chunk
                self._more.notify_all()
            if not chunk:
                return

    def started(self) -> None:
        """Close this process's secondary end, once the command has its own: its end is then
        the pty's end (a read says so)."""
        import os

        if self.secondary is not None:
            os.close(self.secondary)
            self.secondary = None

    def until(self, said: bytes, timeout: float = 60) -> bool:
        """Whether the command wrote `said` within `timeout` seconds."""
        with self._more:
            return self._more.wait_for(lambda: said in self.shown, timeout)

    def __exit__(self, *exc) -> None:
        import os

        self.started()
        self._reader.join(timeout=10)
        os.close(self.primary)
