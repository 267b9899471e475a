"""The probe's matrix: one run per depth x init x seed (docs/method.md, "Table 2: the
mechanism probe"), each a `RunConfig` of the `probe` preset with its `ProbeConfig`."""

from __future__ import annotations

import dataclasses
import math

from fibctl.config import PROBE_INITS, ConfigError, ProbeConfig, RunConfig, check_seed, get_preset
from fibctl.hashes import short_hash

PROBE_MATRIX = "probe"
PROBE_METRICS = "marked_retrieval"  # aux_metrics.name of a probe model's scores (Table 2)
DEPTHS, SEEDS = (2, 4, 8), (0, 1)
QUICK_STEPS = 200  # --quick: depth 2, both inits, seed 0


def task_label(seq_len: int, vocab_size: int, distances) -> str:
    """What a probe model was trained and scored on, as Table 2 groups and names it: scores of
    different tasks are not comparable (a `--length 64 --distance 20` probe is not the study's)."""
    return f"length {seq_len}, vocab {vocab_size}, distances {'/'.join(str(d) for d in sorted(distances))}"


# bounds of a task's size that still fit in memory on one machine (the study: 512 and 512)
PROBE_MAX_LENGTH, PROBE_MAX_VOCAB = 65_536, 65_536
PROBE_MAX_DEPTH, PROBE_MAX_EVAL_SEQUENCES = 1_024, 1_000_000
# what one probe run may need at its peak: each bound above fits alone, but their products
# (a deep model at a long length, a large vocabulary at a long length, many held-out sequences
# at a long length) do not; `probe_memory` estimates it and a run over this is refused
PROBE_MAX_MEMORY = 64 * 2**30
GiB = 2**30


def probe_memory(model, probe, batch_size: int) -> tuple[int, int]:
    """Estimated peak bytes of a probe run (training step, scoring), an upper bound in float32.

    Coefficients measured on the CPU (docs/benchmarks.md, "A probe run's memory") and rounded
    up: per parameter its value, gradient, AdamW's two moments and slack for the checkpoint
    (20 bytes); per trained token, each layer's kept activations (its blur attention's blocks
    of scores, 2 x 4 bytes x heads x the key rows a block reads, plus 96 bytes per model
    dimension) and the loss over the vocabulary (16 bytes per entry); scoring keeps no
    activations but takes SCORE_BATCH sequences at once and holds every held-out sequence
    (64 bytes per token)."""
    from fibctl.probe.blur import BLUR_BLOCK
    from fibctl.probe.trainer import SCORE_BATCH
    from fibctl.schedules import ALPHA_MIN, ALPHA_RANGE, FIB

    T, d, V, L = model.seq_len, model.d_model, model.vocab_size, model.n_layers
    kv = model.n_kv_heads * model.head_dim
    params = V * d + d + L * (2 * d + 1 + 2 * d * d + 2 * d * kv + 3 * d * model.ffn_hidden)
    # S: one past the farthest offset a band reaches, at the widest band and the largest alpha
    radius = math.ceil(2.5 * probe.width_start)
    far = max([round((ALPHA_MIN + ALPHA_RANGE) * b) + radius for b in FIB[:model.n_rungs] if b > model.window]
              + [model.window])
    keys = min(T, BLUR_BLOCK + min(T, far + 1))  # key rows one block of queries scores
    layer = 2 * 4 * model.n_heads * keys + 96 * d  # bytes per token
    fixed = 20 * params + GiB // 2  # the weights and their state, and the runtime
    train = fixed + batch_size * T * (L * layer + 16 * V)
    score = fixed + SCORE_BATCH * T * (layer + 16 * V) + 64 * probe.eval_sequences * T
    return train, score


def probe_runs(depths=DEPTHS, inits=PROBE_INITS, seeds=SEEDS, steps: int | None = None,
               distances: tuple[int, ...] | None = None, length: int | None = None, vocab: int | None = None,
               eval_sequences: int | None = None) -> list[RunConfig]:
    """The runs of the probe; None keeps the study's value. Raises ConfigError naming the first
    bad value, before anything is queued."""
    preset = get_preset("probe")
    # a value given twice (--depth 2 --depth 2) is one cell, not the same run queued twice
    depths, inits, seeds = (tuple(dict.fromkeys(values)) for values in (depths, inits, seeds))
    steps = preset.train.steps if steps is None else steps
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"--steps {steps} must be >= 1")
    for seed in seeds:
        check_seed(seed, "--seed")
    for init in inits:
        if init not in PROBE_INITS:
            raise ConfigError(f"--init {init!r}: allowed {', '.join(PROBE_INITS)}")
    for depth in depths:
        if not 1 <= depth <= PROBE_MAX_DEPTH:  # a deeper one would fill the machine's memory, then fail
            raise ConfigError(f"--depth {depth} must be from 1 to {PROBE_MAX_DEPTH} (the study's: 2, 4 and 8)")
    if eval_sequences is not None and not 1 <= eval_sequences <= PROBE_MAX_EVAL_SEQUENCES:
        raise ConfigError(f"--eval-sequences {eval_sequences} must be from 1 to {PROBE_MAX_EVAL_SEQUENCES:,}")
    for option, value, most in (("--length", length, PROBE_MAX_LENGTH), ("--vocab", vocab, PROBE_MAX_VOCAB)):
        if value is not None and value > most:  # refused here, not by the worker running out of memory
            raise ConfigError(f"{option} {value:,} is too large: a probe takes at most {most:,} (the study's: 512)")
    given = lambda value, default: default if value is None else value  # noqa: E731  (0 is a value)
    model = dataclasses.replace(preset.model, seq_len=given(length, preset.model.seq_len),
                                vocab_size=given(vocab, preset.model.vocab_size)).validate()
    task = ProbeConfig()
    task = dataclasses.replace(task, distances=tuple(distances or task.distances),
                               eval_sequences=given(eval_sequences, task.eval_sequences))
    study_task = (model.seq_len, model.vocab_size, task.distances) == (
        preset.model.seq_len, preset.model.vocab_size, ProbeConfig().distances)
    train = dataclasses.replace(preset.train, steps=steps).validate()
    for depth in sorted(depths, reverse=True)[:1]:  # the deepest needs the most
        need = probe_memory(dataclasses.replace(model, n_layers=depth), task, train.batch_size)
        if max(need) > PROBE_MAX_MEMORY:
            when = "training" if need[0] >= need[1] else f"scoring {task.eval_sequences:,} held-out sequences"
            raise ConfigError(
                f"a probe of depth {depth:,} at length {model.seq_len:,} and vocab {model.vocab_size:,} needs "
                f"about {max(need) / GiB:,.0f} GiB while {when}, more than the {PROBE_MAX_MEMORY // GiB} GiB a "
                "probe run may use: give a smaller --depth, --length, --vocab or --eval-sequences")
    runs = []
    for depth in depths:
        for init in inits:
            probe = dataclasses.replace(task, init=init).validate(model)
            for seed in seeds:
                name = f"probe_d{depth}_{init}_s{seed}"
                if steps != preset.train.steps:
                    name += f"_{steps}steps"
                if not study_task:  # another task: another name, so the study's runs stay as they are
                    name += "_" + short_hash({"length": model.seq_len, "vocab": model.vocab_size,
                                              "distances": list(task.distances)})[:8]
                runs.append(RunConfig(name=name, matrix=PROBE_MATRIX, preset="probe", init_seed=seed,
                                      data_seed=seed, model=dataclasses.replace(model, n_layers=depth).validate(),
                                      train=train, probe=probe))
    return runs
