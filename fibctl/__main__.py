"""The `fibctl` program (pyproject's script) and `python -m fibctl`.

The command line takes about a second to import and build, and commands import torch (two seconds
more) when they first need it. A Ctrl-C in either is held until it is over, then ends
the command as one a moment later would: exit 130. Raised where it landed, a
KeyboardInterrupt could abort the process from torch's C++ (exit 134, a stack dump), leave
torch half-loaded, be lost in the import machinery's own callbacks (the command ran on), or
pass through an annotation typer evaluates (Python then exits by SIGINT, whatever exit code
the handler gave). A second Ctrl-C while one is held is not held.
"""

import os
import signal
import sys
import threading
import time


def main() -> None:
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:  # not where Ctrl-C is ignored
        signal.signal(signal.SIGINT, _interrupt)
    try:
        _starting.set()
        try:
            from fibctl.cli import build, main as run

            command = build()
        except KeyboardInterrupt:  # a second Ctrl-C: nothing has started yet, nothing to stop or record
            sys.exit(130)
        finally:
            _starting.clear()
        try:
            run(command)
        except KeyboardInterrupt:  # a held Ctrl-C sent again before fibctl.cli set its handlers
            sys.exit(130)
    finally:  # as it was, for a caller in the same process (the tests)
        if signal.getsignal(signal.SIGINT) is _interrupt:
            signal.signal(signal.SIGINT, previous)


def program() -> None:
    """The installed `fibctl` and `python -m fibctl`: `main`, after which nothing is left to
    stop. A Ctrl-C while Python shuts down (the command has ended and said how) is ignored:
    it ended the process by SIGINT, without a word, after a command that had succeeded."""
    try:
        main()
    finally:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        _forget_interrupts_handled()


def _forget_interrupts_handled() -> None:
    """A KeyboardInterrupt that passed out of code run from a string (`eval` or `exec`: a
    dataclass's methods as a module imports, an annotation typer evaluates) sets a flag in
    CPython that makes the process end by SIGINT once Python is done, even when fibctl caught
    it and exited 130 (the caller saw -2). Each `eval` of a string starts by clearing it."""
    eval("None")


def importing(frame=None) -> bool:
    """Whether torch, or one of its modules, is being imported in this process; or `frame`
    (where a signal landed) is the import machinery's, which may be running its callbacks
    after a module is done."""
    if frame is not None and _machinery(frame):
        return True
    # copied in one call: a list of its items, built while another thread imports, could
    # raise "dictionary changed size during iteration" (and the Ctrl-C held for it was lost)
    return any(_initializing(module) for name, module in sys.modules.copy().items()
               if name == "torch" or name.startswith("torch."))


def _machinery(frame) -> bool:
    return frame.f_code.co_filename.startswith("<frozen importlib")


def _main_thread_in_machinery() -> bool:
    """Whether the import machinery is anywhere on the main thread's stack: a Ctrl-C held there
    and sent again before it is done would land there again, or in its own handler."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and not _machinery(frame):
        frame = frame.f_back
    return frame is not None


def _initializing(module) -> bool:
    try:
        return module.__spec__._initializing is True  # set by importlib while the module runs
    except Exception:  # noqa: BLE001 (no spec, or not a module: sys.modules holds what it is given)
        return False


_starting = threading.Event()  # the command line is being imported and built
_held = threading.Event()  # a Ctrl-C is waiting for the start or torch's import to end


def _interrupt(signum, frame) -> None:
    """SIGINT's handler until a command sets its own: Python's KeyboardInterrupt, held while
    the command line starts or torch is being imported."""
    if _held.is_set() or not (_starting.is_set() or importing(frame)):
        raise KeyboardInterrupt
    _held.set()
    threading.Thread(target=_send_when_imported, daemon=True).start()


def _send_when_imported() -> None:
    while _starting.is_set() or importing() or _main_thread_in_machinery():
        time.sleep(0.02)
    _held.clear()
    os.kill(os.getpid(), signal.SIGINT)  # to whichever handler is SIGINT's by now


if __name__ == "__main__":
    program()
