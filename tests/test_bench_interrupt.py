"""Ctrl-C during `fibctl bench train|probe|queue`, whose measurements run in child processes
(spawned for train and probe, forked for queue): one line on stderr, exit 130, no traceback
from any process, and no process of the command left running.

A Ctrl-C at a terminal goes to the whole foreground process group: each command runs here in
a session of its own and gets SIGINT as a group (as `timeout -s INT` sends it), once a child
is running (a spawned one is then importing torch, where its traceback was printed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fibctl.errors import FibctlError


def _processes(pgid: int) -> dict[int, tuple[int, str]]:
    """The live processes of process group `pgid` (zombies left out): pid -> (ppid, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        state, ppid, group = fields[0], int(fields[1]), int(fields[2])
        if group == pgid and state != "Z":
            found[int(entry.name)] = (ppid, cmdline)
    return found


def _importing_torch(pid: int, group: dict[int, tuple[int, str]]) -> bool:
    """A measuring process spawned by multiprocessing (not its resource tracker) is importing
    torch: it has loaded torch's library, the start of an import that runs on for a second
    (or is past it, on a fast machine: the Ctrl-C then reaches a measurement)."""
    for child, (_, cmdline) in group.items():
        if "spawn_main" in cmdline:
            try:
                if "libtorch" in (Path("/proc") / str(child) / "maps").read_text():
                    return True
            except OSError:  # gone meanwhile
                pass
    return False


def _forked(pid: int, group: dict[int, tuple[int, str]]) -> bool:
    """A claiming process forked by `pid` is running."""
    return any(ppid == pid and "resource_tracker" not in cmdline for ppid, cmdline in group.values())


def interrupted(tmp_path: Path, args: list[str], started: Callable[[int, dict], bool],
                delay_s: float = 0.0) -> str:
    """`fibctl ARGS`, SIGINT to its process group `delay_s` after `started` says a child runs;
    asserts exit 130 and that every process of the group ends; its stderr."""
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "fibctl", *args], stdout=stdout, stderr=stderr,
                                start_new_session=True, env={**os.environ, "COLUMNS": "120"})
    try:
        deadline = time.monotonic() + 120
        while not started(proc.pid, _processes(proc.pid)):
            assert proc.poll() is None, f"ended before a child started: {err.read_text()}"
            assert time.monotonic() < deadline, "no child started"
            time.sleep(0.02)
        time.sleep(delay_s)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        deadline = time.monotonic() + 15  # multiprocessing's resource tracker ends once its parent has
        while (left := _processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _processes(proc.pid):  # what this test started, should an assertion below fail
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = err.read_text()
    assert not left, f"left running: {left}"
    assert code == 130, (code, text)
    assert "Traceback" not in text and "Error" not in text, text
    return text


def _one_line(text: str) -> None:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted"), text


@pytest.mark.parametrize("delay_s", [0.0, 2.0])
def test_ctrl_c_in_bench_train_is_one_line_and_ends_its_measuring_process(tmp_path, delay_s):
    """At once: the spawned child is importing torch (it printed `Process SpawnProcess-1:
    Traceback ... KeyboardInterrupt`, or `ImportError: cannot load module more than once per
    process`); two seconds later it is measuring, or the next one is starting."""
    _one_line(interrupted(tmp_path, ["bench", "train", "--preset", "micro", "--steps", "50"], _importing_torch,
                          delay_s))


def test_ctrl_c_in_bench_probe_is_one_line_and_ends_its_measuring_process(tmp_path):
    _one_line(interrupted(tmp_path, ["bench", "probe", "--length", "256", "--width", "64"], _importing_torch))


def test_ctrl_c_in_bench_queue_is_one_line_and_ends_its_claiming_processes(tmp_path):
    """The forked claimers printed `Process ForkProcess-1: Traceback ... KeyboardInterrupt`,
    and the command itself exited 130 saying nothing."""
    _one_line(interrupted(tmp_path, ["bench", "queue", "--processes", "2", "--runs", "3000"], _forked))


def test_a_measurements_error_is_raised_here_and_its_process_reaped():
    """As concurrent.futures did: the error the measurement raised, its traceback as the cause."""
    from fibctl.flows.bench import in_fresh_process

    with pytest.raises(ValueError, match="invalid literal") as raised:
        in_fresh_process(int, "x", what="the measurement")
    assert "Traceback" in str(raised.value.__cause__)
    with pytest.raises(FibctlError, match="^the measurement: its process died"):
        in_fresh_process(os._exit, 3, what="the measurement")
    import multiprocessing

    assert multiprocessing.active_children() == []


def test_children_start_with_ctrl_c_ignored_and_the_handler_is_put_back():
    from fibctl.flows.bench_queue import sigint_left_to_parent

    before = signal.getsignal(signal.SIGINT)
    with sigint_left_to_parent():
        child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"],
                               capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGINT) is before
