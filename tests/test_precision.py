"""The study's precision under bf16 autocast (its GPU runs), emulated with the CPU's bf16
autocast: RoPE in float32 (the study's float32 tables promote bf16 queries and keys), integer
layers scored in bf16 from queries and keys rounded once, learned layers and the probe's blur
rungs scored in float32. Each reference below is the study's own formula, written out."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fibctl.config import get_preset
from fibctl.model import Attention, rope_tables
from fibctl.schedules import window_distances

torch.set_num_threads(1)
T = 64


def layer(schedule: str, impl: str, theta: float = 0.3) -> Attention:
    cfg = dataclasses.replace(get_preset("micro").model, schedule=schedule, window=4, seq_len=T)
    torch.manual_seed(0)
    attn = Attention(cfg, 1, impl)
    if schedule == "learned":
        with torch.no_grad():
            attn.theta.fill_(theta)  # every rung fractional
    return attn


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def study_qkv(attn: Attention, x: torch.Tensor, expand: bool = True):
    """Projections under autocast (bf16), RoPE with float32 tables: q and k come out float32;
    the kv heads repeated for the query heads (`expand`) as the study's attention did."""
    cfg, D = attn.cfg, attn.cfg.head_dim
    B = x.shape[0]
    cos, sin = rope_tables(T, D, cfg.rope_theta, "cpu")
    q = attn.wq(x).view(B, T, cfg.n_heads, D).transpose(1, 2)
    k = attn.wk(x).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)
    v = attn.wv(x).view(B, T, cfg.n_kv_heads, D).transpose(1, 2)

    def rope(t):
        first, second = t.chunk(2, -1)
        return t * cos + torch.cat((-second, first), -1) * sin

    G = cfg.n_heads // cfg.n_kv_heads if expand else 1
    return rope(q), rope(k).repeat_interleave(G, 1), v.repeat_interleave(G, 1)


def core_output(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """What fibctl's layer hands its output projection, under autocast."""
    seen = []
    hook = attn.wo.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    cos, sin = rope_tables(T, attn.cfg.head_dim, attn.cfg.rope_theta, "cpu")
    with bf16(), torch.no_grad():
        attn(x, cos, sin)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("impl", ["mask", "gather", "reference"])
def test_an_integer_layer_under_autocast_scores_the_study_s_bf16_queries_and_keys(impl):
    attn = layer("fixed", impl)
    x = torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(1))
    distances = attn.columns(T).dist
    with bf16(), torch.no_grad():
        q, k, v = study_qkv(attn, x)
        i = torch.arange(T)
        allowed = torch.isin(i[:, None] - i[None, :], torch.tensor(distances))
        study = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # autocast rounds q and k here
    B, H, _, D = study.shape
    study = study.transpose(1, 2).reshape(B, T, H * D)
    ours = core_output(attn, x)
    assert ours.dtype == study.dtype == torch.bfloat16
    if impl == "mask":  # the study's own path: the same numbers, bit for bit
        assert torch.equal(ours, study)
    else:  # another order of the same bf16 sums
        assert torch.allclose(ours.float(), study.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("impl", ["mask", "gather", "reference"])
def test_no_path_rounds_an_integer_layer_s_scores_to_bf16(impl):
    """Activations large enough that scores reach tens, where bf16 holds a score to within
    0.06 to 0.25: against the float32 attention of the same bf16 queries, keys and values,
    each path stays within twice the study's own error (its fused kernel keeps scores in
    float32 and rounds the output to bf16). A path scoring in bf16 misses by about 7 times."""
    attn = layer("fixed", impl)
    x = 6 * torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(1))
    i = torch.arange(T)
    allowed = torch.isin(i[:, None] - i[None, :], torch.tensor(attn.columns(T).dist))
    with torch.no_grad():
        with bf16():
            q, k, v = study_qkv(attn, x)
            study = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        exact = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.float(),
                                               attn_mask=allowed)
    B, H, _, D = study.shape
    study, exact = (y.transpose(1, 2).reshape(B, T, H * D).float() for y in (study, exact))
    ours = core_output(attn, x).float()
    assert (study - exact).abs().max() > 0.01  # bf16's rounding of the output shows at this scale
    assert (ours - exact).abs().max() <= 2 * (study - exact).abs().max()


def study_learned(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The study's learned layer, materialised: keys interpolated in float32 from float32 rows,
    scores summed elementwise in float32 (autocast leaves elementwise work alone). The values
    are read in float32 here, as fibctl reads them (the study blended them in bf16)."""
    with bf16():
        q, k, v = study_qkv(attn, x)
        v = v.float()
        targets, kept = attn._rungs(T)  # alpha * b_k, carrying theta's gradient
        i = torch.arange(T)
        cols = window_distances(attn.cfg.window, T)
        keys = [k.index_select(2, (i - d).clamp_min(0)) for d in cols]
        values = [v.index_select(2, (i - d).clamp_min(0)) for d in cols]
        valid_from = list(cols)
        for rung, lo in kept:
            frac = targets[rung] - lo
            near, far = (i - lo).clamp_min(0), (i - lo - 1).clamp_min(0)
            keys.append((1 - frac) * k.index_select(2, near) + frac * k.index_select(2, far))
            values.append((1 - frac) * v.index_select(2, near) + frac * v.index_select(2, far))
            valid_from.append(lo)
        K, V = torch.stack(keys, 3), torch.stack(values, 3)  # (B, H, T, C, D)
        scores = (q.unsqueeze(3) * K).sum(-1) * attn.cfg.head_dim ** -0.5
        valid = i[:, None] >= torch.tensor(valid_from)[None, :]
        p = scores.masked_fill(~valid, -1e9).softmax(-1)
        y = (p.unsqueeze(-1) * V).sum(3)
    B, H, _, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("impl", ["gather", "mask", "reference"])
def test_a_learned_layer_under_autocast_attends_in_float32_as_the_study_s(impl):
    attn = layer("learned", impl)
    x = torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(1))
    assert attn._rungs(T)[1]  # rungs kept: the interpolation is exercised
    ours = core_output(attn, x)
    with torch.no_grad():
        study = study_learned(attn, x)
    assert ours.dtype == study.dtype == torch.float32
    # scored in bf16 (fibctl before), the two were about 1e-2 apart here
    assert torch.allclose(ours, study, atol=2e-6, rtol=0), (ours - study).abs().max()


def test_theta_s_gradient_under_autocast_is_the_study_s():
    attn = layer("learned", "gather")
    x = torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_tables(T, attn.cfg.head_dim, attn.cfg.rope_theta, "cpu")

    def ours():  # the layer's attention output, before the output projection
        seen = []
        hook = attn.wo.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        attn(x, cos, sin)
        hook.remove()
        return seen[0]

    grads = []
    for forward in (ours, lambda: study_learned(attn, x)):
        attn.theta.grad = None
        with bf16():
            loss = (forward().float() - target).square().mean()
        loss.backward()  # outside autocast, as the trainer's: a backward under it would run in bf16
        grads.append(float(attn.theta.grad))
    ours, study = grads
    # scored in bf16 (fibctl before), they were 2e-3 apart, relatively
    assert study != 0 and abs(ours - study) <= 1e-5 * abs(study), (ours, study)


def test_the_probe_s_blur_rungs_under_autocast_are_scored_in_float32():
    from fibctl.probe.blur import blur_attention

    attn = layer("learned", "gather")
    attn.blur_width = 3.0
    x = torch.randn(2, T, attn.cfg.d_model, generator=torch.Generator().manual_seed(1))
    ours = core_output(attn, x)
    with bf16(), torch.no_grad():
        q, k, v = study_qkv(attn, x, expand=False)
        c, centres = attn.blur_columns(T)
        y = blur_attention(q, k, v.float(), window_distances(attn.cfg.window, T), c, centres, 3.0, "reference")
    B, H, _, D = y.shape
    assert ours.dtype == torch.float32 and c
    assert torch.allclose(ours, y.transpose(1, 2).reshape(B, T, H * D), atol=2e-6, rtol=0)
