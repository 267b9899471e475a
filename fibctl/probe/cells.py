"""The probe's matrix: one run per depth x init x seed (docs/method.md, "Table 2: the
mechanism probe"), each a `RunConfig` of the `probe` preset with its `ProbeConfig`."""

from __future__ import annotations

import dataclasses

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
