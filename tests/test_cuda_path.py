"""The CUDA fast path's decisions (fused AdamW, pinned non-blocking batch copies), decided by
small functions that the CPU tests cover; the CUDA tests run where there is a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fibctl.config import get_preset
from fibctl.model import FibLM
from fibctl.train.optim import adamw_kwargs, build_optimizer
from fibctl.train.sampler import WindowSampler, pinned_copy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_fused_adamw_and_pinned_copies_are_for_cuda_only():
    assert adamw_kwargs(torch.device("cpu")) == {}
    assert adamw_kwargs(torch.device("cuda", 0)) == {"fused": True}  # torch >= 2.0 has it; a decision, no GPU
    assert pinned_copy("cuda:1") and pinned_copy(torch.device("cuda"))
    assert not pinned_copy("cpu") and not pinned_copy(torch.device("cpu"))


def test_the_cpu_optimizer_is_plain_adamw_and_batches_are_unpinned():
    model = FibLM(get_preset("micro").model)
    built = build_optimizer(model, get_preset("micro").train, torch.device("cpu"))
    assert (built.name, built.fused) == ("adamw", False)
    assert not built.optimizer.defaults.get("fused")
    x, y = WindowSampler(np.arange(1000, dtype=np.uint16), 16, 2, seed=0).next_batch("cpu")
    assert not x.is_pinned() and torch.equal(x[:, 1:], y[:, :-1])


@needs_cuda
def test_on_cuda_adamw_is_fused_and_batches_arrive_equal_to_the_cpu_ones():
    model = FibLM(get_preset("micro").model).cuda()
    built = build_optimizer(model, get_preset("micro").train, torch.device("cuda"))
    assert built.fused and built.optimizer.defaults["fused"] is True
    stream = np.arange(5000, dtype=np.uint16) % get_preset("micro").model.vocab_size  # token ids, not past the vocab
    x, y = WindowSampler(stream, 32, 4, seed=3).next_batch("cuda")
    cx, cy = WindowSampler(stream, 32, 4, seed=3).next_batch("cpu")
    assert x.is_cuda and torch.equal(x.cpu(), cx) and torch.equal(y.cpu(), cy)
    model.train()
    loss = model(x, y)
    loss.backward()
    built.optimizer.step()  # the fused kernel runs
    assert all(torch.isfinite(p).all() for p in model.parameters())
