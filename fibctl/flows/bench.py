"""`fibctl bench attention`: time the attention core of each path against dense SDPA.

Ratios are against dense in the same run, medians over repeats after warm-up, fp32.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import pandas as pd
import torch

from fibctl.attention import dense_attention, sparse_attention
from fibctl.config import get_preset
from fibctl.model import Attention

PATHS = ("dense", "mask", "gather", "learned")


def _time(fn: Callable[[], None], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _core(path: str, T: int, window: int, base: str):
    """A closure computing one path's attention output for a layer of the paper preset."""
    cfg = get_preset("paper").model
    schedule = {"dense": "dense", "learned": "learned"}.get(path, "fixed")
    attn = Attention(dataclasses.replace(cfg, schedule=schedule, window=window, base=base), 0)
    if schedule == "learned":
        with torch.no_grad():
            attn.theta.fill_(0.3)  # alpha ~ 1.07: every rung fractional, the costly case
    impl = "mask" if path == "mask" else "gather"

    def run(q, k, v):
        if schedule == "dense":
            return dense_attention(q, k, v, impl)
        return sparse_attention(q, k, v, attn.columns(T), impl)

    return run, attn


def bench_attention(lengths: list[int], paths: tuple[str, ...] = PATHS, batch: int = 1, repeats: int = 5,
                    warmup: int = 2, window: int = 8, base: str = "fib",
                    progress: Callable[[str], None] | None = None) -> pd.DataFrame:
    cfg = get_preset("paper").model
    rows = []
    for T in lengths:
        g = torch.Generator().manual_seed(T)
        shape = lambda h: (batch, h, T, cfg.head_dim)
        q0 = torch.randn(shape(cfg.n_heads), generator=g)
        k0, v0 = torch.randn(shape(cfg.n_kv_heads), generator=g), torch.randn(shape(cfg.n_kv_heads), generator=g)
        grad_out = torch.randn(shape(cfg.n_heads), generator=g)
        for path in paths:
            if progress:
                progress(f"T={T} {path}")
            run, attn = _core(path, T, window, base)
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))

            def forward():
                with torch.no_grad():
                    run(q0, k0, v0)

            def forward_backward():
                run(q, k, v).backward(grad_out)

            rows.append({
                "length": T, "path": path,
                "forward_ms": 1e3 * _time(forward, repeats, warmup),
                "fwd_bwd_ms": 1e3 * _time(forward_backward, repeats, warmup),
            })
    df = pd.DataFrame(rows)
    dense = df[df.path == "dense"].set_index("length")
    if not dense.empty:
        df["forward_vs_dense"] = df.forward_ms / df.length.map(dense.forward_ms)
        df["fwd_bwd_vs_dense"] = df.fwd_bwd_ms / df.length.map(dense.fwd_bwd_ms)
    return df
