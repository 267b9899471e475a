"""Shared by the training, evaluation and worker tests: a tiny prepared data directory, a
database with queued `micro` runs, a silent display and a reporter that keeps nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fibctl.config import RunConfig
from fibctl.data.streams import DataManifest, load_manifest
from fibctl.db.engine import connect
from fibctl.hashes import file_hash
from fibctl.queue import add_runs
from fibctl.train.trainer import Trainer

HELDOUT = ("stories_val", "math_val")


def write_data(data_dir: Path, vocab: int = 512, train_tokens: int = 40_000, heldout_tokens: int = 8_192,
               *, hashed: bool = False) -> Path:
    """Token streams with learnable structure (a noisy affine chain), in the data layout; with
    `hashed`, the manifest records its streams' hashes, as `fibctl data prepare` does."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = {}
    for split, n in [("train", train_tokens)] + [(h, heldout_tokens) for h in HELDOUT]:
        x = np.empty(n, dtype=np.int64)
        x[0] = 1
        noise = rng.integers(0, 4, n)
        for i in range(1, n):
            x[i] = (5 * x[i - 1] + 3 + noise[i]) % vocab
        x.astype(np.uint16).tofile(data_dir / f"{split}.bin")
        tokens[split] = n
    (data_dir / "tokenizer.json").write_text("{}")  # a stand-in: training reads only the streams
    DataManifest(data_dir=data_dir, recipe="test", recipe_hash="0" * 16, inputs_hash="0" * 16,
                 vocab_size=vocab, tokenizer_vocab=vocab, tokenizer_hash="0" * 16, eos_id=0,
                 heldout=list(HELDOUT), tokens=tokens,
                 stream_hashes={s: file_hash(data_dir / f"{s}.bin") for s in tokens} if hashed else {}).write()
    return data_dir


def micro_run(name: str, schedule: str = "fixed", **train) -> RunConfig:
    return RunConfig.resolve(name, "test", "micro", schedule=schedule, window=4, seed=42, **train)


def queued_db(path: Path, *configs: RunConfig):
    engine = connect(str(path))
    add_runs(engine, list(configs))
    return engine


class Quiet:
    """A display that shows nothing and remembers outcomes."""

    def __init__(self, on_step=None):
        self.on_step, self.outcomes, self.notes, self.warnings = on_step, [], [], []

    def start(self, name, steps):
        return self.on_step or (lambda p: None)

    def warn(self, message):
        self.warnings.append(message)

    def note(self, message):
        self.notes.append(message)

    def finish(self, outcome):
        self.outcomes.append(outcome)


class NullReporter:
    """A reporter that takes every call and keeps nothing (heartbeats say: still ours)."""

    def __getattr__(self, name):
        return lambda *a, **k: True


GENERATED_RECIPE = """
name = "gen"
vocab_size = 300
train_tokens = {train_tokens}
heldout_tokens = 2000
tokenizer_sample_chars = 20000

[[sources]]
name = "stories"
kind = "generated"
documents = 600
share = 1
heldout = "stories_val"
heldout_fraction = 0.1
"""


def generated_recipe(path: Path, train_tokens: int = 3000) -> Path:
    """A small offline recipe (the `generated` source, one held-out set), written to `path`."""
    path.write_text(GENERATED_RECIPE.format(train_tokens=train_tokens))
    return path


class Losses:
    """A reporter that keeps each step's loss."""

    def __init__(self):
        self.losses = {}

    def log_step(self, step, loss, *rest):
        self.losses[step] = loss

    def __getattr__(self, name):
        return lambda *a, **k: True


def one_process(config: RunConfig, data: Path, run_dir: Path) -> tuple[dict, dict]:
    """The run trained by one process (the reference of a DDP group's): its weights and losses."""
    reporter = Losses()
    trainer = Trainer(config, load_manifest(data), run_dir, reporter)
    assert trainer.run().status == "done"
    return trainer.model.state_dict(), reporter.losses


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, float((a[k] - b[k]).abs().max()))
