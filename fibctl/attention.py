"""Scaled-Fibonacci sparse attention and the dense baseline, in three implementations.

Shapes: q is (B, H, T, D) and k, v are (B, Hkv, T, D), RoPE already applied at their
true positions. H = G * Hkv (grouped queries). A layer attends to a list of *columns*:

- integer columns: distance d, key row i - d, valid iff i >= d;
- fractional columns (learned alpha): distance t = lo + frac, key
  (1 - frac) * k[i - lo] + frac * k[i - lo - 1] (the far row clamped to row 0), valid iff
  i >= lo.

Implementations (`impl`):
- `reference`: a loop over columns that builds each key and value row exactly as the spec
  states them, with the kv heads expanded. Slow and obviously correct: the yardstick.
- `gather` (default): one `index_select` of all needed rows per query chunk, kv heads kept
  unexpanded, cost O(T * C * D). A fractional column reads its row from a copy of the keys
  and values interpolated once for its weight (row t: (1 - frac) k[t] + frac k[t-1]), so
  learning alpha adds no score columns and no per-query interpolation: with G query heads
  per kv head that is cheaper than scoring near and far rows separately and interpolating
  the logits, and than interpolating gathered rows per query (docs/benchmarks.md).
- `mask`: a boolean T x T mask through `scaled_dot_product_attention`; how the study ran
  its fixed paths, kept for parity and benchmarks. Fractional rungs append one whole
  blended copy of the keys and values per rung (T rows each) and the mask reads copy r on
  the diagonal row i - lo_r: a T x T (1 + R) mask.
- `flex`: FlexAttention with a block mask built from the layer's distances (blocks no
  distance reaches are skipped), over the same keys and copies as `mask`; compiled on
  CUDA. Where it cannot run (torch 2.13 on the CPU has its forward only),
  `flex_unavailable` says why.
- `auto`: the fastest of gather, mask and flex for these inputs, measured on first use per
  device, shape, columns (for learned rungs, their number) and grad mode, and remembered
  for the process; under DDP (`agreeing`), rank 0's choice is every rank's.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fibctl.config import ATTENTION_IMPLS, ConfigError
from fibctl.errors import unknown
from fibctl.device import constant, synchronize

NEG = -1e9  # invalid logits: large negative, never -inf, so no row is ever NaN
GATHER_CHUNK = 1024  # queries per gather chunk: bounds memory at long lengths, stays in cache


@dataclass
class Columns:
    """What one layer attends to at one length."""

    dist: list[int]  # integer distances: the window, then integer rungs
    lo: list[int]  # fractional rungs: floor of alpha * b_k
    frac: torch.Tensor | None = None  # (len(lo),) alpha * b_k - lo, carries the gradient to alpha


def default_impl(device: torch.device | str) -> str:
    """The path models train and evaluate with on `device`: `auto` on CUDA (gather, mask or
    flex, whichever measures fastest there); `gather` on the CPU, where flex has no backward
    and one fixed path keeps a resumed run bit for bit equal to an uninterrupted one."""
    return "auto" if torch.device(device).type == "cuda" else "gather"


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(unknown("attention implementation", impl, ATTENTION_IMPLS))
    return impl


# ----------------------------------------------------------------------------- dense


def _repeated(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Each kv head repeated for the query heads that read it, as the study's attention did
    before scaled_dot_product_attention: the same forward as its enable_gqa, but a kv head's
    gradient then sums over its query heads in the study's order, bit for bit in float32."""
    G = q.shape[1] // k.shape[1]
    return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)


def dense_attention(q, k, v, impl: str = "gather") -> torch.Tensor:
    """Plain causal attention."""
    k, v = _repeated(q, k, v)
    if check_impl(impl) != "reference":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[2]
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    with torch.autocast(q.device.type, enabled=False):  # the yardstick: float32 throughout
        scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, T)
        return (scores.masked_fill(future, NEG).softmax(-1) @ v.float()).to(v.dtype)


# ----------------------------------------------------------------------------- sparse


def sparse_attention(q, k, v, cols: Columns, impl: str = "gather") -> torch.Tensor:
    check_impl(impl)
    if impl == "reference":
        return _reference(q, k, v, cols)
    if impl == "auto":
        impl = choose_impl(q, k, v, cols)
    if impl == "mask":
        return _masked(q, k, v, cols)
    if impl == "flex":
        return _flex(q, k, v, cols)
    return _gather(q, k, v, cols)


def _reference(q, k, v, cols: Columns) -> torch.Tensor:
    B, H, T, D = q.shape
    k, v = _repeated(q, k, v)  # (B, H, T, D)
    i = torch.arange(T, device=q.device)
    columns = []  # (key, value, valid) of each column: keys and values (B, H, T, D), valid (T,)
    for d in cols.dist:
        row = (i - d).clamp_min(0)
        columns.append((k[:, :, row], v[:, :, row], i >= d))
    for j, lo in enumerate(cols.lo):
        f = cols.frac[j]
        near, far = (i - lo).clamp_min(0), (i - lo - 1).clamp_min(0)
        key = (1 - f) * k[:, :, near] + f * k[:, :, far]
        value = (1 - f) * v[:, :, near] + f * v[:, :, far]
        columns.append((key, value, i >= lo))
    return attend_columns(q, columns)


def attend_columns(q, columns: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The references' last step: q (B, H, T, D) attends over explicit columns, each a key
    and a value (B, H, T, D) per query and which queries may use it (T,)."""
    D = q.shape[-1]
    logits = []
    for key, _, valid in columns:  # the yardstick: float32 throughout, whatever q's dtype
        s = (q.float() * key.float()).sum(-1) * D**-0.5  # (B, H, T)
        logits.append(torch.where(valid, s, torch.full_like(s, NEG)))
    p = torch.stack(logits, -1).softmax(-1)  # (B, H, T, C)
    values = torch.stack([value for _, value, _ in columns], -2)
    return (p.unsqueeze(-1) * values.float()).sum(-2).to(values.dtype)


def _gather(q, k, v, cols: Columns) -> torch.Tensor:
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    dev = q.device
    dist = constant(cols.dist, torch.long, dev)
    lo = constant(cols.lo, torch.long, dev)
    valid_from = constant(cols.dist + cols.lo, torch.long, dev)  # a fractional column: from its near row
    if cols.lo:
        # Fractional rung r reads row i - lo_r of its own blended copy of the keys and values,
        # row t = k[t] + f_r (k[t-1] - k[t]): the rows are interpolated once per rung, not once
        # per query, and one index_select serves integer and fractional columns alike.
        f = cols.frac.to(q.dtype)
        read = [T - l for l in cols.lo]
        k, v = _Blend.apply(k, f, read), _Blend.apply(v, f, read)
        # copy r holds the T - lo_r rows its queries read, after x and the copies before it
        starts = [T]
        for l in cols.lo[:-1]:
            starts.append(starts[-1] + T - l)
        copy_start = constant(starts, torch.long, dev)
    # Rows are gathered from the keys and values flattened to (rows, D): index_select along
    # dim 0 of a 2-D tensor copies whole rows, several times faster on the CPU than along
    # dim 2 of (B, Hkv, T, D) (docs/benchmarks.md).
    Tk = k.shape[2]
    k, v = k.contiguous().view(-1, D), v.contiguous().view(-1, D)
    plane = torch.arange(B * Hkv, device=dev)[:, None] * Tk  # first row of each (b, h) plane
    # Scores in float32, as the study's fused kernel kept them: under bf16 autocast an einsum
    # of bf16 rows would round each score to bf16 (0.06 apart near a score of 10). q and k
    # hold bf16 values already (Attention rounds them once), so widening them loses nothing.
    qg = q.view(B, Hkv, G, T, D).float() * D**-0.5
    out = []
    for start in range(0, T, GATHER_CHUNK):
        pos = torch.arange(start, min(T, start + GATHER_CHUNK), device=dev)
        n = len(pos)
        index = (pos[:, None] - dist[None, :]).clamp_min(0)  # (n, C_int)
        if cols.lo:
            index = torch.cat([index, copy_start[None, :] + (pos[:, None] - lo[None, :]).clamp_min(0)], 1)
        rows = (plane + index.flatten()[None, :]).flatten()
        shape = (B, Hkv, n, index.shape[1], D)
        kr, vr = k.index_select(0, rows).view(shape), v.index_select(0, rows).view(shape)
        with torch.autocast(dev.type, enabled=False):
            s = torch.einsum("bhgtd,bhtcd->bhgtc", qg[:, :, :, start:start + n], kr.float())  # (B, Hkv, G, n, C)
        valid = pos[:, None] >= valid_from[None, :]  # (n, C)
        p = s.masked_fill(~valid, NEG).softmax(-1).to(vr.dtype)  # bf16 weights on bf16 values, as fused kernels
        out.append(torch.einsum("bhgtc,bhtcd->bhgtd", p, vr))
    return torch.cat(out, 3).reshape(B, H, T, D)


class _Blend(torch.autograd.Function):
    """x (B, Hkv, T, D) followed by one copy per fractional rung r, its first rows[r] rows
    (`gather`: T - lo_r, the rows its queries read; `mask` and `flex`: all T) of
    x[t] + f_r (x[t-1] - x[t]), row -1 read as row 0.

    Written out by hand because autograd through per-rung slices and a concatenation
    zero-fills a full-size gradient for every slice; here the backward accumulates into one
    gradient of x in place (docs/benchmarks.md). `test_blend_gradients_match_autograd`
    holds it to the plain formula in float64."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f: torch.Tensor, rows: list[int]) -> torch.Tensor:
        T = x.shape[2]
        kept = list(rows)
        delta = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # x[t-1] - x[t]; 0 at row 0
        delta[:, :, :1] = 0
        torch.sub(x[:, :, :-1], x[:, :, 1:], out=delta[:, :, 1:])
        out = x.new_empty(x.shape[0], x.shape[1], T + sum(kept), x.shape[3])
        out[:, :, :T] = x
        start = T
        for r, n in enumerate(kept):
            torch.addcmul(x[:, :, :n], delta[:, :, :n], f[r], out=out[:, :, start:start + n])
            start += n
        ctx.save_for_backward(f, delta)
        ctx.kept = kept
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        f, delta = ctx.saved_tensors
        T = delta.shape[2]
        gx = grad[:, :, :T].clone()
        gdelta = torch.zeros_like(delta)
        gf = torch.empty_like(f)
        start = T
        for r, n in enumerate(ctx.kept):
            g = grad[:, :, start:start + n]
            gf[r] = (g * delta[:, :, :n]).sum()
            gx[:, :, :n] += g
            gdelta[:, :, :n].addcmul_(g, f[r])
            start += n
        # delta[t] = x[t-1] - x[t] for t >= 1
        gx[:, :, 1:] -= gdelta[:, :, 1:]
        gx[:, :, :-1] += gdelta[:, :, 1:]
        return gx, gf, None


def _with_copies(q, k, v, cols: Columns) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values for `mask` and `flex` with fractional rungs: x followed by one whole
    blended copy (T rows) per rung, so that the shapes stay fixed while alpha moves; query i
    reads copy r at row i - lo_r, a diagonal like an integer distance."""
    T = q.shape[2]
    f = cols.frac.to(q.dtype)
    rows = [T] * len(cols.lo)
    return _Blend.apply(k, f, rows), _Blend.apply(v, f, rows)


def _masked(q, k, v, cols: Columns) -> torch.Tensor:
    T = q.shape[2]
    i = torch.arange(T, device=q.device)
    allowed = torch.isin(i[:, None] - i[None, :], constant(cols.dist, torch.long, q.device))  # (T, T)
    if not cols.lo:  # integer distances: the study's boolean-mask attention
        return F.scaled_dot_product_attention(q, *_repeated(q, k, v), attn_mask=allowed)
    k, v = _with_copies(q, k, v, cols)  # fractional rungs (the study had no mask path for them)
    lo = constant(cols.lo, torch.long, q.device)
    copies = i[None, None, :] == (i[None, :, None] - lo[:, None, None])  # (R, T queries, T rows)
    allowed = torch.cat([allowed, copies.permute(1, 0, 2).reshape(T, -1)], 1)  # (T, T (1 + R))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


# ----------------------------------------------------------------------------- FlexAttention


FLEX_CUDA_MIN_HEAD_DIM = 16  # inductor's flex kernels on CUDA refuse smaller heads


def flex_fits(q: torch.Tensor) -> bool:
    """Whether flex can take heads of q's size on q's device."""
    return q.device.type != "cuda" or q.shape[-1] >= FLEX_CUDA_MIN_HEAD_DIM


def _flex(q, k, v, cols: Columns) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if not flex_fits(q):
        raise ConfigError(f"the `flex` implementation on CUDA needs head_dim >= {FLEX_CUDA_MIN_HEAD_DIM}, "
                          f"got {q.shape[-1]}; use `gather`")
    if not torch.is_grad_enabled():  # flex refuses inputs that require grad where it has no backward
        q, k, v = q.detach(), k.detach(), v.detach()
    T = q.shape[2]
    if cols.lo:
        k, v = _with_copies(q, k, v, cols)
    mask = _block_mask(tuple(cols.dist), tuple(cols.lo), T, str(q.device))
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
    with warnings.catch_warnings():  # eager flex warns that it is unfused: on the CPU it is all there is
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=256)  # a few distance sets per length; learned rungs move rarely
def _block_mask(dist: tuple[int, ...], lo: tuple[int, ...], T: int, device: str):
    """Query i sees key j < T iff i - j is one of `dist` (a lookup table over distances), and
    row t of copy r (key T + r T + t, `_with_copies`) iff t = i - lo_r."""
    from torch.nn.attention.flex_attention import create_block_mask

    allowed = torch.zeros(T, dtype=torch.bool, device=device)
    allowed[[d for d in dist if d < T]] = True
    # the distance i - j at which each key is read: copy r's diagonal, lo_r - (T + r T)
    diagonal = torch.zeros(T * (1 + len(lo)), dtype=torch.long, device=device)
    for r, l in enumerate(lo):
        diagonal[T * (1 + r):T * (2 + r)] = l - T * (1 + r)

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        near = (kv_idx < T) & (d >= 0) & allowed[d.clamp(0, T - 1)]
        return near | ((kv_idx >= T) & (d == diagonal[kv_idx]))

    return create_block_mask(mask_mod, None, None, T, T * (1 + len(lo)), device=device)


@functools.cache
def flex_unavailable(device_type: str, backward: bool) -> str | None:
    """Why the `flex` path cannot run on this device type (with its backward pass, when
    `backward`), or None when it can: a tiny call, once per process."""
    try:
        device = torch.device(device_type)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 32, 16, generator=g).to(device).requires_grad_(backward) for h in (2, 1, 1))
        out = _flex(q, k, v, Columns([0, 1, 3], []))
        if backward:
            out.sum().backward()
    except Exception as e:  # ImportError, NotImplementedError (no CPU backward), a compiler missing
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return None


# ----------------------------------------------------------------------------- auto

AUTO_REPEATS = 3  # timed calls per candidate, after one warm-up call (which also compiles flex)
_chosen: dict[tuple, str] = {}
traced_defaults = 0  # settings torch.compile traced before any measurement: they took gather
skipped: dict[str, str] = {}  # path -> why its last measurement failed; `auto` went on without it
_agree: Callable[[str], str] | None = None  # inside `agreeing`: the group's path from this rank's
_agreed: dict[tuple, str] = {}  # the settings the group agreed on, in the same order on every rank


@contextlib.contextmanager
def agreeing(agree: Callable[[str], str]) -> Iterator[None]:
    """Within it, a setting `auto` has not agreed on yet takes the path that `agree` returns
    for this process's choice: under DDP, rank 0's (a broadcast), so that every rank runs one
    path and the group's timings are one path's. Every rank must meet the same settings in the
    same order, as their training steps do; what rank 0 runs alone (evaluations) stays outside."""
    global _agree
    before, _agree = _agree, agree
    try:
        yield
    finally:
        _agree = before


def choose_impl(q, k, v, cols: Columns) -> str:
    """The fastest available path for these inputs and columns, measured once per process."""
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    # learned rungs move with alpha; their count, not their place, sets the work
    key = (str(q.device), q.dtype, tuple(q.shape), tuple(k.shape), tuple(cols.dist), len(cols.lo), backward)
    # agreeing, look up what the group agreed: rank 0's own measurements (its evaluations) must
    # not let it skip a broadcast that the other ranks make
    known = _chosen if _agree is None else _agreed
    if key in known:
        return known[key]
    if torch.compiler.is_compiling():  # a measurement cannot be traced (FibLM.choose_paths measures first)
        global traced_defaults
        traced_defaults += 1
        return "gather"
    if key not in _chosen:
        _chosen[key] = _fastest(q, k, v, cols, backward)
    if _agree is not None:
        _chosen[key] = _agreed[key] = _agree(_chosen[key])
    return _chosen[key]


def _fastest(q, k, v, cols: Columns, backward: bool) -> str:
    flex = flex_fits(q) and flex_unavailable(q.device.type, backward) is None
    candidates = ["gather", "mask"] + (["flex"] if flex else [])
    times = {"gather": _measure("gather", q, k, v, cols, backward)}  # the path that always runs
    for impl in candidates[1:]:
        try:
            times[impl] = _measure(impl, q, k, v, cols, backward)
        except Exception as e:  # out of memory (a T x T mask at long T), a compiler failure
            lines = str(e).strip().splitlines()
            skipped[impl] = f"{type(e).__name__}: {lines[0] if lines else ''}"
            if q.device.type == "cuda":
                torch.cuda.empty_cache()
    return min(times, key=times.get)


def chosen_impls() -> dict[str, int]:
    """How many settings `auto` has sent to each path in this process."""
    counts: dict[str, int] = {}
    for impl in _chosen.values():
        counts[impl] = counts.get(impl, 0) + 1
    return counts


def _measure(impl: str, q, k, v, cols: Columns, backward: bool) -> float:
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    if cols.frac is not None:  # a measurement must not leave a gradient on theta
        cols = Columns(cols.dist, cols.lo, cols.frac.detach())

    def call():
        out = sparse_attention(q, k, v, cols, impl)
        if backward:
            out.sum().backward()
        synchronize(q.device)

    call()
    times = []
    for _ in range(AUTO_REPEATS):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
