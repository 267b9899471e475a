"""`fibctl queue rm`: a run's rows, and with --checkpoints its checkpoint folder RUNS_DIR/NAME.

The folder is renamed aside, to RUNS_DIR/.NAME.removing-PID-SPACE, before the rows' delete
commits, and deleted after it: a folder that cannot move keeps the run. A kill (SIGKILL: no
cleanup runs) between the rename and the deletion leaves the hidden folder behind, its run
either still in the database (killed before the commit was on disk) or gone. `settle_aside`
finishes that removal's work for the next command that uses the name's folder (`queue rm`,
a worker or `fibctl train` claiming the run): moved back where the run still has it as its
own, deleted where it does not. One whose process still runs is left alone, as is one made
in another PID space (fibctl.durable.pid_space: another machine or container, whose processes
this one cannot see)."""

from __future__ import annotations

import glob
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path, PurePath

from fibctl import durable, queue
from fibctl.db import engine as db_engine
from fibctl.errors import FibctlError, shown_path
from fibctl.names import check_name, is_name, refuse_foreign


def settle_aside(runs_dir: Path, name: str, owned: bool) -> None:
    """Finish what a killed `queue rm --checkpoints` left of RUNS_DIR/NAME: the folder moved
    aside by a process now dead goes back where the run of that name has it as its own
    (`owned`; unless a folder of the name is there again, which its run trains in), else is
    deleted, as that command was asked."""
    folder = runs_dir / name
    for hidden, pid, space in _asides(runs_dir, name):
        if not durable.owner_ended(pid, space):
            continue
        try:
            if not owned:
                shutil.rmtree(hidden)
            elif not os.path.lexists(folder):  # a rename onto an empty folder would replace it
                hidden.rename(folder)
        except OSError as e:
            raise FibctlError(f"cannot {'move' if owned else 'delete'} {shown_path(hidden)}, the checkpoint folder of "
                              f"run {name} a killed `fibctl queue rm` left ({e.strerror or e}): "
                              f"{f'move it back to {shown_path(folder)}' if owned else 'delete it'} by hand") from None


def _asides(runs_dir: Path, name: str) -> list[tuple[Path, str, str | None]]:
    """The folders a `queue rm --checkpoints` moved RUNS_DIR/NAME aside to, real folders only,
    each with its maker's PID and PID space (durable.OWNER's groups)."""
    check_name("run", name)  # a path component: never a way out of the runs folder
    pattern = re.compile(rf"\.{re.escape(name)}\.removing-{durable.OWNER}")
    found = []
    for hidden in sorted(runs_dir.glob(f".{glob.escape(name)}.removing-*")):
        m = pattern.fullmatch(hidden.name)
        if m and not hidden.is_symlink() and hidden.is_dir():
            found.append((hidden, *m.groups()))
    return found


def _maker(pid: str, space: str | None) -> tuple[str, bool]:
    """The process that moved a folder aside, in words, and whether it has ended (False for
    another PID space's, which this one cannot see)."""
    if (space or durable.pid_space()) != durable.pid_space():
        return f"process {pid} of another machine or container", False
    ended = durable.owner_ended(pid, space)
    return f"process {pid}, {'ended' if ended else 'still running'}", ended


def aside_hint(runs_dir: Path, name: str, checkpoint: str | None = None) -> str | None:
    """Where run `name`'s checkpoints are, for a command that found none in RUNS_DIR/NAME: the
    folder a `queue rm --checkpoints` moved aside and `settle_aside` left there (its maker in
    another container, or still running, or RUNS_DIR/NAME made again since); None where there
    is none. Without it the worker said only that the recorded checkpoint does not exist.
    `checkpoint` is the run's recorded one: with both folders there, which one holds it."""
    asides = _asides(runs_dir, name)
    if not asides:
        return None
    hidden, pid, space = asides[-1]
    who, ended = _maker(pid, space)
    said = f"a `fibctl queue rm --checkpoints` ({who}) moved the run's folder aside to {shown_path(hidden)}"
    wait = "" if ended else "once that command is not running, "
    folder = runs_dir / name
    if not os.path.lexists(folder):
        return f"{said}: {wait}move it back to {shown_path(folder)}"
    # it was said to move it back onto a folder that is there: which one is the run's is the
    # person's to decide, from where its recorded checkpoint is
    if checkpoint is None:
        where = "the run records no checkpoint"
    else:
        file = PurePath(checkpoint).name
        holders = [shown_path(f) for f in (hidden, folder) if (f / file).is_file()]
        where = (f"the run's recorded checkpoint {file} is "
                 f"{'in both' if len(holders) == 2 else f'in {holders[0]}' if holders else 'in neither'}")
    return (f"{said}, and {shown_path(folder)} was made again since; {where}: {wait}"
            f"move or merge by hand what is the run's into {shown_path(folder)}, and delete {shown_path(hidden)}")


def settle_or_refuse(runs_dir: Path, name: str, owned: bool, unchanged: str, checkpoint: str | None) -> None:
    """`settle_aside`, for a command about to act on what RUNS_DIR/NAME holds (delete the run's
    rows or its folder): a folder left aside (its maker in another container, or still
    running, or RUNS_DIR/NAME made again since) may hold the run's checkpoints, which the
    command would not see; one line naming it (and which folder holds `checkpoint`, the run's
    recorded one), ending in `unchanged`, instead."""
    settle_aside(runs_dir, name, owned)
    if hint := aside_hint(runs_dir, name, checkpoint):
        raise FibctlError(f"run {name}: {hint}; {unchanged}")


# the metric back-ends' folders in a run's (fibctl.train.loggers): TensorBoard's event files,
# the W&B run files and the W&B id
LOG_FOLDERS = ("tensorboard", "wandb")


def discard_logs(folder: Path) -> list[Path]:
    """Delete the back-ends' folders in run folder `folder`, as `queue retry --from-start`
    discards the rows they copy: the new attempt's curves then start alone, where TensorBoard
    drew both attempts' points at each step and W&B (the same id) dropped the new one's below
    the old one's last step. Real folders only, in a real one: a link is not followed. What
    went; a folder that will not go is one line, before the retry commits."""
    gone = []
    if folder.is_symlink() or not folder.is_dir():
        return gone
    for name in LOG_FOLDERS:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            try:
                shutil.rmtree(path)
            except OSError as e:
                raise FibctlError(f"cannot delete {shown_path(path)}, the metric logs of the run's earlier attempt "
                                  f"({e.strerror or e}): delete it by hand; the run was not queued again") from None
            gone.append(path)
    return gone


def checkpoint_folder(name: str, runs_dir: Path) -> Path:
    """RUNS_DIR/NAME, refused unless it is a real folder directly inside the runs folder."""
    check_name("run", name)
    folder = runs_dir / name
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise FibctlError(f"{shown_path(folder)} is not a checkpoint folder (a link or a file); nothing was removed")
    if folder.exists() and folder.resolve().parent != runs_dir.resolve():
        raise FibctlError(f"{shown_path(folder)} is not inside the runs folder {shown_path(runs_dir)}; nothing was "
                          "removed")
    from fibctl.train.checkpoint import OWN  # torch: only for this command

    if folder.exists():  # a folder of the same name that is not (only) this run's checkpoints
        refuse_foreign(folder, OWN, "fibctl", "nothing was removed")
    return folder


def remove_run(db: str, name: str, checkpoints: bool, runs_dir: Path | None, ask: Callable[[str], None]) -> str:
    """Remove run `name` (and with `checkpoints` its folder in `runs_dir`, default the one it
    last trained in, else runs); the line that says what went. `ask(question)` is called
    with what it will delete before anything is: what it raises removes nothing."""
    def runs_of(recorded_dir: str | None) -> Path:
        return runs_dir or Path(recorded_dir or "runs")

    def folder_of(recorded_dir: str | None, checkpoint: str | None = None) -> Path:
        # the run is there: what a killed removal left is its own; with --checkpoints it is to go
        # too, so a folder left aside that cannot be settled (unseen, it would stay) is refused
        if checkpoints:
            settle_or_refuse(runs_of(recorded_dir), name, True, "nothing was removed", checkpoint)
        else:
            settle_aside(runs_of(recorded_dir), name, owned=True)
        return checkpoint_folder(name, runs_of(recorded_dir)) if checkpoints else runs_of(recorded_dir) / name

    removable = queue.check_remove(name, folder_of)
    older: list[int] = []  # the run's rows in a database of an older revision, before its upgrade

    def check(reader) -> None:  # a read-only engine on the database as it is
        try:
            removable(reader)
        except FibctlError:
            if is_name(name) and not queue.exists(reader, name):  # one killed after its commit: its folder goes
                settle_aside(runs_of(None), name, owned=False)
            raise
        r = queue.to_remove(reader, name)
        if db_engine.current_revision(reader) != db_engine.head_revision():
            older.append(r.rows)
        what = f"remove run {name} ({r.status}) and its {r.rows:,} metric and event row(s)"
        # the folder `removable` has just checked and settled: named, not settled again
        ask(what + (f", and delete {runs_of(r.runs_dir) / name}?" if checkpoints else "?"))

    # on the database as it is, before any upgrade: a refusal, or a "no", leaves it as it was
    engine = db_engine.connect(db, must_exist=True, check=check)
    # rows the upgrade itself just derived (0007 names a probe model's task) are not counted:
    # the run's rows are said as the question said them, as the database held them
    derived = queue.to_remove(engine, name).rows - older[0] if older else 0
    folder: list[Path] = []  # checked again before any row is deleted: it may have changed
    aside: list[Path] = []

    def move_aside() -> None:  # before the delete commits: a folder that cannot move keeps the run
        if checkpoints and folder[0].exists():
            hidden = folder[0].with_name(f".{name}.removing-{durable.owner()}")
            try:
                folder[0].rename(hidden)
            except OSError as e:
                raise FibctlError(f"cannot delete {shown_path(folder[0])}: {e.strerror or e}; nothing was "
                                  "removed") from None
            aside.append(hidden)

    try:
        removed = queue.remove(engine, name, lambda *recorded: folder.append(folder_of(*recorded)), move_aside)
    except BaseException:
        for hidden in aside:  # the rows stay: so does the folder, where it was
            hidden.rename(folder[0])
        raise
    message = f"removed run {name} ({removed.status}) and {removed.rows - derived} metric and event row(s)"
    if aside:
        try:
            shutil.rmtree(aside[0])
        except OSError as e:
            left = folder[0]
            try:
                aside[0].rename(left)
            except OSError:
                left = aside[0]
            failed = shown_path(e.filename or aside[0])  # shown_path takes no None
            raise FibctlError(f"{message}, but not all of its checkpoint folder ({failed}: {e.strerror or e}); "
                              f"what is left is at {shown_path(left)}: delete it by hand") from None
        return message + f"; deleted {shown_path(folder[0])}"
    if checkpoints:
        return message + f"; no checkpoint folder at {shown_path(folder[0])}"
    stay = [f"{shown_path(folder[0])} (--checkpoints deletes them)"] if _holds_checkpoints(folder[0]) else []
    # a folder another `queue rm --checkpoints` has aside (settle_aside left it): without it
    # named, the run's checkpoints were said to be nowhere
    stay += [f"{shown_path(hidden)}, moved aside there by a `fibctl queue rm --checkpoints` ({_maker(pid, space)[0]}) "
             "that was to delete them" for hidden, pid, space in _asides(folder[0].parent, name)
             if _holds_checkpoints(hidden)]
    return message + (f"; its checkpoints stay in {' and in '.join(stay)}" if stay else "")


def _holds_checkpoints(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("step_*.pt"))
