"""Typed, frozen configuration: model shape, attention settings, training recipe, presets.

A run is fully described by a `RunConfig`; its `config_hash` identifies it in the database.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from fibctl.errors import FibctlError, unknown
from fibctl.hashes import short_hash

SCHEDULES = ("dense", "fixed", "learned", "stagger", "coprime")
BASES = ("fib", "pow2")
ATTENTION_IMPLS = ("gather", "mask", "reference", "flex", "auto")
# adamw: torch.optim.AdamW, full-precision state; adamw8bit: bitsandbytes' 8-bit AdamW (CUDA
# only), what the study trained its published runs with
OPTIMIZERS = ("adamw", "adamw8bit")
# what drew a run's training windows (runs.sampler): numpy's legacy generator, as the study
# drew them, or torch's, which fibctl's sampler drew from before 2026-12-06 and a run resumed
# from a checkpoint of then keeps (fibctl/train/sampler.py): same seed, other windows
SAMPLERS = {"numpy": "numpy's generator, as the study drew them",
            "torch": "torch's generator, as fibctl drew them before 2026-12-06"}
SEED_MAX = 2**32 - 1  # numpy's global generator, seeded with every run's seeds, takes no more
DEFAULT_SEED = 42  # a matrix run's seed when it names none; the seed the reports show by default
# the database stores step and token counts in Integer columns: 32-bit on PostgreSQL
INT32_MAX = 2**31 - 1
# `model`, `coverage` and the coverage figure list every layer's attended distances (a dense
# layer's, and a window's, reach T): bounded so that a mistyped length is one line, not gigabytes
MAX_LENGTH = 2**20
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the model's parameters are float32: a larger lr overflows them
FLOAT32_ZERO = 2**-150  # half the smallest positive float32: float32 rounds this and less to 0


class ConfigError(FibctlError, ValueError):
    """A configuration value is out of range; the message names the value and the allowed ones."""


def check_length(length: int, flag: str = "--length") -> int:
    """A length that lists every layer's distances, within MAX_LENGTH."""
    if not 2 <= length <= MAX_LENGTH:
        raise ConfigError(f"{flag} {length:,} must be from 2 to {MAX_LENGTH:,}")
    return length


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only transformer (docs/method.md, "The model") and its attention settings."""

    vocab_size: int = 32768
    d_model: int = 512
    n_layers: int = 16
    n_heads: int = 8
    n_kv_heads: int = 2
    seq_len: int = 1024  # training length; the model can be rebuilt at any other length
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # attention (docs/method.md, "The attended set" and "Schedules")
    schedule: str = "fixed"
    base: str = "fib"
    window: int = 8
    n_rungs: int = 15  # K: rungs of the fib base; pow2 derives its rungs from the length

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        h = int(self.d_model * 8 / 3)
        return h + (h % 2)  # rounded up to even

    def validate(self) -> "ModelConfig":
        if self.schedule not in SCHEDULES:
            raise ConfigError(unknown("schedule", self.schedule, SCHEDULES))
        if self.base not in BASES:
            raise ConfigError(unknown("base", self.base, BASES))
        if self.window < 0:
            raise ConfigError(f"window W={self.window} must be >= 0")
        if self.n_rungs < 1:
            raise ConfigError(f"n_rungs K={self.n_rungs} must be >= 1")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.n_heads:
            raise ConfigError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        return self

    def check_window(self) -> "ModelConfig":
        """Refuse a sparse window that reaches the training length. Distances reach T - 1 at
        most: a window that reaches it attends to every one, and the model would train as dense
        attention under a sparse schedule's name. Evaluation at other lengths caps the window
        instead (with_length), so this holds at the training length only."""
        if self.schedule != "dense" and self.window >= self.seq_len - 1:
            raise ConfigError(f"window W={self.window} is too large: at most T - 2 = {self.seq_len - 2} at "
                              f"the training length T={self.seq_len}; a window of T - 1 is dense attention")
        return self

    def with_length(self, seq_len: int) -> "ModelConfig":
        return dataclasses.replace(self, seq_len=seq_len)


# left out of a run's config while unset, so that configs written before them keep their hashes
OPTIONAL_TRAIN_FIELDS = ("full_eval_interval", "position_tokens")


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe (docs/method.md, "Training"). Tokens per step = batch_size * grad_accum * seq_len."""

    steps: int = 13000
    # the study's split: 8 x 4 accumulation x 1024 = 32,768 tokens; its learned runs used
    # 4 x 8, which the `paper` matrix sets for them (the same gradient, other rounding)
    batch_size: int = 8
    grad_accum: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0: no clipping
    log_interval: int = 10
    eval_interval: int = 500
    eval_tokens: int = 262_144  # light evaluation during training
    final_eval_tokens: int = 1_048_576  # full evaluations: every full_eval_interval steps and the last
    checkpoint_interval: int = 1000
    # None: a full evaluation at every checkpoint. The study's came with its checkpoints, every
    # 2,500 steps; `paper` keeps that cadence while checkpointing more often.
    full_eval_interval: int | None = None
    # tokens whose windows the last step's per-position loss (Table 4) averages over, at most
    # the full evaluation's; None: all of them
    position_tokens: int | None = None
    keep_checkpoints: int = 3
    optimizer: str = "adamw"  # one of OPTIMIZERS; the worker records the one it actually used

    @property
    def clip_bound(self) -> float:
        """The gradient-norm bound: grad_clip, or with 0 (no clipping) an infinite one, with which
        train.optim.clip_gradients only measures the norm."""
        return self.grad_clip or math.inf

    def validate(self) -> "TrainConfig":
        """Raise ConfigError naming the first field that is the wrong type or out of range."""
        at_least_one = ("steps", "batch_size", "grad_accum", "log_interval", "eval_interval", "eval_tokens",
                        "final_eval_tokens", "checkpoint_interval", "keep_checkpoints", *OPTIONAL_TRAIN_FIELDS)
        for name in (*at_least_one, "warmup_steps"):
            value = getattr(self, name)
            if value is None and name in OPTIONAL_TRAIN_FIELDS:  # unset
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"train.{name} = {value!r} must be an integer")
            if value < (1 if name in at_least_one else 0):
                raise ConfigError(f"train.{name} = {value} must be >= {1 if name in at_least_one else 0}")
            if value > INT32_MAX:
                raise ConfigError(f"train.{name} = {value} is too large: at most 2**31 - 1, "
                                  "the database's 32-bit INTEGER")
        # grad_clip 0: no clipping (the probe's recipe, torch's AdamW defaults)
        ranges = {"lr": (0, math.inf, False), "min_lr_ratio": (0, 1, True), "weight_decay": (0, math.inf, True),
                  "beta1": (0, 1, True), "beta2": (0, 1, True), "grad_clip": (0, math.inf, True)}
        for name, (low, high, low_ok) in ranges.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"train.{name} = {value!r} must be a finite number")
            if value < low or (value == low and not low_ok) or value > high or (name.startswith("beta") and value == 1):
                raise ConfigError(f"train.{name} = {value} is out of range")
            if value > FLOAT32_MAX:
                raise ConfigError(f"train.{name} = {value} is too large: the model trains in float32, "
                                  f"at most {FLOAT32_MAX:.7g}")
            if 0 < value <= FLOAT32_ZERO:
                raise ConfigError(f"train.{name} = {value} is too small: it is 0 in float32, "
                                  "which the model trains in")
        if not isinstance(self.optimizer, str):
            raise ConfigError(f"train.optimizer = {self.optimizer!r} must be a string")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(unknown("optimizer", self.optimizer, OPTIMIZERS))
        return self


PROBE_INITS = ("uniform", "staggered")


@dataclass(frozen=True)
class ProbeConfig:
    """The mechanism probe's task and schedule (docs/method.md, "Table 2: the mechanism probe").

    A probe run trains the `probe` preset's model on the marked shift-copy task instead of
    text: each position's marker chooses which of `distances` its target is copied from.
    """

    distances: tuple[int, ...] = (200, 350)
    init: str = "uniform"  # uniform: alpha 1 in every layer; staggered: the ramp, clamped
    width_start: float = 40.0  # the blur band's width w anneals linearly from here ...
    width_end: float = 0.5  # ... to here over the first `anneal_fraction` of the steps,
    anneal_fraction: float = 0.8
    width_floor: float = 0.25  # the narrowest end width accepted (validate)
    eval_sequences: int = 16  # held-out sequences scored at the end (the study scored 2)

    def validate(self, model: "ModelConfig") -> "ProbeConfig":
        if self.init not in PROBE_INITS:
            raise ConfigError(unknown("probe init", self.init, PROBE_INITS))
        if not self.distances or len(set(self.distances)) != len(self.distances):
            raise ConfigError(f"probe distances {list(self.distances)} must be distinct and at least one")
        for d in self.distances:
            if not isinstance(d, int) or not 1 <= d < model.seq_len:
                raise ConfigError(f"probe distance {d} must be from 1 to the length - 1 ({model.seq_len - 1})")
        if model.vocab_size % len(self.distances):
            raise ConfigError(f"vocab {model.vocab_size} is not divisible by the {len(self.distances)} distances "
                              "(each distance's marker takes an equal share of the vocabulary)")
        if model.schedule != "learned":
            raise ConfigError(f"a probe model learns its alphas: schedule must be learned, not {model.schedule}")
        if not 0 < self.width_floor <= self.width_end <= self.width_start or not 0 < self.anneal_fraction <= 1:
            raise ConfigError("probe widths must satisfy 0 < floor <= end <= start and 0 < anneal_fraction <= 1")
        if not isinstance(self.eval_sequences, int) or self.eval_sequences < 1:
            raise ConfigError(f"probe eval_sequences = {self.eval_sequences!r} must be an integer >= 1")
        return self

    def width_at(self, done: int, steps: int) -> float:
        """The band width w of the step that follows `done` finished steps of `steps` (as in
        the study's probe, the first step trains at width_start)."""
        progress = min(1.0, done / max(1.0, self.anneal_fraction * steps))
        # the study's blend, operation for operation: start + (end - start) p differs in the last
        # bit at about 2 in 5 steps, and there ceil(2.5 w), the band's radius, can move by one
        blend = self.width_start * (1 - progress) + self.width_end * progress
        return max(self.width_floor, blend)


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    train: TrainConfig


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "paper",
            ModelConfig(),
            # the study's evaluation cadence and Table 4 budget: full evaluations with its
            # checkpoints (every 2,500 steps), per-position loss over 488 windows of 1,024
            TrainConfig(optimizer="adamw8bit", full_eval_interval=2500, position_tokens=500_000),
        ),
        Preset(
            "tiny",
            ModelConfig(vocab_size=4096, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, seq_len=128),
            # long enough for the paper's length effect: dense's perplexity climbs past the
            # training length while the sparse models' stays (README; docs/benchmarks.md,
            # "fibctl demo"). Which leads at the training length, a ~1 % margin, it does not settle
            TrainConfig(
                steps=1400, batch_size=16, grad_accum=1, lr=3e-3, warmup_steps=30, log_interval=10,
                eval_interval=200, eval_tokens=32_768, final_eval_tokens=131_072,
                checkpoint_interval=500, keep_checkpoints=2,
            ),
        ),
        Preset(
            # the mechanism probe's model (Table 2); its depth varies per probe run (2, 4 or 8)
            "probe",
            ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=512,
                        schedule="learned", base="fib", window=8),
            # the study's probe code (docs/method.md): AdamW at lr 1e-3, batch 2, 2,500 steps,
            # a constant lr, torch's AdamW defaults otherwise (betas 0.9/0.999,
            # weight decay 0.01 on every parameter), no clipping; alphas every 100 steps
            TrainConfig(steps=2500, batch_size=2, grad_accum=1, lr=1e-3, min_lr_ratio=1.0, warmup_steps=0,
                        beta2=0.999, weight_decay=0.01, grad_clip=0.0, log_interval=10, eval_interval=100,
                        checkpoint_interval=500, keep_checkpoints=2),
        ),
        Preset(
            "micro",
            ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64),
            TrainConfig(
                steps=30, batch_size=4, grad_accum=2, lr=3e-3, warmup_steps=5, log_interval=5,
                eval_interval=10, eval_tokens=2_048, final_eval_tokens=4_096,
                checkpoint_interval=10, keep_checkpoints=2,
            ),
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(unknown("preset", name, PRESETS)) from None


def check_seed(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= SEED_MAX:
        raise ConfigError(f"{what} = {value!r} must be an integer from 0 to 2**32 - 1")
    return value


@dataclass(frozen=True)
class RunConfig:
    """One run of a matrix: preset + training recipe + attention settings + seeds, resolved.

    Two seeds, as the study separated them: `init_seed` draws the initial weights and
    `data_seed` (the run's seed as the study names its replicates, 42/43/44) everything after,
    the training batches included. The study built its model before seeding the run, so its
    initial weights came from the generator's earlier state (docs/method.md, "Training"); the
    `paper` matrix keeps `init_seed` fixed, so its replicates differ in their data order alone.
    """

    name: str
    matrix: str
    preset: str
    init_seed: int
    data_seed: int
    model: ModelConfig
    train: TrainConfig
    probe: ProbeConfig | None = None  # set for a mechanism-probe run (fibctl probe)

    @property
    def seed(self) -> int:
        """The replicate seed the tables group by: the data seed."""
        return self.data_seed

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.train.grad_accum * self.model.seq_len

    @classmethod
    def resolve(cls, name: str, matrix: str, preset: str, *, schedule: str, base: str = "fib",
                window: int = 8, seed: int = DEFAULT_SEED, init_seed: int | None = None, **overrides) -> "RunConfig":
        """`seed` is the data seed; `init_seed` defaults to it."""
        p = get_preset(preset)
        model = dataclasses.replace(p.model, schedule=schedule, base=base, window=window).validate().check_window()
        try:
            train = dataclasses.replace(p.train, **overrides) if overrides else p.train
        except TypeError as e:
            raise ConfigError(f"unknown training setting: {e}") from None
        data_seed = check_seed(seed, "seed")  # first: init_seed defaults to it
        train.validate()
        for budget in ("eval_tokens", "final_eval_tokens", "position_tokens"):
            value = getattr(train, budget)
            if value is not None and value < model.seq_len:  # refused now, not at its first evaluation
                raise ConfigError(f"train.{budget} = {value} is below one window of {model.seq_len} tokens")
        tokens = train.steps * train.batch_size * train.grad_accum * model.seq_len
        if tokens > INT64_MAX:  # refused now, not when the finished run records it
            raise ConfigError(f"train.steps x batch_size x grad_accum x T = {tokens:,} tokens is too large: "
                              "at most 2**63 - 1, the database's 64-bit runs.tokens_trained")
        return cls(name=name, matrix=matrix, preset=preset, init_seed=check_seed(
                       seed if init_seed is None else init_seed, "init_seed"),
                   data_seed=data_seed, model=model, train=train)

    def to_dict(self) -> dict:
        d = {
            "name": self.name, "matrix": self.matrix, "preset": self.preset,
            "init_seed": self.init_seed, "data_seed": self.data_seed,
            "model": dataclasses.asdict(self.model), "train": {
                k: v for k, v in dataclasses.asdict(self.train).items()
                if not (v is None and k in OPTIONAL_TRAIN_FIELDS)},
        }
        if self.probe is not None:  # absent otherwise: the config hashes of LM runs stay as they were
            d["probe"] = {**dataclasses.asdict(self.probe), "distances": list(self.probe.distances)}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        # configs written before the seeds were separated have one `seed` for both
        data_seed = d["data_seed"] if "data_seed" in d else d["seed"]
        return cls(name=d["name"], matrix=d["matrix"], preset=d["preset"],
                   init_seed=d.get("init_seed", data_seed), data_seed=data_seed,
                   model=ModelConfig(**d["model"]), train=TrainConfig(**d["train"]),
                   probe=ProbeConfig(**{**d["probe"], "distances": tuple(d["probe"]["distances"])})
                   if d.get("probe") else None)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def config_hash(self) -> str:
        """Hash of what is trained: everything but the run's name and matrix."""
        d = self.to_dict()
        del d["name"], d["matrix"]
        return short_hash(d)

    def diff(self, other: "RunConfig") -> list[str]:
        """Dotted names of the fields that differ, for error messages."""
        return sorted(differing([flatten(self.to_dict()), flatten(other.to_dict())]))


def differing(flat: list[dict]) -> set[str]:
    """The dotted keys whose values are not the same in every one of these flattened configs
    (a key one lacks counts as None there)."""
    keys = set().union(*flat)
    return {k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1}


def flatten(d: dict, prefix: str = "") -> dict:
    """A config's dict as one level of dotted keys (`model.schedule`, `train.lr`)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
