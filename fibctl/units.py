"""Durations for people: `42s`, `3m05s`, `2h07m` (the demo's total time, `fibctl status`'s
ETA and heartbeat age); the one ETA, which the training line and `fibctl status` both show."""

from __future__ import annotations

import math


def duration(seconds: float) -> str:
    if math.isnan(seconds) or seconds == math.inf:  # a time edited to nan or inf: no whole seconds (int() raised)
        return str(seconds)
    seconds = int(math.ceil(max(seconds, 0)))
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}h{rest // 60:02d}m"
    return f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


def eta_s(step: int, steps: int, elapsed_s: float | None) -> float | None:
    """Seconds a run at `step` of `steps` has left at its pace so far: `elapsed_s`, the wall
    seconds it has trained over every attempt (evaluations and checkpoints included, as
    `train_steps.elapsed_s` records them), per step done. None before its first step."""
    if elapsed_s is None or step <= 0:
        return None
    return elapsed_s / step * max(steps - step, 0)
