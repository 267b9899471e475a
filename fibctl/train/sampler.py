"""Training batches: random windows of T+1 tokens from the training stream.

The sampler owns a seeded generator, so its position in the random sequence is part of a
checkpoint and a resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import numpy as np
import torch

from fibctl.errors import FibctlError


def pinned_copy(device: torch.device | str) -> bool:
    """Whether batches go to `device` from pinned memory with non-blocking copies: CUDA only
    (pinning needs a CUDA driver, and a CPU "copy" is none)."""
    return torch.device(device).type == "cuda"


class WindowSampler:
    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        if len(stream) < seq_len + 2:
            raise FibctlError(f"training stream has {len(stream):,} tokens; training at length {seq_len:,} "
                              f"needs {seq_len + 2:,}")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        # A window is seq_len + 1 tokens. Starts run 0 .. len - seq_len - 2, as the study drew
        # them (numpy's randint(0, len - seq_len - 1)): the stream's last window is never read.
        self.n_starts = len(stream) - seq_len - 1

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len) int64."""
        starts = torch.randint(0, self.n_starts, (self.batch_size,), generator=self.generator).tolist()
        windows = np.stack([self.stream[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(windows)
        if pinned_copy(device):  # page-locked: the copy runs asynchronously with the GPU's work
            batch = batch.pin_memory().to(device, non_blocking=True)
        else:
            batch = batch.to(device)
        return batch[:, :-1], batch[:, 1:]

    def skip_batch(self) -> None:
        """Draw the next batch's positions without reading them: another rank trains on it."""
        torch.randint(0, self.n_starts, (self.batch_size,), generator=self.generator)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
