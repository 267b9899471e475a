"""Measuring a model at any length: perplexity, per-position loss and inference speed.

Windows follow the study's protocol (docs/method.md, "Evaluation"): window j feeds the
`length` tokens x[jT : jT+T] and scores the `length` targets x[jT+1 : jT+T+1], windows at
stride T read in order from the start of a held-out stream, so consecutive windows share
one token (the last target of one is the first input of the next). Perplexity is
exp(mean loss) over those targets. The per-position loss (Table 4) keeps the first T-1
predicted positions of each window, as the study reports it (1023 positions of a 1024
window). The token budget is the same at every length (`tokens // length` windows), so
lengths are comparable, and the batch holds about `BATCH_TOKENS` tokens whatever the
length, so memory stays bounded: the model computes attention and the loss in chunks, and
dense attention goes through the fused (memory-linear) kernel. A length that still does
not fit is reported, not crashed on.

The training loop calls `stream_loss` for its own evaluations, so `fibctl eval` at the
training length reproduces the training-time one exactly. Nothing here knows of SQL: the
runner that reads runs and writes results is `fibctl.flows.evaluation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from fibctl.attention import default_impl
from fibctl.config import RunConfig
from fibctl.device import autocast, out_of_memory, synchronize
from fibctl.errors import FibctlError
from fibctl.model import FibLM

BATCH_TOKENS = 65_536  # tokens per forward pass at any length
# inference speed as the study timed it: batch 8, two untimed passes, the mean of five
SPEED_BATCH, SPEED_WARMUP, SPEED_TIMED = 8, 2, 5
T = TypeVar("T")


@dataclass
class StreamLoss:
    loss: float  # mean next-token cross-entropy, nats
    tokens: int  # predicted tokens the mean is over: windows * length
    windows: int
    position_losses: np.ndarray  # (length - 1,) mean loss at each of a window's first length - 1 positions
    position_windows: int  # the first windows position_losses averages over


def eval_windows(stream: np.ndarray, length: int, tokens: int) -> np.ndarray:
    """The first `tokens // length` windows at stride `length`, each `length + 1` tokens
    (inputs are [:-1], targets [1:]): (n, length + 1), a view of the stream."""
    if length < 2:
        raise FibctlError(f"evaluation length {length} is below 2: a window must predict a token")
    n = min(tokens // length, (len(stream) - 1) // length)
    if n < 1:
        raise FibctlError(f"no window of {length:,} tokens (and its next token) fits in a budget of "
                          f"{tokens:,} tokens from a stream of {len(stream):,}")
    return np.lib.stride_tricks.sliding_window_view(stream[: n * length + 1], length + 1)[::length]


def stream_loss(model: FibLM, stream: np.ndarray, length: int, tokens: int, device: torch.device,
                batch_tokens: int = BATCH_TOKENS, position_tokens: int | None = None) -> StreamLoss:
    """Loss of `model` on the stream's first windows of `length` tokens; the per-position
    loss over the first `position_tokens // length` of them (at least one), or all."""
    windows = eval_windows(stream, length, tokens)
    head = len(windows) if position_tokens is None else min(len(windows), max(1, position_tokens // length))

    def measure(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the first `head` windows summed apart, for the per-position loss
        head_sums = _position_sums(model, windows[:head], batch, device)
        return head_sums, head_sums + _position_sums(model, windows[head:], batch, device)

    _, (head_sums, sums) = _halved_until_it_fits(max(1, batch_tokens // length), measure, length, device, "window")
    loss = float((sums / len(windows)).mean())
    return StreamLoss(loss, len(windows) * length, len(windows), (head_sums / head)[:-1].numpy(), head)


def _position_sums(model: FibLM, windows: np.ndarray, batch: int, device: torch.device) -> torch.Tensor:
    """Loss summed over windows at each of the `length` predicted positions, float64."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    with torch.no_grad(), autocast(device):
        for s in range(0, len(windows), batch):
            chunk = torch.from_numpy(windows[s:s + batch].astype(np.int64)).to(device)
            sums += model.token_losses(chunk[:, :-1], chunk[:, 1:]).double().sum(0).cpu()
    model.train(was_training)
    return sums


def inference_speed(model: FibLM, length: int, device: torch.device) -> dict[str, float]:
    """The study's inference throughput: forward passes (logits, no loss) over a batch of
    SPEED_BATCH sequences of random tokens, SPEED_WARMUP untimed, then the mean of
    SPEED_TIMED; tokens/s is batch * length over that mean. A batch out of memory is halved
    (the batch measured is recorded beside the speed). The spread, which the study did not
    report, is the tokens/s of the slowest and of the fastest of the timed passes
    (`tokens_per_s_min`, `tokens_per_s_max`): a mean alone hid a pass slowed by another job."""
    was_training = model.training
    model.eval()

    def measure(batch: int) -> tuple[float, list[float]]:
        # the values do not matter to the time; a seeded draw keeps the inputs the same
        x = torch.randint(0, model.cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
        x = x.to(device)
        passes = _PassClock(device)
        with torch.no_grad(), autocast(device):
            for _ in range(SPEED_WARMUP):
                model(x)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(SPEED_TIMED):
                passes.mark()
                model(x)
            passes.mark()
            synchronize(device)
        return (time.perf_counter() - t0) / SPEED_TIMED, passes.seconds()

    try:
        batch, (latency, each) = _halved_until_it_fits(SPEED_BATCH, measure, length, device, "sequence")
    finally:
        model.train(was_training)
    tokens = batch * length
    return {"latency_s": latency, "tokens_per_s": tokens / latency, "batch": float(batch),
            "tokens_per_s_min": tokens / max(each), "tokens_per_s_max": tokens / min(each)}


class _PassClock:
    """The time of each timed pass, the passes still run back to back as the study ran them
    (its mean is over their wall time): on CUDA events in the stream, read once it is done,
    where the host's clock would read when a pass was queued; elsewhere the host's clock, a
    pass being over when its call returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each pass's seconds; after the device is synchronized."""
        pairs = list(zip(self.marks, self.marks[1:]))
        return [a.elapsed_time(b) / 1e3 for a, b in pairs] if self.cuda else [b - a for a, b in pairs]


def _halved_until_it_fits(batch: int, measure: Callable[[int], T], length: int, device: torch.device,
                          unit: str) -> tuple[int, T]:
    """`measure(batch)`, the batch halved each time the device runs out of memory: the batch
    that fitted and what it measured; one line where a single `unit` does not fit."""
    while True:
        try:
            return batch, measure(batch)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            if batch == 1:
                raise FibctlError(f"length {length:,} is out of reach on {device}: out of memory "
                                  f"with a single {unit}") from None
        # past the except block, whose traceback held the failed attempt's tensors: freed now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        batch //= 2


def load_model(config: RunConfig, state: dict, length: int, device: torch.device) -> FibLM:
    """The run's trained weights in a model built at `length`."""
    model = FibLM(config.model.with_length(length), default_impl(device))
    model.load_state_dict(state)
    return model.to(device)
