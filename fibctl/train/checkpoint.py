"""Checkpoints: written atomically (temporary file, fsync, rename), the last few kept.

A checkpoint is one `torch.save`d dict of tensors and plain Python values only: model and
optimizer state, the step, the sampler state, every RNG state (torch, CUDA, numpy, python)
so training resumes exactly, and the run's config, config hash and data hash so a resume
can tell whether the checkpoint is the run's. It is read with `weights_only=True`: a file
that would need anything else to unpickle (code, in a crafted one) is refused, not run.

The database stores a checkpoint's path relative to the runs folder (`RUN/step_N.pt`) and
resolves it against the `--runs-dir` given, so a runs folder can be named from anywhere.
Paths written before that (absolute, or relative to the worker's directory) resolve only
where they name the run's folder in the runs folder given (`resolve_path`); any path that is
not a `step_N.pt` file directly in a folder named after its run is refused.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import warnings
from contextlib import suppress
from pathlib import Path, PurePath

import numpy as np
import torch

from fibctl.config import RunConfig
from fibctl.durable import fsync
from fibctl.errors import FibctlError, WorkerError, first_line, shown_path

_NAME = re.compile(r"^step_(\d+)\.pt$")
_TEMPORARY = re.compile(r"^step_\d+\.pt\.tmp$")
DAMAGED = ".damaged"  # a checkpoint that would not load, moved aside (fibctl.train.trainer.Trainer.resume)
# everything fibctl writes into a run's folder: checkpoints, their temporary files, damaged
# checkpoints moved aside, loggers' folders
OWN = re.compile(r"^(step_\d+\.pt(\.tmp|\.damaged)?|tensorboard|wandb)$")
# What checkpoints written before weights-only loading hold besides tensors: numpy's RNG
# state, a plain uint32 array. Rebuilding an array runs no code of the file's choosing.
_LEGACY_NUMPY = [np.dtype, np.ndarray, np.dtypes.UInt32DType, np._core.multiarray._reconstruct]


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary files are never listed)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files an interrupted save left in this run's folder (a kill or a
    third Ctrl-C mid-write); returns them. Only `step_N.pt.tmp` files directly in `run_dir`:
    every other run has its own folder."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    stale = [p for p in run_dir.iterdir() if _TEMPORARY.match(p.name)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write `state` for `step` atomically, then delete all but the newest `keep`."""
    run_dir = Path(run_dir)
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # a crash's leftovers, or a link: "x" opens a new file, never a link's target
        remove_temporaries(run_dir)
        with open(tmp, "xb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a reader sees the old set or the new file, never half of it
        fsync(run_dir)
    except KeyboardInterrupt:  # a second Ctrl-C mid-write: the half-written file goes, the stop goes on
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    except (OSError, RuntimeError) as e:  # torch's writer reports a failed write as a RuntimeError
        # the runs folder's fault (a full disk, say), not the run's: WorkerError requeues the
        # run and stops the worker, rather than failing every run it would claim next
        with suppress(OSError):  # no folder to delete it from, say
            tmp.unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e, 100)
        raise WorkerError(f"cannot write checkpoint {shown_path(path)}: {reason}{_free(run_dir)}") from None
    for old in list_checkpoints(run_dir)[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def _free(folder: Path) -> str:
    """How much room the folder's disk has, where it can be asked: a full disk is the usual cause."""
    try:
        return f" ({shutil.disk_usage(folder).free:,} bytes free there)"
    except OSError:
        return ""


class DamagedCheckpoint(FibctlError):
    """A checkpoint that cannot be read back (truncated, not one, a part missing): a run
    resumes from the one before it instead. A file refused as unsafe is not one of these."""


def load_checkpoint(path: Path) -> dict:
    """The checkpoint's dict, loaded weights-only; DamagedCheckpoint for a file that does not
    read back as one, FibctlError for anything else."""
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY), warnings.catch_warnings():
            # a plain pickle (not torch.save's) gets a warning about its protocol before the refusal:
            # the refusal below is the one line to show
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FibctlError(f"checkpoint {shown_path(path)} does not exist") from None
    except IsADirectoryError:
        raise FibctlError(f"checkpoint {shown_path(path)} is a directory") from None
    except pickle.UnpicklingError as e:
        # torch's message is a page of advice; the line naming what was refused is the one to show
        reason = next((line for line in str(e).splitlines() if "nsupported" in line), "not weights-only")
        raise FibctlError(f"checkpoint {shown_path(path)} was refused: it holds more than tensors and plain values "
                          f"({reason[:200]})") from None
    except Exception as e:  # truncated, random or empty files raise whatever the reader hit first
        raise DamagedCheckpoint(f"checkpoint {shown_path(path)} is damaged or not a checkpoint "
                                f"({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise DamagedCheckpoint(f"checkpoint {shown_path(path)} is not a fibctl checkpoint (no model weights and step)")
    # checked here, for every reader (a resume, fibctl eval): load_state_dict and the step's
    # arithmetic would otherwise raise a TypeError, a traceback, wherever they read it
    weights, step = state["model"], state["step"]
    problem = _weights_problem(weights)
    if problem:
        raise DamagedCheckpoint(f"checkpoint {shown_path(path)} is damaged or not a checkpoint "
                                f"(its model weights {problem})")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        what = step if isinstance(step, int) and not isinstance(step, bool) else _a(step)
        raise DamagedCheckpoint(f"checkpoint {shown_path(path)} is damaged or not a checkpoint (its step is {what}, "
                                "not a count of steps)")
    # compared with the run's as text: a tensor there raised a RuntimeError (a traceback) in the comparing
    odd = next((k for k in ("config_hash", "data_hash") if state.get(k) is not None and not isinstance(state[k], str)),
               None)
    if odd:
        raise DamagedCheckpoint(f"checkpoint {shown_path(path)} is damaged or not a checkpoint (its {odd} is "
                                f"{_a(state[odd])}, not text)")
    return state


def _weights_problem(weights) -> str | None:
    """What makes a checkpoint's `model` entry other than a dict of named tensors, or None."""
    if not isinstance(weights, dict):
        return f"are {_a(weights)}, not a dict of named tensors"
    for name, value in weights.items():
        if not isinstance(name, str) or not torch.is_tensor(value):
            return f"hold {_a(value)} under {name!r}, not a tensor"
    return None


def _a(value) -> str:
    """A value's type with its article: "an int", "a list"."""
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to `step_N.pt.damaged`: no longer listed, so neither
    resumed from nor counted among the kept ones, yet there to look at."""
    aside = path.with_name(path.name + DAMAGED)
    os.replace(path, aside)
    return aside


# ----------------------------------------------------------------------------- paths in the database


def stored_path(path: Path, run_name: str) -> str:
    """What the database records for `path`, a checkpoint in the run's own folder: the path
    relative to the runs folder (a run trains only there: `resolve_path`)."""
    return f"{run_name}/{Path(path).name}"


def resolve_path(stored: str, runs_dir: Path, run_name: str) -> Path:
    """The file a recorded checkpoint path names, after checking it is the run's own: always
    RUNS_DIR/RUN/step_N.pt. A path an older fibctl recorded (absolute, or relative to its
    directory) is taken only where it names that same folder: a database another user wrote
    (a shared server), or an old one moved, would otherwise have a worker write and delete
    checkpoints, and eval write its logs, wherever the path pointed."""
    p = PurePath(stored)
    if _NAME.match(p.name) is None or p.parent.name != run_name or ".." in p.parts:
        raise FibctlError(f"run {run_name!r} records checkpoint {stored!r}, which is not a step_N.pt file "
                          f"in the run's own folder {run_name}/; refused")
    own = Path(runs_dir) / run_name
    if (p.is_absolute() or len(p.parts) != 2) and os.path.realpath(p.parent) != os.path.realpath(own):
        # the runs folder given is at fault, not the run: the worker leaves it queued
        raise WorkerError(f"run {run_name!r} records checkpoint {shown_path(stored)}, outside its folder "
                          f"{shown_path(own)}; refused: give --runs-dir {shown_path(p.parent.parent)} if it "
                          "trained there")
    return own / p.name


# ----------------------------------------------------------------------------- RNG states


def rng_states() -> dict:
    """Every RNG state as tensors and plain values (what weights-only loading accepts)."""
    version, internal, gauss_next = random.getstate()
    states = {"torch": torch.get_rng_state(), "numpy": numpy_state_dict(np.random.get_state()),
              "python": {"version": version, "state": list(internal), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(numpy_state(states["numpy"]))
    random.setstate(_python_state(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        # the devices this process sees, no more: rank 0 of a DDP group (or an unpinned worker)
        # saves one state per GPU of its node, and a worker pinned to one GPU (--gpus) resumes
        # its checkpoint; set_rng_state_all would index a device it lacks (IndexError)
        for index, state in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, index)


def numpy_state_dict(state: tuple) -> dict:
    """A numpy generator's state (`get_state()`'s tuple) as tensors and plain values."""
    kind, keys, pos, has_gauss, gauss = state
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}


def numpy_state(s) -> tuple:
    """The tuple `set_state()` takes, from numpy_state_dict's dict; ValueError for one that
    is not an MT19937 state."""
    if not isinstance(s, dict):  # an older checkpoint: numpy's own tuple
        kind, keys, pos, has_gauss, gauss = s
        _check_mt19937(kind, np.asarray(keys), pos, has_gauss)
        return s
    keys = s["keys"]
    if not torch.is_tensor(keys):  # .numpy() below raised an AttributeError: a traceback
        raise ValueError(f"numpy generator keys are {_a(keys)}, not a tensor")
    keys = keys.numpy()
    _check_mt19937(s["kind"], keys, s["pos"], s["has_gauss"])
    return (s["kind"], keys.astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])


def _check_mt19937(kind, keys: np.ndarray, pos, has_gauss) -> None:
    """numpy's set_state checks none of this: a position past the keys read memory beyond them
    (wrong draws, or a segfault), short keys raised an IndexError, all-zero keys draw zeros."""
    if kind != "MT19937":
        raise ValueError(f"numpy generator kind is {kind!r}, not 'MT19937'")
    if keys.shape != (624,) or keys.dtype.kind not in "iu" or not ((keys >= 0) & (keys < 2 ** 32)).all() \
            or not keys.any():
        raise ValueError(f"numpy generator keys are not 624 32-bit words, not all 0 (shape {keys.shape}, {keys.dtype})")
    if not isinstance(pos, (int, np.integer)) or isinstance(pos, bool) or not 0 <= pos <= 624:
        raise ValueError(f"numpy generator position is {pos!r}, not 0 to 624")
    if has_gauss not in (0, 1):
        raise ValueError(f"numpy generator has_gauss is {has_gauss!r}, not 0 or 1")


def _python_state(s) -> tuple:
    if not isinstance(s, dict):  # an older checkpoint: random.getstate() as it was
        return s
    return (s["version"], tuple(s["state"]), s["gauss_next"])


def stored_config_hash(state: dict) -> str:
    """The config hash a checkpoint records (before hashes were stored: its config's)."""
    if state.get("config_hash"):
        return state["config_hash"]
    try:
        return RunConfig.from_dict(state.get("config")).config_hash
    except (KeyError, TypeError, AttributeError):
        return "(none recorded)"
