"""Every attention path matches the slow reference; causality; the schedules' definitions."""

import dataclasses
import math

import pytest
import torch

from fibctl import attention as attention_module
from fibctl.attention import Columns, choose_impl, dense_attention, flex_unavailable, sparse_attention
from fibctl.config import ATTENTION_IMPLS, BASES, SCHEDULES, ConfigError, ModelConfig
from fibctl.model import Attention, FibLM, apply_rope, rope_tables
from fibctl.schedules import (
    attended_distances, base_sequence, coprime_slots, coprime_stride, coverage, fractional_rungs,
    integer_distances, layer_alphas,
)

torch.set_num_threads(1)
SPARSE = [s for s in SCHEDULES if s != "dense"]  # from the config: a new schedule is tested for free
LENGTHS = [1, 2, 17, 257, 1100]


def layer_cfg(schedule, base, window, n_layers=4):
    return ModelConfig(vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       seq_len=64, schedule=schedule, base=base, window=window)


def qkv(T, seed=0, B=1, H=4, Hkv=2, D=None, device="cpu"):
    """Random q, k, v; heads of 8 on the CPU, 16 on CUDA (flex's least there)."""
    D = D or (16 if device == "cuda" else 8)
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(B, h, T, D, generator=g, dtype=torch.float64).float().to(device).requires_grad_()
    return mk(H), mk(Hkv), mk(Hkv)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def flex_skip(device: str, backward: bool) -> str | None:
    """Why flex is left out of a parity check on `device`, or None."""
    why = flex_unavailable(device, backward)
    return f"flex on {device}{' (backward)' if backward else ''} cannot run here: {why}" if why else None


def run_attention(attn: Attention, q, k, v, impl):
    if attn.cfg.schedule == "dense":
        return dense_attention(q, k, v, impl)
    return sparse_attention(q, k, v, attn.columns(q.shape[2]), impl)


def grads(out, tensors, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad((out * w).sum(), tensors, allow_unused=True)


# dense has no base or window: one setting of them is enough
PARITY_CASES = [(s, b, w, T) for s in SPARSE for b in BASES for w in (6, 8, 12) for T in LENGTHS] \
    + [("dense", "fib", 8, T) for T in LENGTHS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("schedule,base,window,T", PARITY_CASES)
def test_implementations_match_reference(schedule, base, window, T, device):
    """Every implementation that runs here, output and gradients; flex's forward alone where
    its backward cannot run (the CPU), the whole of it elsewhere."""
    layer = 2  # a staggered layer with a non-integer alpha
    attn = Attention(layer_cfg(schedule, base, window), layer).to(device)
    if schedule == "learned":
        with torch.no_grad():
            attn.theta.fill_(0.37)  # fractional offsets at every rung
    q, k, v = qkv(T, seed=T + window, device=device)
    params = [q, k, v] + ([attn.theta] if schedule == "learned" else [])
    ref = run_attention(attn, q, k, v, "reference")
    ref_grads = grads(ref, params)
    impls = ["gather", "auto", "mask", "flex"]
    for impl in impls:
        if impl == "flex" and flex_skip(device, backward=False):
            continue  # test_flex_is_checked_wherever_it_runs says which
        if impl == "flex" and flex_skip(device, backward=True):
            with torch.no_grad():
                out = run_attention(attn, q, k, v, impl)
            torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5, msg="flex output")
            continue
        out = run_attention(attn, q, k, v, impl)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"{impl} output")
        for name, a, b in zip("qkv theta".split(), grads(out, params), ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{impl} grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
def test_flex_is_checked_wherever_it_runs(device, backward):
    """The parity test holds flex to the reference where this passes; a skip here names what
    the machine lacks (torch 2.13's CPU build: flex's backward)."""
    why = flex_skip(device, backward)
    if why:
        pytest.skip(why)
    attn = Attention(layer_cfg("stagger", "fib", 8), 1).to(device)
    q, k, v = qkv(300, device=device)
    with torch.set_grad_enabled(backward):
        out = sparse_attention(q, k, v, attn.columns(300), "flex")
        ref = sparse_attention(q, k, v, attn.columns(300), "reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if backward:
        assert all(g is not None and torch.isfinite(g).all() for g in grads(out, [q, k, v]))


def test_flex_on_cuda_is_left_out_below_heads_of_16():
    from types import SimpleNamespace

    from fibctl.attention import flex_fits

    heads = lambda device, D: SimpleNamespace(device=torch.device(device), shape=(1, 4, 32, D))
    assert not flex_fits(heads("cuda", 8)) and flex_fits(heads("cuda", 16)) and flex_fits(heads("cpu", 8))


def test_auto_measures_once_per_setting_and_picks_an_available_path(monkeypatch):
    attention_module._chosen.clear()
    measured = []
    real = attention_module._measure
    monkeypatch.setattr(attention_module, "_measure", lambda impl, *a: measured.append(impl) or real(impl, *a))
    fixed = Attention(layer_cfg("fixed", "fib", 8), 0)
    q, k, v = qkv(200)
    first = choose_impl(q, k, v, fixed.columns(200))
    runs_flex = flex_unavailable("cpu", backward=True) is None
    assert sorted(measured) == sorted(["gather", "mask"] + (["flex"] if runs_flex else []))
    assert choose_impl(q, k, v, fixed.columns(200)) == first and len(measured) == len(set(measured))
    with torch.no_grad():  # no backward: another setting, measured again (flex's forward runs on the CPU)
        choose_impl(q, k, v, fixed.columns(200))
    assert len(measured) > len(set(measured)) and len(attention_module._chosen) == 2
    learned = Attention(layer_cfg("learned", "fib", 8), 0)
    with torch.no_grad():
        learned.theta.fill_(0.4)
    n = len(measured)
    chosen = choose_impl(q, k, v, learned.columns(200))  # fractional rungs: the same candidates
    assert chosen in ("gather", "mask", "flex") and len(measured) == n + 2 + runs_flex
    assert learned.theta.grad is None  # measuring left no gradient on alpha
    with torch.no_grad():
        learned.theta.fill_(0.45)  # the rungs move: the same setting, not measured again
    assert choose_impl(q, k, v, learned.columns(200)) == chosen and len(measured) == n + 2 + runs_flex


def test_agreeing_ranks_take_the_agreed_path_and_none_skips_the_exchange_by_its_own_measurement(monkeypatch):
    """Under DDP every rank must pass each setting through `agree` (a broadcast) in the same
    order: rank 0, having measured it alone (an evaluation), must not skip it."""
    monkeypatch.setattr(attention_module, "_chosen", {})
    monkeypatch.setattr(attention_module, "_agreed", {})
    monkeypatch.setattr(attention_module, "_measure", lambda impl, *a: 0.0 if impl == "gather" else 1.0)
    q, k, v = qkv(100)
    cols = Attention(layer_cfg("stagger", "fib", 8), 1).columns(100)
    assert choose_impl(q, k, v, cols) == "gather"  # alone: its own measurement
    asked = []
    with attention_module.agreeing(lambda mine: asked.append(mine) or "mask"):
        assert choose_impl(q, k, v, cols) == "mask" and choose_impl(q, k, v, cols) == "mask"
    assert asked == ["gather"]  # once per setting, from what this rank measured
    assert choose_impl(q, k, v, cols) == "mask"  # and kept: the group's path


def test_auto_goes_on_without_a_path_that_fails_to_run(monkeypatch):
    """A candidate that raises while measured (a T x T mask out of memory at a long length, a
    compiler error) is left out and said why; auto still chooses among the others."""
    attention_module._chosen.clear()
    real = attention_module._measure

    def measure(impl, *a):
        if impl == "mask":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore")
        return real(impl, *a)

    monkeypatch.setattr(attention_module, "_measure", measure)
    monkeypatch.setattr(attention_module, "skipped", {})
    q, k, v = qkv(100)
    chosen = choose_impl(q, k, v, Attention(layer_cfg("stagger", "fib", 8), 1).columns(100))
    assert chosen in ("gather", "flex")
    assert attention_module.skipped == {"mask": "OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 GiB"}


def plain_blend(x, f, rows):
    """The blended copies as the docstring states them, through autograd."""
    prev = torch.cat([x[:, :, :1], x[:, :, :-1]], 2)
    return torch.cat([x] + [x[:, :, :n] + f[r] * (prev[:, :, :n] - x[:, :, :n]) for r, n in enumerate(rows)], 2)


@pytest.mark.parametrize("T,rows", [(1, [1]), (2, [1]), (9, [8, 6, 1]), (9, [9, 9]), (40, [27, 19, 6, 1, 40])])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_blend_gradients_match_autograd(T, rows, layout):
    """The hand-written blend: its output and its gradients to x and to every weight equal
    autograd through the plain formula (float64), and torch's gradcheck passes."""
    g = torch.Generator().manual_seed(T)
    if layout == "transposed":  # the values reach attention as a transposed view
        x = torch.randn(2, T, 3, 4, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    else:
        x = torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64).requires_grad_()
    f = torch.rand(len(rows), generator=g, dtype=torch.float64).requires_grad_()
    out = attention_module._Blend.apply(x, f, rows)
    ref = plain_blend(x, f, rows)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads(out, [x, f]), grads(ref, [x, f])):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda x, f: attention_module._Blend.apply(x, f, rows), (x, f))


@pytest.mark.parametrize("base", BASES)
def test_learned_at_alpha_one_equals_fixed(base):
    learned, fixed = (Attention(layer_cfg(s, base, 8), 1) for s in ("learned", "fixed"))
    q, k, v = qkv(300)
    a = sparse_attention(q, k, v, learned.columns(300), "gather")
    b = sparse_attention(q, k, v, fixed.columns(300), "gather")
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # the fractional path at integer alpha is also the same function through the mask path
    torch.testing.assert_close(sparse_attention(q, k, v, learned.columns(300), "mask"), b, atol=1e-5, rtol=1e-5)


def test_gradient_to_theta_is_nonzero_at_init():
    attn = Attention(layer_cfg("learned", "fib", 8), 0)
    q, k, v = qkv(200)
    (g,) = grads(sparse_attention(q, k, v, attn.columns(200), "gather"), [attn.theta])
    assert g is not None and g.abs().item() > 0


# flex is left to the parity test above, which skips it where it cannot run
@pytest.mark.parametrize("schedule,impl", [(s, i) for s in SCHEDULES for i in ATTENTION_IMPLS if i != "flex"])
def test_causality(schedule, impl):
    """Changing tokens after position t leaves outputs at positions <= t unchanged."""
    torch.manual_seed(0)
    model = FibLM(dataclasses.replace(layer_cfg(schedule, "fib", 6, n_layers=3), seq_len=96), impl=impl).eval()
    idx = torch.randint(0, 64, (2, 96))
    t = 40
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 64, (2, 96 - t - 1))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=0, rtol=0)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_first_position_attends_only_to_itself():
    attn = Attention(layer_cfg("fixed", "fib", 8), 0)
    q, k, v = qkv(50)
    out = sparse_attention(q, k, v, attn.columns(50), "gather")
    G = 2
    torch.testing.assert_close(out[:, :, 0], v.repeat_interleave(G, 1)[:, :, 0])


def test_a_single_layer_ramp_is_alpha_one_and_two_layers_span_it():
    """0.5 + l / (L - 1) is undefined at L = 1: fibctl gives that layer alpha 1 (docs/method.md)."""
    for schedule in ("stagger", "coprime"):
        assert layer_alphas(schedule, 1) == [1.0]
        assert layer_alphas(schedule, 2) == [0.5, 1.5]

def test_coprime_is_permutation_of_stagger():
    assert coprime_stride(16) == 7 and coprime_stride(8) == 3
    assert sorted(layer_alphas("coprime", 16)) == sorted(layer_alphas("stagger", 16))
    assert layer_alphas("coprime", 16) != layer_alphas("stagger", 16)
    assert layer_alphas("stagger", 16)[0] == 0.5 and layer_alphas("stagger", 16)[-1] == 1.5
    assert coprime_slots(4) == [0, 2, 1, 3]  # no stride exists: interleaved halves
    assert layer_alphas("coprime", 1) == [1.0]


def test_bases():
    assert base_sequence("pow2", 1024) == [2**i for i in range(10)]
    assert base_sequence("pow2", 4096) == [2**i for i in range(12)]
    assert base_sequence("fib", 4096)[-1] == 987 and len(base_sequence("fib", 64)) == 15


def test_rung_filtering():
    fib = base_sequence("fib", 1024)
    # W < round(alpha b) <= T-1, duplicates collapsed (alpha 0.5: 1,1,2,2,4,6,10,...)
    d = integer_distances(0.5, fib, 8, 1024)
    assert d[:9] == list(range(9)) and d[9:] == [10, 17, 28, 44, 72, 116, 188, 305, 494]
    assert integer_distances(1.0, fib, 8, 100) == list(range(9)) + [13, 21, 34, 55, 89]
    # fractional: skip when round(t) <= W or floor(t) already used
    assert fractional_rungs([1.0 * b for b in fib], 8, 100) == [(5, 13), (6, 21), (7, 34), (8, 55), (9, 89)]
    assert [lo for _, lo in fractional_rungs([0.61 * b for b in fib], 8, 1024)][:2] == [12, 20]
    # a window column is a column already used: 13 * 0.99 rounds past W = 12, its lo is 12
    assert fractional_rungs([12.87, 20.79], 12, 1024) == [(1, 20)]


def test_coverage_fixed_fib_w8():
    per_layer, union = coverage(attended_distances("fib", "fixed", 8, 16, 1024))
    assert union == 19 and per_layer == [19] * 16
    _, staggered = coverage(attended_distances("fib", "stagger", 8, 16, 1024))
    assert staggered > 4 * 19


def test_rope_rotate_half_preserves_norm_and_relative_position():
    cos, sin = rope_tables(16, 8, 10000.0, "cpu")
    x = torch.randn(1, 1, 16, 8)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(8), torch.randn(8)
    qs, ks = q.expand(16, 8)[None, None], k.expand(16, 8)[None, None]
    rq, rk = apply_rope(qs, cos, sin)[0, 0], apply_rope(ks, cos, sin)[0, 0]
    assert math.isclose(float(rq[5] @ rk[3]), float(rq[9] @ rk[7]), rel_tol=1e-5)


def test_an_unknown_implementation_is_named_with_the_allowed_ones():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="unknown attention implementation 'fast'; allowed: gather, mask, reference, flex, auto$"):
        sparse_attention(q, q[:, :1], q[:, :1], Columns([0], []), "fast")


@pytest.mark.parametrize("schedule", ["dense", "fixed", "stagger", "coprime"])
@pytest.mark.parametrize("T", [17, 257])
def test_sdpa_paths_compute_the_studys_attention_bit_for_bit(schedule, T):
    """The study repeated each kv head for its query heads, then called
    scaled_dot_product_attention: causal for dense, a boolean T x T mask of the attended
    distances for an integer schedule. fibctl's dense path and `mask` path do the same, so in
    float32 their outputs and their q, k and v gradients are the study's bit for bit (handing
    SDPA each kv head once, enable_gqa, summed a kv head's gradient in another order)."""
    attn = Attention(layer_cfg(schedule, "fib", 8), layer=1)
    q, k, v = qkv(T, seed=3, B=2, H=6, Hkv=2)
    G = q.shape[1] // k.shape[1]
    k_rep, v_rep = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    if schedule == "dense":
        ours = dense_attention(q, k, v, "gather")
        study = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    else:
        ours = sparse_attention(q, k, v, attn.columns(T), "mask")
        diff = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        allowed = torch.zeros(T, T, dtype=torch.bool)
        for d in attended_distances("fib", schedule, 8, 4, T)[1]:
            allowed |= diff == d
        study = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=allowed & (diff >= 0))
    assert torch.equal(ours, study)
    for a, b in zip(grads(ours, (q, k, v)), grads(study, (q, k, v))):
        assert torch.equal(a, b)
