"""Typed, frozen configuration: model shape, attention settings, training recipe, presets.

A run is fully described by a `RunConfig`; its `config_hash` identifies it in the database.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from fibctl.errors import FibctlError

SCHEDULES = ("dense", "fixed", "learned", "stagger", "coprime")
BASES = ("fib", "pow2")
ATTENTION_IMPLS = ("gather", "mask", "reference")


class ConfigError(FibctlError, ValueError):
    """A configuration value is out of range; the message names the value and the allowed ones."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only transformer (SPEC section 3) and its attention settings."""

    vocab_size: int = 32768
    d_model: int = 512
    n_layers: int = 16
    n_heads: int = 8
    n_kv_heads: int = 2
    seq_len: int = 1024  # training length; the model can be rebuilt at any other length
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # attention (SPEC sections 1-2)
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
            raise ConfigError(f"unknown schedule {self.schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if self.base not in BASES:
            raise ConfigError(f"unknown base {self.base!r}; allowed: {', '.join(BASES)}")
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

    def with_length(self, seq_len: int) -> "ModelConfig":
        return dataclasses.replace(self, seq_len=seq_len)


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe (SPEC section 4). Tokens per step = batch_size * grad_accum * seq_len."""

    steps: int = 13000
    batch_size: int = 8
    grad_accum: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    log_interval: int = 10
    eval_interval: int = 500
    eval_tokens: int = 262_144  # light evaluation during training
    final_eval_tokens: int = 1_048_576  # at checkpoints and the final step
    checkpoint_interval: int = 1000
    keep_checkpoints: int = 3


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelConfig
    train: TrainConfig


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "paper",
            "The study's model and recipe: d 512, 16 layers, 8/2 heads, T 1024, 13,000 x 32,768 tokens",
            ModelConfig(),
            TrainConfig(),
        ),
        Preset(
            "tiny",
            "CPU demo model: d 192, 4 layers, 6/2 heads, T 128, vocab 4,096, 1,400 x 2,048 tokens",
            ModelConfig(vocab_size=4096, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, seq_len=128),
            # 1,400 steps: dense gains on the sparse models at the training length as training
            # goes on (measured gap +5 % at 600 steps, +0.7 % at 1,000); the demo's budget ends here
            TrainConfig(
                steps=1400, batch_size=16, grad_accum=1, lr=3e-3, warmup_steps=30, log_interval=10,
                eval_interval=200, eval_tokens=32_768, final_eval_tokens=131_072,
                checkpoint_interval=500, keep_checkpoints=2,
            ),
        ),
        Preset(
            "micro",
            "Test model: d 64, 2 layers, 4/2 heads, T 64, vocab 512, 30 x 512 tokens",
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
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class RunConfig:
    """One run of a matrix: preset + training recipe + attention settings + seed, resolved."""

    name: str
    matrix: str
    preset: str
    seed: int
    model: ModelConfig
    train: TrainConfig
    # free-form labels that do not change what is trained (e.g. the study's run id "f13")
    tags: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def resolve(cls, name: str, matrix: str, preset: str, *, schedule: str, base: str = "fib",
                window: int = 8, seed: int = 42, tags: dict | None = None, **overrides) -> "RunConfig":
        p = get_preset(preset)
        model = dataclasses.replace(p.model, schedule=schedule, base=base, window=window).validate()
        train = dataclasses.replace(p.train, **overrides) if overrides else p.train
        return cls(name=name, matrix=matrix, preset=preset, seed=seed, model=model, train=train,
                   tags=dict(tags or {}))

    def to_dict(self) -> dict:
        return {
            "name": self.name, "matrix": self.matrix, "preset": self.preset, "seed": self.seed,
            "model": dataclasses.asdict(self.model), "train": dataclasses.asdict(self.train),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        return cls(name=d["name"], matrix=d["matrix"], preset=d["preset"], seed=d["seed"],
                   model=ModelConfig(**d["model"]), train=TrainConfig(**d["train"]))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def config_hash(self) -> str:
        """Hash of what is trained: everything but the run's name and matrix."""
        d = self.to_dict()
        del d["name"], d["matrix"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def diff(self, other: "RunConfig") -> list[str]:
        """Dotted names of the fields that differ, for error messages."""
        a, b = _flatten(self.to_dict()), _flatten(other.to_dict())
        return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
