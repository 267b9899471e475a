"""The whole model against the study's transformer written out by hand (docs/method.md, "The
attended set", "Schedules" and "The model").

The yardstick below shares no code with fibctl but the weights' names: float64 throughout, its
own rungs, ramp and coprime slots, and a loop over queries that builds each attended key as
the method states it. The attention tests hold fibctl's fast paths to its `reference`; this
holds everything around them too (RMSNorm, RoPE's convention, which kv head a query head
reads, SwiGLU's gate, the tied head) and the initial weights' scales.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fibctl.config import ModelConfig
from fibctl.model import FibLM

torch.set_num_threads(1)
FIB = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987]


def ramp_alphas(schedule: str, L: int) -> list[float]:
    if schedule in ("fixed", "learned") or L == 1:
        return [1.0] * L
    slots = list(range(L))
    if schedule == "coprime" and L > 2:
        stride = max(s for s in range(2, L // 2 + 1) if math.gcd(s, L) == 1)  # L = 5 here: 2
        slots = [(stride * l) % L for l in range(L)]
    return [0.5 + s / (L - 1) for s in slots]


def rungs(base: str, T: int) -> list[int]:
    return FIB if base == "fib" else [2**j for j in range(T) if 2**j <= T - 1]


def columns(cfg: ModelConfig, layer: int, alpha, T: int) -> list[tuple[int, float]]:
    """(near row distance, weight of the row one further) of every attended column."""
    cols = [(d, 0.0) for d in range(min(cfg.window, T - 1) + 1)]
    b = rungs(cfg.base, max(T, cfg.seq_len))
    if cfg.schedule != "learned":
        kept = {round(alpha * x) for x in b} - set(range(cfg.window + 1))
        return cols + [(r, 0.0) for r in sorted(kept) if r <= T - 1]
    used = set(range(cfg.window + 1))
    for x in b:
        t = float(np.float32(alpha) * np.float32(x))  # the product in theta's dtype
        lo = math.floor(t)
        if round(t) <= cfg.window or lo > T - 1 or lo in used:
            continue
        used.add(lo)
        cols.append((lo, t - lo))
    return cols


def by_hand(model: FibLM, idx: torch.Tensor) -> torch.Tensor:
    cfg = model.cfg
    w = {k: v.double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads

    def rms(x, scale):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * scale

    half = D // 2
    angle = torch.tensor(np.outer(np.arange(T), 10000.0 ** (-np.arange(half) * 2 / D)))  # (T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # broadcast over heads

    def rope(x):  # rotate-half: pairs (j, j + D/2)
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["embed.weight"][idx]
    alphas = ramp_alphas(cfg.schedule, cfg.n_layers)
    for l in range(cfg.n_layers):
        p = f"blocks.{l}."
        h = rms(x, w[p + "norm1.weight"])
        q = rope((h @ w[p + "attn.wq.weight"].T).view(B, T, H, D))
        k = rope((h @ w[p + "attn.wk.weight"].T).view(B, T, Hkv, D))
        v = (h @ w[p + "attn.wv.weight"].T).view(B, T, Hkv, D)
        if cfg.schedule == "learned":
            alpha = float(0.5 + torch.sigmoid(w[p + "attn.theta"].float()))
        else:
            alpha = alphas[l]
        y = torch.zeros(B, T, H, D, dtype=torch.float64)
        for head in range(H):
            kv = head // (H // Hkv)  # query heads 0..G-1 read kv head 0, and so on
            for i in range(T):
                if cfg.schedule == "dense":
                    keys, values = k[:, :i + 1, kv].flip(1), v[:, :i + 1, kv].flip(1)
                    valid = [True] * (i + 1)
                else:
                    cols = columns(cfg, l, alpha, T)
                    keys = torch.stack([(1 - f) * k[:, max(i - d, 0), kv] + f * k[:, max(i - d - 1, 0), kv]
                                        for d, f in cols], 1)
                    values = torch.stack([(1 - f) * v[:, max(i - d, 0), kv] + f * v[:, max(i - d - 1, 0), kv]
                                          for d, f in cols], 1)
                    valid = [i >= d for d, _ in cols]
                score = (keys * q[:, i, head, None]).sum(-1) / math.sqrt(D)
                score = score.masked_fill(~torch.tensor(valid), -1e9)
                y[:, i, head] = (score.softmax(-1)[..., None] * values).sum(1)
        x = x + y.reshape(B, T, H * D) @ w[p + "attn.wo.weight"].T
        h = rms(x, w[p + "norm2.weight"])
        gate, up = h @ w[p + "ffn.w1.weight"].T, h @ w[p + "ffn.w3.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "ffn.w2.weight"].T
    return rms(x, w["norm.weight"]) @ w["embed.weight"].T


@pytest.mark.parametrize("schedule,base,thetas", [
    ("dense", "fib", None), ("fixed", "pow2", None), ("stagger", "fib", None), ("coprime", "pow2", None),
    ("learned", "fib", [0.0, 0.7, -1.3, 2.2, -0.4]), ("learned", "pow2", [0.3, -2.0, 1.1, 0.0, 4.0]),
])
@pytest.mark.parametrize("T", [1, 2, 13, 24, 40])  # below the window, the built length, past it
def test_model_is_the_transformer_written_out_by_hand(schedule, base, thetas, T):
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2, seq_len=24,
                      schedule=schedule, base=base, window=2).validate()
    torch.manual_seed(3)
    model = FibLM(cfg).eval()
    if thetas:
        with torch.no_grad():
            for block, theta in zip(model.blocks, thetas):
                block.attn.theta.fill_(theta)
    # random norm scales: a scale applied in the wrong place must show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
        got = model(idx).double()
    torch.testing.assert_close(got, by_hand(model, idx), atol=2e-5, rtol=2e-5)


def test_initial_weights_have_the_method_scales():
    """normal(0, d ** -0.5) for the embedding and every linear, divided by sqrt(2 L) for the
    attention output and the feed-forward down projection; norm scales 1, theta 0."""
    L, d = 4, 256
    cfg = ModelConfig(vocab_size=512, d_model=d, n_layers=L, n_heads=4, n_kv_heads=2, seq_len=64,
                      schedule="learned").validate()
    torch.manual_seed(0)
    model = FibLM(cfg)
    std = d**-0.5
    seen = set()
    for name, p in model.named_parameters():
        p = p.detach()
        kind = name.split(".")[-2] if name.endswith("weight") else name.split(".")[-1]
        seen.add(kind)
        if kind in ("norm1", "norm2", "norm"):
            assert bool((p == 1).all()), name
        elif kind == "theta":
            assert float(p) == 0.0
        else:  # at least 65,536 draws: the sample std is within 1 % of the true one
            expected = std / math.sqrt(2 * L) if kind in ("wo", "w2") else std
            assert float(p.std()) == pytest.approx(expected, rel=0.03), name
            assert abs(float(p.mean())) < 0.05 * expected, name
    assert seen == {"embed", "norm1", "norm2", "norm", "theta", "wq", "wk", "wv", "wo", "w1", "w2", "w3"}
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())


def study_draws(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The initial weights as the study's code drew them, module by module: its constructor
    built the embedding, each layer's q, k, v, o, gate, up and down projections and an output
    layer (each with torch's default initialisation), tied the output layer to the embedding,
    then drew normal(0, std) for the embedding and for every linear in that order, the output
    layer last: the tied embedding is its second draw."""
    d, L, D = cfg.d_model, cfg.n_layers, cfg.head_dim
    std = d**-0.5
    embed = torch.nn.Embedding(cfg.vocab_size, d)
    layers = []
    for _ in range(L):
        shapes = [(d, cfg.n_heads * D), (d, cfg.n_kv_heads * D), (d, cfg.n_kv_heads * D), (cfg.n_heads * D, d),
                  (d, cfg.ffn_hidden), (d, cfg.ffn_hidden), (cfg.ffn_hidden, d)]
        layers.append([torch.nn.Linear(i, o, bias=False) for i, o in shapes])
    head = torch.nn.Linear(d, cfg.vocab_size, bias=False)
    head.weight = embed.weight
    torch.nn.init.normal_(embed.weight, std=std)
    for linears in layers:
        for j, lin in enumerate(linears):  # o (3) and down (6) write into the residual stream
            torch.nn.init.normal_(lin.weight, std=std / math.sqrt(2 * L) if j in (3, 6) else std)
    torch.nn.init.normal_(head.weight, std=std)
    names = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2"]
    out = {"embed.weight": embed.weight}
    for l, linears in enumerate(layers):
        out.update({f"blocks.{l}.{n}.weight": lin.weight for n, lin in zip(names, linears)})
    return out


@pytest.mark.parametrize("schedule", ["dense", "learned"])
def test_initial_weights_are_the_study_draws_from_the_same_generator_state(schedule):
    """Seeded alike, fibctl draws the very weights the study's code drew (its probe seeded
    and then built its models: fibctl's probe runs start where the study's did)."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=64,
                      schedule=schedule).validate()
    torch.manual_seed(3)
    want = study_draws(cfg)
    torch.manual_seed(3)
    got = FibLM(cfg).state_dict()
    for name, w in want.items():
        assert torch.equal(got[name], w.detach()), name


def study_registration(L: int, learned: bool) -> list[str]:
    """The study's model.parameters(), as fibctl names them: its constructor registered the
    embedding, then per layer attn_norm and ffn_norm before attn and ffn (gate, up, down),
    then final_norm. parameters() yields a module's own before its children's: a learned
    layer's theta before its q, k, v and o. The head tied to the embedding is that same
    tensor, which parameters() yields once."""
    attn = ["attn.theta"] * learned + [f"attn.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
    layer = ["norm1.weight", "norm2.weight", *attn, "ffn.w1.weight", "ffn.w3.weight", "ffn.w2.weight"]
    return ["embed.weight", *(f"blocks.{l}.{n}" for l in range(L) for n in layer), "norm.weight"]


@pytest.mark.parametrize("schedule", ["dense", "learned"])
def test_study_order_is_the_study_models_parameter_registration(schedule):
    """clip_grad_norm_ sums the per-tensor norms in the order it is given them: fibctl gives
    them in the study's (FibLM.study_order), whose blocks listed both norms first."""
    cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=64,
                      schedule=schedule).validate()
    model = FibLM(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in model.study_order()] == study_registration(3, schedule == "learned")
