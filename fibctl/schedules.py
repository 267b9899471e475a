"""Which distances each layer attends to (docs/method.md, "The attended set"), in plain Python.

A query at position i attends to keys at distances 0..W (the local window) and to the
rungs alpha_l * b_k of a base sequence b. Everything here is integer or float arithmetic
on lists, so it can be read against the method line by line. The model, `fibctl model`,
`fibctl coverage` and the coverage figure all take their distances from here: a static
layer's rungs are `round(alpha_l * b_k)` with alpha_l a Python float (float64), exactly as
the study computed them; a learned layer passes the products it computed in its
parameter's dtype to `fractional_rungs`.
"""

from __future__ import annotations

import math

from fibctl.config import BASES, SCHEDULES, ConfigError
from fibctl.errors import unknown

FIB = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181, 6765]
ALPHA_MIN, ALPHA_RANGE = 0.5, 1.0  # alpha = 0.5 + 1.0 * sigmoid(theta), in [0.5, 1.5]


def base_sequence(base: str, seq_len: int, n_rungs: int = 15) -> list[int]:
    """The rungs b_k. `fib` is fixed whatever the length; `pow2` is rebuilt at every length."""
    if base == "fib":
        if n_rungs > len(FIB):
            raise ConfigError(f"n_rungs K={n_rungs} exceeds the {len(FIB)} Fibonacci rungs available")
        return FIB[:n_rungs]
    if base == "pow2":
        out, b = [], 1
        while b <= seq_len - 1:
            out.append(b)
            b *= 2
        return out
    raise ConfigError(unknown("base", base, BASES))


def built_base(base: str, seq_len: int, built_at: int | None, n_rungs: int = 15) -> list[int]:
    """The rungs b_k a model built at `built_at` reads an input of `seq_len` with: those of the
    longer length (an input past the built length reads as by a model rebuilt at its length)."""
    return base_sequence(base, max(seq_len, built_at or seq_len), n_rungs)


def coprime_stride(n_layers: int) -> int | None:
    """S: the largest integer from L/2 down to 2 coprime with L; None when there is none."""
    for s in range(n_layers // 2, 1, -1):
        if math.gcd(s, n_layers) == 1:
            return s
    return None


def coprime_slots(n_layers: int) -> list[int]:
    """Slot of each layer in the stagger ramp under the coprime (HDC) schedule.

    For L = 3, 4, 6 no stride exists (the study's code raises); fibctl interleaves the two
    halves of the ramp instead so that adjacent layers still differ.
    """
    L = n_layers
    if L <= 2:
        return list(range(L))
    s = coprime_stride(L)
    if s is None:
        half = math.ceil(L / 2)
        return [l // 2 + (l % 2) * half for l in range(L)]
    return [(s * l) % L for l in range(L)]


def deviations(schedule: str, n_layers: int) -> list[str]:
    """Where this schedule, at this depth, is fibctl's choice rather than the study's (said
    by `fibctl model` and `fibctl coverage`, recorded as an event by a run that trains so)."""
    if schedule == "coprime" and n_layers > 2 and coprime_stride(n_layers) is None:
        slots = ", ".join(map(str, coprime_slots(n_layers)))
        return [f"coprime at L={n_layers}: no stride from L/2 down to 2 is coprime with L and the study's code "
                f"defines none; fibctl interleaves the two halves of the ramp (slots {slots})"]
    return []


def coinciding(schedule: str, n_layers: int) -> list[str]:
    """The other integer schedules that give every layer of this depth the same alpha, and so
    the same attended distances (coprime and stagger at L = 2, all three at L = 1): runs of
    them train the same model, which a reader of identical results should be told."""
    fixed_alphas = ("fixed", "stagger", "coprime")  # learned moves away from its start; dense has no rungs
    if schedule not in fixed_alphas:
        return []
    alphas = layer_alphas(schedule, n_layers)
    return [other for other in fixed_alphas if other != schedule and layer_alphas(other, n_layers) == alphas]


def layer_alphas(schedule: str, n_layers: int) -> list[float]:
    """alpha_l for every layer (the initial values for `learned`). Dense has no rungs: 1."""
    L = n_layers

    def ramp(slot: int) -> float:
        return 1.0 if L == 1 else 0.5 + slot / (L - 1)

    if schedule in ("fixed", "learned", "dense"):
        return [1.0] * L
    if schedule == "stagger":
        return [ramp(l) for l in range(L)]
    if schedule == "coprime":
        return [ramp(s) for s in coprime_slots(L)]
    raise ConfigError(unknown("schedule", schedule, SCHEDULES))


PROBE_ALPHA_CLAMP = (0.55, 1.45)  # a staggered probe start stays inside sigmoid's open range


def probe_alphas(init: str, n_layers: int) -> list[float]:
    """A probe model's starting alpha per layer: `uniform` 1 everywhere; `staggered` the
    stagger ramp 0.5 + l / (L-1), clamped to [0.55, 1.45] so that theta = logit is finite."""
    if init == "uniform":
        return [1.0] * n_layers
    low, high = PROBE_ALPHA_CLAMP
    return [min(high, max(low, a)) for a in layer_alphas("stagger", n_layers)]


def window_distances(window: int, seq_len: int) -> list[int]:
    """0..W, capped at T-1: farther window columns would be invalid for every query."""
    return list(range(min(window, seq_len - 1) + 1))


def integer_distances(alpha: float, base: list[int], window: int, seq_len: int) -> list[int]:
    """Window plus kept rungs r_k = round(alpha * b_k), W < r_k <= T-1, duplicates collapsed."""
    rungs = sorted({r for r in (round(alpha * b) for b in base) if window < r <= seq_len - 1})
    return window_distances(window, seq_len) + rungs


def fractional_rungs(targets: list[float], window: int, seq_len: int) -> list[tuple[int, int]]:
    """(k, lo) for each rung the fractional (learned) path keeps, given the targets t_k = alpha * b_k.

    The caller computes the targets once, in the dtype the interpolation weights will use, so
    that `lo = floor(t_k)` and the weight `t_k - lo` come from the same number. Skipped:
    round(t_k) <= W, lo > T-1, or lo equal to a column already used.
    """
    used = set(range(window + 1))
    kept = []
    for k, t in enumerate(targets):
        lo = math.floor(t)
        if round(t) <= window or lo > seq_len - 1 or lo in used:
            continue
        used.add(lo)
        kept.append((k, lo))
    return kept


def rungs_always_kept(base: str, window: int, seq_len: int, n_rungs: int = 15) -> bool:
    """Whether a learned layer keeps a rung at every alpha in [0.5, 1.5] at its training length:
    some b_k whose target stays beyond the window and inside the sequence wherever alpha goes
    (kept, or its row already taken by an earlier kept rung). Otherwise theta can drop out of
    the loss, its gradient left empty."""
    high = ALPHA_MIN + ALPHA_RANGE
    return any(ALPHA_MIN * b >= window + 1 and math.floor(high * b) <= seq_len - 1
               for b in base_sequence(base, seq_len, n_rungs))


def blur_rungs(base: list[int], centres: list[float], window: int, seq_len: int) -> list[tuple[int, int]]:
    """(k, c) for each rung the probe's blur attention keeps, given the base b_k and the centres
    d_k = alpha * b_k: c = round(d_k) is the band's middle offset. Only base values past the
    window are rungs at all, as in the study's probe (b_k = 8 at W=8 stays out even when
    alpha > 1 would carry it to 12); the others are skipped when c <= W or c > T-1."""
    return [(k, round(d)) for k, (b, d) in enumerate(zip(base, centres))
            if b > window and window < round(d) <= seq_len - 1]


def attended_distances(base: str, schedule: str, window: int, n_layers: int, seq_len: int,
                       n_rungs: int = 15, built_at: int | None = None) -> list[list[int]]:
    """Integer distances attended by each layer (learned: at its initial alpha = 1) at length
    `seq_len`, in a model built at `built_at` (default: the same length).

    The one function that decides what a static layer attends to: the model's columns,
    `fibctl model`, `fibctl coverage` and the coverage figure all call it. `pow2`'s rungs come
    from the longer of the two lengths: a model built at T and fed fewer tokens keeps the
    rungs of T (those past the input are invalid for every query and dropped), so its output
    on a prefix is the prefix of its output.
    """
    if schedule == "dense":
        return [list(range(seq_len)) for _ in range(n_layers)]
    b = built_base(base, seq_len, built_at, n_rungs)
    return [integer_distances(a, b, window, seq_len) for a in layer_alphas(schedule, n_layers)]


def coverage(per_layer: list[list[int]]) -> tuple[list[int], int]:
    """Distinct distances per layer, and in the union over layers (one set at a time: a dense
    layer lists every distance up to T)."""
    union: set[int] = set()
    for d in per_layer:
        union.update(d)
    return [len(set(d)) for d in per_layer], len(union)
