"""Training batches: random windows of T+1 tokens from the training stream.

The sampler owns a seeded generator, so its position in the random sequence is part of a
checkpoint and a resumed run draws exactly the batches an uninterrupted one would. It is
numpy's legacy generator (RandomState), drawn as the study drew its starts (docs/method.md,
"Training"): the same seed on a stream of the same length gives the study's window starts.
"""

from __future__ import annotations

import numpy as np
import torch

from fibctl.errors import FibctlError
from fibctl.train.checkpoint import numpy_state, numpy_state_dict


def pinned_copy(device: torch.device | str) -> bool:
    """Whether batches go to `device` from pinned memory with non-blocking copies: CUDA only
    (pinning needs a CUDA driver, and a CPU "copy" is none)."""
    return torch.device(device).type == "cuda"


def batch_to(batch: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of T+1 tokens (B, T+1), on `device` as inputs and next-token targets, each
    (B, T): training's copy, which `fibctl bench train` times too."""
    if pinned_copy(device):  # page-locked: the copy runs asynchronously with the GPU's work
        batch = batch.pin_memory().to(device, non_blocking=True)
    else:
        batch = batch.to(device)
    return batch[:, :-1], batch[:, 1:]


class WindowSampler:
    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(stream) < seq_len + 2:
            raise FibctlError(f"training stream has {len(stream):,} tokens; training at length {seq_len:,} "
                              f"needs {seq_len + 2:,}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        # the study seeded numpy's global generator with the run's seed and put its state back
        # after every evaluation: a generator of the sampler's own draws the same numbers
        self.generator = np.random.RandomState(seed)
        # a run whose checkpoints hold torch's generator (an earlier fibctl's sampler drew from
        # it) keeps drawing from it when resumed: one run, one order, to the end
        self.torch_generator: torch.Generator | None = None
        # A window is seq_len + 1 tokens. Starts run 0 .. len - seq_len - 2, as the study drew
        # them (numpy's randint(0, len - seq_len - 1)): the stream's last window is never read.
        self.n_starts = len(stream) - seq_len - 1

    @property
    def kind(self) -> str:
        """What draws the windows, as runs.sampler records it (fibctl.config.SAMPLERS)."""
        return "numpy" if self.torch_generator is None else "torch"

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len) int64."""
        starts = self._starts()
        windows = np.stack([self.stream[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return batch_to(torch.from_numpy(windows), device)

    def _starts(self) -> list[int]:
        """The next batch's window starts: one call of batch_size draws per micro-batch, as the
        study made them (so 8 windows drawn as 2 x 4 are the 8 drawn at once)."""
        if self.torch_generator is not None:
            return torch.randint(0, self.n_starts, (self.batch_size,), generator=self.torch_generator).tolist()
        return self.generator.randint(0, self.n_starts, size=self.batch_size).tolist()

    def skip_batch(self) -> None:
        """Draw the next batch's positions without reading them: another rank trains on it."""
        self._starts()

    def state_dict(self) -> dict:
        if self.torch_generator is not None:
            return {"generator": self.torch_generator.get_state()}
        return {"numpy": numpy_state_dict(self.generator.get_state())}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:  # written by the sampler that drew from torch's generator
            self.torch_generator = torch.Generator()
            self.torch_generator.set_state(state["generator"])
        else:
            self.torch_generator = None
            self.generator.set_state(numpy_state(state["numpy"]))
