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
  scores q_i . k_{i-j}, and its output the band-weighted sum of value rows. One dense score
  matrix (B, H, T, T) read by offset, and a (C, T) table of each column's weight at each
  offset, give every column's logits; the softmax goes back through the same table to one
  weight per key row. A dense attention's cost plus 2 C T^2 multiply-adds and a gather and
  scatter of the scores, whatever the width; nothing (2R+1)-wide is built per rung. Done in
  blocks of queries, each against the key rows below its end (the causal part).
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


def offset_weights(window: list[int], c: list[int], centres: torch.Tensor, width: float, T: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, T): how much of the key row at each offset 0..T-1 every column takes (the window's
    columns one offset each, a rung its band); and (T, C): which columns query i may use."""
    dev = centres.device
    i = torch.arange(T, device=dev)
    win = torch.tensor(window, dtype=torch.long, device=dev)
    weights = torch.zeros(len(window) + len(c), T, dtype=dtype, device=dev)
    weights[torch.arange(len(window), device=dev), win] = 1
    starts = win
    if c:
        offsets, w = bands(c, centres, width, T)  # (K, 2R+1)
        # a band clamped at offset 1 or T-1 puts the weight of all its clamped taps there
        rungs = torch.zeros(len(c), T, dtype=dtype, device=dev).scatter_add(1, offsets, w.to(dtype))
        weights = torch.cat([weights[:len(window)], rungs])
        starts = torch.cat([win, torch.tensor(c, dtype=torch.long, device=dev)])
    return weights, i[:, None] >= starts[None, :]


def _banded(q, k, v, window, c, centres, width) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    weights, valid = offset_weights(window, c, centres, width, T, q.dtype)  # (C, T), (T, C)
    # the G query heads that share a kv head side by side, (B, Hkv, T * G, D) with query t's
    # heads in rows tG..tG+G-1: each product is one plain batched matmul, nothing broadcast
    qg = (q * D**-0.5).view(B, Hkv, G, T, D).transpose(2, 3).reshape(B, Hkv, T * G, D)
    i = torch.arange(T, device=q.device)
    by_offset = (i[:, None] - i[None, :]).clamp_min(0).repeat_interleave(G, 0)  # key row of (tG + g, o)
    valid = valid.repeat_interleave(G, 0)
    out = []
    # Score every key row once, read the scores by offset (row i - o, clamped at row 0), and
    # put the offsets' shares back on their rows to mix the values. Query block [s, e) reads
    # only key rows below e: its offsets from e on all land on row 0, so they count as one
    # column of summed weights (`tail`), and the T x T work shrinks to the causal blocks.
    # Measured on the CPU, reading by offset beat a strided view of the scores padded with
    # row 0, a (T, T, C) share matrix, gathering only the rows the bands use (at every
    # width), and convolving keys and values with the bands by FFT.
    for s in range(0, T, BLUR_BLOCK):
        e = min(T, s + BLUR_BLOCK)
        block = slice(s * G, e * G)
        rows = by_offset[block, :e].expand(B, Hkv, (e - s) * G, e)
        near, tail = weights[:, :e], weights[:, e:].sum(-1)  # (C, e), (C,)
        scores = qg[:, :, block] @ k[:, :, :e].transpose(-1, -2)  # (B, Hkv, (e - s) G, e)
        logits = scores.gather(-1, rows) @ near.T + scores[..., :1] * tail
        p = logits.masked_fill(~valid[block], NEG).softmax(-1)
        mixing = torch.zeros_like(scores).scatter_add_(-1, rows, p @ near)
        mixing[..., 0] += p @ tail
        out.append(mixing @ v[:, :, :e])
    return torch.cat(out, -2).view(B, Hkv, T, G, D).transpose(2, 3).reshape(B, H, T, D)
