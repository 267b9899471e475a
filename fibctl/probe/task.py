"""The marked shift-copy task (docs/method.md, "Table 2: the mechanism probe").

Each position t carries a payload p_t, uniform over vocab / n values, and a marker c_t,
uniform over the n distances; its token is x_t = p_t + (vocab / n) * c_t. The target at t is
the token D[c_t] positions back, x_{t - D[c_t]}, ignored (-100) where t < D[c_t]. A model
scores well only by attending to exactly the distance each marker names.
"""

from __future__ import annotations

import torch

from fibctl.config import ProbeConfig
from fibctl.hashes import short_hash
from fibctl.probe.cells import task_label

IGNORE = -100  # cross_entropy's ignore_index
# held-out sequences come from a generator no training batch uses: seeded with the run's data
# seed XOR this. torch's CPU generator reads only a seed's low 32 bits, so an offset of 2**32
# replayed the training batches' stream (8 of 16 scored payload rows were steps 1-4's).
HELDOUT_SEED_XOR = 0x5EEDCAFE


def heldout_generator(data_seed: int) -> torch.Generator:
    """The generator of a probe run's held-out (scoring) sequences."""
    return torch.Generator().manual_seed(data_seed ^ HELDOUT_SEED_XOR)


class MarkedCopy:
    def __init__(self, vocab_size: int, seq_len: int, distances: tuple[int, ...]):
        self.vocab_size, self.seq_len, self.distances = vocab_size, seq_len, tuple(distances)
        self.payloads = vocab_size // len(self.distances)

    @classmethod
    def of(cls, model, probe: ProbeConfig) -> "MarkedCopy":
        return cls(model.vocab_size, model.seq_len, probe.distances)

    @property
    def label(self) -> str:
        return task_label(self.seq_len, self.vocab_size, self.distances)

    @property
    def hash(self) -> str:
        """Identifies the task's data the way a manifest's hash identifies a corpus."""
        return short_hash({"task": "marked_copy", "vocab": self.vocab_size, "length": self.seq_len,
                           "distances": list(self.distances)})

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n sequences: inputs and targets, each (n, T) int64."""
        T = self.seq_len
        payload = torch.randint(0, self.payloads, (n, T), generator=generator)
        marker = torch.randint(0, len(self.distances), (n, T), generator=generator)
        x = payload + self.payloads * marker
        shift = torch.tensor(self.distances)[marker]  # (n, T): each position's distance
        t = torch.arange(T)
        y = x.gather(1, (t - shift).clamp_min(0))
        return x, y.masked_fill(t < shift, IGNORE)

    def marker(self, x: torch.Tensor) -> torch.Tensor:
        """Which distance each position's target is copied from (index into `distances`)."""
        return x // self.payloads


class MarkedBatches:
    """Fresh training batches from a seeded generator; its state is part of a checkpoint (the
    interface of fibctl.train.sampler.WindowSampler)."""

    kind = None  # draws no windows from a stream: runs.sampler stays NULL for a probe run

    def __init__(self, task: MarkedCopy, batch_size: int, seed: int):
        self.task, self.batch_size = task, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.task.sample(self.batch_size, self.generator)
        return x.to(device), y.to(device)

    def skip_batch(self) -> None:
        self.task.sample(self.batch_size, self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
