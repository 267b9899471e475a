"""torchrun, as `fibctl train --nproc` and `fibctl worker --ddp` start it (`launch_ddp`).

The ranks print their own one-line errors; torchrun's failure report (a traceback of its own
frames, then a table of exit codes) would bury them, so this runs torchrun's `run` and exits
with the ranks' code instead. `python -m torch.distributed.run` by hand is unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

LAUNCHER = "FIBCTL_LAUNCHER_PID"  # the fibctl command whose end stops this group (launch_ddp sets it)
PR_SET_PDEATHSIG = 1
# a file made before the group is stopped (Ctrl-C or SIGTERM at the launcher, the launcher's
# end): a rank dying after it died of that stop (a rank still starting ends at its SIGTERM),
# where torchrun's own SIGTERM after a rank's death looks the same to the others
STOP_MARK = "FIBCTL_STOP_MARK"
ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun gives each rank
JOB_TASK = "FIBCTL_SLURM_TASK"  # "JOB TASK RESTART": set by a `slurm submit --ddp` task for its ranks
REQUEUE = "requeue"  # what a SLURM task's stop mark says when the job requeues itself (stop_reason)


def launched() -> bool:
    """Whether this process is one rank of a torchrun group (its environment is set)."""
    return all(name in os.environ for name in ENVIRONMENT)


def missing() -> list[str]:
    """The names of torchrun's environment this process lacks where it has some of them (a rank
    started by hand: neither one process nor a rank of a group); [] with all or none."""
    absent = [name for name in ENVIRONMENT if name not in os.environ]
    return absent if len(absent) < len(ENVIRONMENT) else []


def reports() -> bool:
    """Whether this process reports the runs it trains: a single process, or rank 0 of a group
    (the other ranks train what it claims and say nothing)."""
    return not launched() or os.environ["RANK"] == "0"


def in_slurm_job() -> bool:
    """Whether this process is a rank of a `slurm submit --ddp` job's group (JOB_TASK)."""
    return JOB_TASK in os.environ


def mark_stop(path: str | None, why: str = "") -> None:
    """Say the group is being stopped (STOP_MARK), and why, before any rank is signalled."""
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(why)


def stop_marked() -> bool:
    """Whether this rank's group is being stopped by its launcher (STOP_MARK)."""
    path = os.environ.get(STOP_MARK)
    return bool(path) and os.path.exists(path)


def stop_reason() -> str | None:
    """Why this rank's group was stopped, as its launcher marked it ("" said nothing); None
    where it was not marked."""
    path = os.environ.get(STOP_MARK)
    try:
        return Path(path).read_text() if path else None
    except (OSError, UnicodeDecodeError):
        return None


def exit_code(codes: dict[int, int]) -> int:
    """The group's exit code from its failed ranks' (rank -> code): rank 0's, which reports the
    run, else the first; a rank a signal ended (torch gives -N) as a shell reads it, 128 + N.
    Rank 0 ended by SIGTERM is torchrun stopping it after another rank ended (a rank handles a
    SIGTERM of its own and exits 0): a failed run both ranks met, say; the other rank's code."""
    if codes.get(0) == -signal.SIGTERM and len(codes) > 1:
        codes = {rank: code for rank, code in codes.items() if rank != 0}
    code = codes[0] if 0 in codes else codes[min(codes)]
    return 128 - code if code < 0 else code


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks), from /proc; [] without it."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(entry.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def start_group(torchrun_args: list[str], fibctl_args: list[str], mark: str, env: dict[str, str] | None = None,
                shielded: tuple[int, ...] = ()) -> subprocess.Popen:
    """torchrun (this module's `main`) with `torchrun_args`, each rank running `fibctl
    FIBCTL_ARGS`, in its own session; this process is its launcher (its end stops the group)
    and `mark` the file that says the group is being stopped (`stop_group`). The `shielded`
    signals are blocked in torchrun and its ranks (inherited across exec): a SLURM job's USR2
    reaches every process of a task, and its launcher alone must act on it."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, shielded) if shielded else None
    try:
        # OMP_NUM_THREADS: torchrun's own default, given so that it does not print a banner about it
        return subprocess.Popen([sys.executable, "-m", "fibctl.flows.torchrun", *torchrun_args, "-m", "fibctl",
                                 *fibctl_args],
                                env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {}),
                                     LAUNCHER: str(os.getpid()), STOP_MARK: mark}, start_new_session=True)
    finally:
        if blocked is not None:  # one that came meanwhile is delivered here now
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def stop_group(child: subprocess.Popen, mark: str, why: str = "") -> None:
    """Ask a group `start_group` started to stop: mark the stop (`why`), then SIGTERM to every
    rank (each finishes the step; rank 0 checkpoints and requeues the run, and torchrun ends
    with them); where the ranks cannot be listed (no /proc, or none yet), to torchrun itself."""
    mark_stop(mark, why)
    for pid in children(child.pid) or ([child.pid] if child.poll() is None else []):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def end_with_launcher() -> None:
    """Stop the ranks when the launcher ends, however it ends (SIGKILL, the SIGHUP of a closed
    terminal): in its own session the group would otherwise train on unattended, and a rank's
    line to a closed terminal would fail the run. The kernel then signals this process (once per
    thread of the launcher: SIGUSR1, which torchrun leaves alone), and the ranks get one SIGTERM
    each, as from the launcher after Ctrl-C: rank 0 checkpoints and requeues the run."""
    launcher = os.environ.pop(LAUNCHER, None)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    if not re.fullmatch(r"[1-9][0-9]*", launcher):  # set by hand: int() would raise, or take " 7\n"
        print(f"error: {LAUNCHER}={launcher!r} is not a process id (fibctl sets it for "
              "the torchrun it starts): unset it", file=sys.stderr)
        sys.exit(2)
    stopped = []

    def stop(_signum, _frame):
        if not stopped:
            stopped.append(True)
            mark_stop(os.environ.get(STOP_MARK))
            for pid in children(os.getpid()) or [os.getpid()]:  # no ranks yet: torchrun stops itself
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGUSR1, stop)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != int(launcher):  # it ended before the line above: no signal will come
        sys.exit(128 + signal.SIGTERM)


def main(argv: list[str]) -> int:
    end_with_launcher()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its own lines repeat the ranks'
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        return exit_code({rank: failure.exitcode for rank, failure in e.failures.items()})
    except SignalException as e:  # stopped before or while the ranks started: they are stopped too
        return 128 + signal.Signals(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
