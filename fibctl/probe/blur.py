"""Blur-rung attention: how a probe layer attends while it learns alpha (docs/method.md,
"Table 2: the mechanism probe").

The window 0..W is attended exactly. Each kept rung k (fibctl.schedules.blur_rungs) is one
column whose key and value are a Gaussian-weighted mix of the rows around its centre
d_k = alpha * b_k: offsets j = c-R..c+R with c = round(d_k) and R = ceil(2.5 w), clamped to
[1, T-1], weights exp(-((j - d_k) / w)^2 / 2) normalised to sum 1 (alpha's gradient flows
through them), key row i - j clamped at row 0; the column is valid for queries i >= c.

Implementations (`impl`):
- `reference`: a loop over the columns that gathers each rung's band of rows,
  (B, H, T, 2R+1, D), and mixes it, as the method states it. Slow and obviously correct.
- `fast`: the band mix is linear, so a rung's logit is the band-weighted sum of the plain
  scores q_i . k_{i-j}, and its output the band-weighted sum of value rows. Plain scores
  read by offset, and a (C, S) table of each column's weight at each offset 0..S-1, give
  every column's logits; the softmax goes back through the same table to one weight per key
  row. S (`reach`) is one past the farthest offset any column takes, max(c) + R + 1 at most:
  every farther offset weighs 0, so it is never scored. Done in blocks of queries, each
  against the key rows from S - 1 before its start to its end: time and memory O(T (S +
  block)) per head, linear in T (the probe's `fib` base, K=15, ends at 987: S stays near
  1,100 at w = 40 whatever the length), never a T x T score, mask or index. At T <= S (the
  study's 512) that is the causal part of a dense score matrix; nothing (2R+1)-wide is built
  per rung.
"""

from __future__ import annotations

import math

import torch

from fibctl.attention import NEG, attend_columns

BLUR_BLOCK = 128  # queries per block of the fast path

def bands(c: list[int], centres: torch.Tensor, width: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets j (K, 2R+1), long, and their normalised weights (K, 2R+1) for each kept rung."""
    R = math.ceil(2.5 * width)
    middle = torch.tensor(c, dtype=torch.long, device=centres.device)
    j = (middle[:, None] + torch.arange(-R, R + 1, device=centres.device)).clamp(1, max(1, seq_len - 1))
    w = torch.exp(-0.5 * ((j.to(centres.dtype) - centres[:, None]) / width) ** 2)
    return j, w / w.sum(-1, keepdim=True)


def blur_attention(q, k, v, window: list[int], c: list[int], centres: torch.Tensor, width: float,
                   impl: str = "fast") -> torch.Tensor:
    """q (B, H, T, D); k, v (B, Hkv, T, D), RoPE applied. `window`: exact offsets 0..W;
    `c`, `centres`: the kept rungs' rounded and exact centres (K,), centres carrying alpha."""
    if impl == "reference":
        return _reference(q, k, v, window, c, centres, width)
    return _banded(q, k, v, window, c, centres, width)


def _reference(q, k, v, window, c, centres, width) -> torch.Tensor:
    B, H, T, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, T, D)
    i = torch.arange(T, device=q.device)
    columns = []
    for d in window:
        row = (i - d).clamp_min(0)
        columns.append((k[:, :, row], v[:, :, row], i >= d))
    R = math.ceil(2.5 * width)
    for r, middle in enumerate(c):
        # the band spelled out here, not read from bands(): the fast path's table comes from
        # bands(), and a test holding the two together must not share it
        offsets = torch.tensor([min(T - 1, max(1, j)) for j in range(middle - R, middle + R + 1)], device=q.device)
        mix = torch.exp(-0.5 * ((offsets.to(centres.dtype) - centres[r]) / width) ** 2)
        mix = (mix / mix.sum()).to(q.dtype)[:, None]  # (2R+1, 1)
        rows = (i[:, None] - offsets[None, :]).clamp_min(0)  # (T, 2R+1)
        columns.append(((mix * k[:, :, rows]).sum(-2), (mix * v[:, :, rows]).sum(-2), i >= middle))
    return attend_columns(q, columns)


def reach(window: list[int], c: list[int], width: float, T: int) -> int:
    """S: one past the farthest offset any column takes weight at (the window's last, or a
    band's c + R clamped at T-1), read on the host; S <= T."""
    farthest = max(window, default=0)
    if c:
        farthest = max(farthest, min(T - 1, max(c) + math.ceil(2.5 * width)))
    return min(T, farthest + 1)


def offset_weights(window: list[int], c: list[int], centres: torch.Tensor, width: float, T: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, S): how much of the key row at each offset 0..S-1 every column takes (the window's
    columns one offset each, a rung its band), S = reach(...) (every farther offset takes 0);
    and (T, C): which columns query i may use."""
    dev = centres.device
    i = torch.arange(T, device=dev)
    S = reach(window, c, width, T)
    win = torch.tensor(window, dtype=torch.long, device=dev)
    weights = torch.zeros(len(window) + len(c), S, dtype=dtype, device=dev)
    weights[torch.arange(len(window), device=dev), win] = 1
    starts = win
    if c:
        offsets, w = bands(c, centres, width, T)  # (K, 2R+1), every offset below S
        # a band clamped at offset 1 or T-1 puts the weight of all its clamped taps there
        rungs = torch.zeros(len(c), S, dtype=dtype, device=dev).scatter_add(1, offsets, w.to(dtype))
        weights = torch.cat([weights[:len(window)], rungs])
        starts = torch.cat([win, torch.tensor(c, dtype=torch.long, device=dev)])
    return weights, i[:, None] >= starts[None, :]


class _ByOffset(torch.autograd.Function):
    """scores.gather(-1, rows), whose backward scatters the gradient back through `rows` as
    gather's does, but keeps only `rows` for it: gather's own keeps the whole block of scores
    alive until the backward, one more block-sized tensor per block of every layer."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.shape = scores.shape
        return scores.gather(-1, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter_add_(-1, rows, grad), None


def _banded(q, k, v, window, c, centres, width) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    dev = q.device
    weights, valid = offset_weights(window, c, centres, width, T, q.dtype)  # (C, S), (T, C)
    S = weights.shape[1]
    # the G query heads that share a kv head side by side, (B, Hkv, T * G, D) with query t's
    # heads in rows tG..tG+G-1: each product is one plain batched matmul, nothing broadcast
    qg = (q * D**-0.5).view(B, Hkv, G, T, D).transpose(2, 3).reshape(B, Hkv, T * G, D)
    # contiguous once, so that each block's slice of rows is a view, not a copy kept per block
    k, v = k.contiguous(), v.contiguous()
    valid = valid.repeat_interleave(G, 0)
    offsets = torch.arange(S, device=dev)
    # a block past the first S - 1 queries reads key row i - o at (i - s) + S - 1 - o from
    # `first`, the same table for each: built once, (BLUR_BLOCK G, S), a row per query head
    steady = (torch.arange(BLUR_BLOCK, device=dev)[:, None] + (S - 1 - offsets)).repeat_interleave(G, 0)
    out = []
    # Score the key rows a block can read, read the scores by offset (row i - o, clamped at
    # row 0), and put the offsets' shares back on their rows to mix the values. Query block
    # [s, e) reads offsets 0..S-1, key rows first..e-1 with first = max(0, s - S + 1): a block
    # of (e - s) x (e - first) scores, never T x T. While e < S (then first = 0) its offsets
    # from e on all land on row 0, so they count as one column of summed weights (`tail`).
    # Measured on the CPU, reading by offset beat a strided view of the scores padded with
    # row 0, a (T, T, C) share matrix, gathering only the rows the bands use (at every
    # width), and convolving keys and values with the bands by FFT.
    for s in range(0, T, BLUR_BLOCK):
        e = min(T, s + BLUR_BLOCK)
        first, n = max(0, s - S + 1), min(e, S)  # first key row read; offsets read by row
        block = slice(s * G, e * G)
        if first:
            rows = steady[:(e - s) * G]
        else:  # rows clamped at row 0
            i = torch.arange(s, e, device=dev)
            rows = (i[:, None] - offsets[None, :n]).clamp_min(0).repeat_interleave(G, 0)
        rows = rows.expand(B, Hkv, (e - s) * G, n)  # (tG + g, o): the key row, counted from `first`
        near = weights[:, :n]  # (C, n)
        scores = qg[:, :, block] @ k[:, :, first:e].transpose(-1, -2)  # (B, Hkv, (e - s) G, e - first)
        logits = _ByOffset.apply(scores, rows) @ near.T
        if n < S:  # first = 0: offsets n..S-1 all read row 0
            tail = weights[:, n:].sum(-1)  # (C,)
            logits = logits + scores[..., :1].clone() * tail  # the clone: not all the scores kept
        p = logits.masked_fill(~valid[block], NEG).softmax(-1)
        mixing = torch.zeros_like(scores).scatter_add_(-1, rows, p @ near)
        if n < S:
            mixing[..., 0] += p @ tail
        out.append(mixing @ v[:, :, first:e])
    return torch.cat(out, -2).view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, H, T, D)
