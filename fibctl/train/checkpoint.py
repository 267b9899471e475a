"""Checkpoints: written atomically (temporary file, fsync, rename), the last few kept.

A checkpoint is one `torch.save`d dict: model and optimizer state, the step, the sampler
state and every RNG state (torch, CUDA, numpy, python), so training resumes exactly.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from fibctl.errors import FibctlError

_NAME = re.compile(r"^step_(\d+)\.pt$")


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


def save_checkpoint(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Write `state` for `step` atomically, then delete all but the newest `keep`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the old set or the new file, never half of it
    _fsync_dir(run_dir)
    for old in list_checkpoints(run_dir)[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict:
    try:
        # our own files, holding numpy and python RNG states: not weights-only
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise FibctlError(f"checkpoint {path} does not exist") from None


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
