"""fibctl's model and trainer beside the study's model and training loop, transcribed, in
float32 and in float64 (docs/method.md, "Rounding, not the function").

The transcription below follows the study's code operation for operation and shares no
code with fibctl but the weights' names: its RMSNorm formula, RoPE tables, kv heads repeated
for their query heads before scaled_dot_product_attention (a boolean mask of the attended
distances, or causal for dense), its materialized learned attention, the tied head as a
linear layer, the loss of each micro-batch divided by their number and added to a Python
float, clip_grad_norm_ over its model's parameters in registration order, AdamW with two
groups (decay on matrices) and the warm-up and cosine schedule. Both start from fibctl's
initial weights and read the windows fibctl's sampler drew. In float64 the study's code
computed in float64 what it computed in float32 (its RoPE tables excepted, float32 values
either way), and so does the transcription, its model cast as the study's would have been.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fibctl.config import BASES, SCHEDULES
from fibctl.data.streams import load_manifest
from fibctl.model import FibLM
from fibctl.train import trainer as trainer_module
from fibctl.train.trainer import Trainer
from test_transformer_by_hand import ramp_alphas, rungs, study_registration
from train_helpers import NullReporter, micro_run, write_data

torch.set_num_threads(1)
STEPS, LAYERS = 10, 5  # 5 layers: the study's coprime has a stride (2) there, and differs from stagger
INTEGER = [(s, b) for s in SCHEDULES if s != "learned" for b in BASES if s != "dense" or b == "fib"]
EVERY = INTEGER + [("learned", b) for b in BASES]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


# ----------------------------------------------------------------------------- the study's step


def study_rms(x, scale, eps):
    return x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt() * scale


def study_rope(x, T, D, theta):
    """Rotate-half with the study's float32 tables: cos and sin of (T, D/2), then doubled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2).float() / D))
    angles = torch.outer(torch.arange(T).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1)[None, None], torch.cat([sin, sin], -1)[None, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def study_mask(base, window, T, alpha):
    """The boolean (T, T) mask of the window and of round(alpha * b) for each rung b (the
    float64 product, Python's round) that lies past the window and below T."""
    dist = set(range(window + 1)) | {round(alpha * b) for b in rungs(base, T) if window < round(alpha * b) <= T - 1}
    diff = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for d in sorted(dist):
        allowed |= diff == d
    return allowed & (diff >= 0)


def study_learned(q, k, v, theta, base, window):
    """The study's materialized learned attention: each kept rung's key and value interpolated
    between rows lo and lo + 1 back (clamped to row 0), all columns scored elementwise. Its
    base was a buffer, cast with the model: in theta's dtype."""
    T = q.shape[2]
    targets = (0.5 + 1.0 * torch.sigmoid(theta)) * torch.tensor(rungs(base, T), dtype=theta.dtype)
    cols = window_columns(k, v, window)
    used = {d for _, _, d in cols}
    for t in targets:
        lo = int(torch.floor(t).item())
        if int(torch.round(t).item()) <= window or lo > T - 1 or lo in used:
            continue
        used.add(lo)
        f = t - lo
        cols.append(((1 - f) * back(k, lo) + f * back(k, lo + 1), (1 - f) * back(v, lo) + f * back(v, lo + 1), lo))
    return attend_study_columns(q, cols)


def back(x, d):
    """Row i - d of x (B, H, T, D) at every row i, clamped to row 0."""
    return x.index_select(2, (torch.arange(x.shape[2]) - d).clamp(min=0))


def window_columns(k, v, window):
    """(key, value, first valid query) of the window's distances 0..W, capped at T - 1."""
    return [(back(k, d), back(v, d), d) for d in range(min(window, k.shape[2] - 1) + 1)]


def attend_study_columns(q, cols):
    """The study's materialized scoring, shared by its learned and blur paths: the columns'
    keys and values stacked, each score an elementwise product summed, -1e9 where a query
    precedes a column's first row."""
    T, D = q.shape[2], q.shape[3]
    keys, values = torch.stack([c[0] for c in cols], 3), torch.stack([c[1] for c in cols], 3)
    scores = (q.unsqueeze(3) * keys).sum(-1) * D**-0.5
    valid = torch.arange(T)[:, None] >= torch.tensor([c[2] for c in cols])[None, :]
    p = torch.softmax(scores.masked_fill(~valid.view(1, 1, T, -1), -1e9), -1)
    return (p.unsqueeze(-1) * values).sum(3)


def study_attention(cfg, w, layer, q, k, v):
    """The attention of the study's layer `layer` on its queries and repeated keys and values."""
    if cfg.schedule == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    if cfg.schedule == "learned":
        return study_learned(q, k, v, w[f"blocks.{layer}.attn.theta"], cfg.base, cfg.window)
    alpha = ramp_alphas(cfg.schedule, cfg.n_layers)[layer]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=study_mask(cfg.base, cfg.window, q.shape[2], alpha),
                                          dropout_p=0.0, is_causal=False)


def study_logits(w, cfg, x, attention=study_attention):
    """The study's transformer on tokens x, (B, T, V) in the weights' dtype. `attention`
    (cfg, w, layer, q, k, v): its layer's attention (the probe's is another)."""
    B, T = x.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = F.embedding(x, w["embed.weight"])
    for l in range(cfg.n_layers):
        p = f"blocks.{l}."
        a = study_rms(h, w[p + "norm1.weight"], cfg.norm_eps)
        q = F.linear(a, w[p + "attn.wq.weight"]).view(B, T, H, D).transpose(1, 2)
        k = F.linear(a, w[p + "attn.wk.weight"]).view(B, T, Hkv, D).transpose(1, 2)
        v = F.linear(a, w[p + "attn.wv.weight"]).view(B, T, Hkv, D).transpose(1, 2)
        q, k = study_rope(q, T, D, cfg.rope_theta), study_rope(k, T, D, cfg.rope_theta)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        out = attention(cfg, w, l, q, k, v)
        h = h + F.linear(out.transpose(1, 2).contiguous().view(B, T, -1), w[p + "attn.wo.weight"])
        a = study_rms(h, w[p + "norm2.weight"], cfg.norm_eps)
        h = h + F.linear(F.silu(F.linear(a, w[p + "ffn.w1.weight"])) * F.linear(a, w[p + "ffn.w3.weight"]),
                         w[p + "ffn.w2.weight"])
    return F.linear(study_rms(h, w["norm.weight"], cfg.norm_eps), w["embed.weight"])  # the tied head


def study_loss(w, cfg, x, y):
    """The language model's loss, in the logits' dtype (float32 under the study's autocast)."""
    return F.cross_entropy(study_logits(w, cfg, x).view(-1, cfg.vocab_size), y.reshape(-1))


def study_lr(step, tc):
    if step < tc.warmup_steps:
        return tc.lr * step / max(1, tc.warmup_steps)
    progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def study_windows(stream, seed, T, batch_size, count):
    """The study's first `count` training micro-batches on `stream`: it seeded numpy's global
    generator with the run's seed, drew each micro-batch's starts in one randint call below
    n - T - 1 (n the stream's length) and read windows of T + 1 tokens there; an evaluation
    put the generator's state back, so evaluations do not figure."""
    np.random.seed(seed)
    batches = []
    for _ in range(count):
        starts = np.random.randint(0, len(stream) - T - 1, size=(batch_size,))
        x = np.stack([stream[s:s + T].astype(np.int64) for s in starts])
        y = np.stack([stream[s + 1:s + T + 1].astype(np.int64) for s in starts])
        batches.append((torch.from_numpy(x), torch.from_numpy(y)))
    return batches


def study_training(weights, cfg, tc, batches):
    """The study's loop of tc.steps steps over `batches` (grad_accum per step): (step losses,
    gradient norms, final weights)."""
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    params = [w[n] for n in study_registration(cfg.n_layers, cfg.schedule == "learned")]
    assert len(params) == len(w)
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ], lr=tc.lr, betas=(tc.beta1, tc.beta2))
    batches, losses, norms = iter(batches), [], []
    for step in range(1, tc.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = study_lr(step, tc)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(tc.grad_accum):
            x, y = next(batches)
            loss = study_loss(w, cfg, x, y) / tc.grad_accum
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip).item())
        optimizer.step()
        losses.append(total)
    return losses, norms, {n: t.detach() for n, t in w.items()}


# ----------------------------------------------------------------------------- fibctl's trainer


def fibctl_training(data, tmp_path, monkeypatch, schedule, base, steps=STEPS, dtype=torch.float32):
    """fibctl's Trainer on the `mask` path, its model cast to `dtype`, `steps` steps (warm-up
    3): (its config, initial weights, the batches its sampler drew, step losses, gradient
    norms, final weights)."""
    monkeypatch.setattr(trainer_module, "default_impl", lambda device: "mask")
    config = micro_run("loop", schedule, steps=steps, warmup_steps=3)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, base=base, n_layers=LAYERS))
    trainer = Trainer(config, load_manifest(data), tmp_path / "run", NullReporter())
    assert {b.attn.impl for b in trainer.model.blocks} == {"mask"}
    return (config, *trained(trainer, dtype))


def trained(trainer, dtype=torch.float32):
    """Train `trainer` (a Trainer or ProbeTrainer, before its first step) for all its steps,
    its model cast to `dtype` first: (initial weights, the batches its sampler drew, step
    losses, gradient norms, final weights)."""
    before = list(trainer.model.parameters())
    trainer.model.to(dtype)  # in place: the optimizer holds the same parameters, its state still empty
    assert all(p is q for p, q in zip(before, trainer.model.parameters()))
    initial = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    batches, draw = [], trainer.sampler.next_batch

    def recorded(device="cpu"):
        x, y = draw(device)
        batches.append((x.contiguous(), y.contiguous()))  # the study's windows: two tensors
        return x, y

    trainer.sampler.next_batch = recorded
    losses, norms = [], []
    for trainer.step in range(1, trainer.tc.steps + 1):
        loss, norm = trainer.train_step()
        losses.append(loss)
        norms.append(norm)
    return initial, batches, losses, norms, trainer.model.state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("schedule,base", INTEGER)
def test_trainer_is_the_study_loop_bit_for_bit_on_the_mask_path(data, tmp_path, monkeypatch, schedule, base, dtype):
    """In float32 on the CPU, and in float64, the same weights and windows give the same
    losses, gradient norms and weights, bit for bit, after 10 clipped AdamW steps of 2
    micro-batches through warm-up and cosine. It needs the kv heads repeated as the study
    did (enable_gqa sums a kv head's gradient in another order), clipping over the study's
    parameter order, and in float64 the loss of float64 logits (float32 ones put 6 steps'
    losses up to 8e-7 from the study's) and the study's lr at the warm-up's last step (lr * 3 / 3
    was not 3e-3 there, and moved weights by 1e-16)."""
    config, initial, batches, losses, norms, weights = fibctl_training(data, tmp_path, monkeypatch, schedule, base,
                                                                       dtype=dtype)
    assert all(w.dtype == dtype for w in weights.values())
    study_losses, study_norms, study_weights = study_training(initial, config.model, config.train, batches)
    assert len(batches) == STEPS * config.train.grad_accum
    assert losses == study_losses
    assert norms == study_norms
    for name, w in study_weights.items():
        assert torch.equal(weights[name], w), name


def test_the_trainer_reads_the_windows_the_study_drew(data, tmp_path, monkeypatch):
    """The run's data seed and training stream give the study's micro-batches: the same
    window starts, in the same order, through 10 steps of 2 micro-batches (a generator of
    the sampler's own, numpy's legacy one, drawn as the study drew numpy's global one).
    Torch's generator, seeded alike, drew other starts."""
    config, _, batches, *_ = fibctl_training(data, tmp_path, monkeypatch, "fixed", "fib")
    stream = load_manifest(data).stream("train")
    study = study_windows(stream, config.data_seed, config.model.seq_len, config.train.batch_size, len(batches))
    assert len(batches) == STEPS * config.train.grad_accum
    for (x, y), (sx, sy) in zip(batches, study):
        assert torch.equal(x, sx) and torch.equal(y, sy)


@pytest.mark.parametrize("base", BASES)
def test_learned_trainer_is_the_study_loop_within_rounding(data, tmp_path, monkeypatch, base):
    """A learned layer on the `mask` path blends each rung's keys and values into whole
    copies and scores them in scaled_dot_product_attention (each kv head once); the study's
    materialized path interpolated per column and scored elementwise. In float32 the two
    agree to rounding, not to the bit. Measured (torch 2.13, the CPU, 10 steps as above):
    step losses within 9.5e-7 (fib) and 2.9e-6 (pow2), gradient norms within 5.9e-7 and
    5.5e-6 of theirs, theta within 1.1e-7 and 3.1e-7, every weight within 4.8e-5 and 1.3e-4
    (AdamW's update is near lr wherever a gradient element is near 0, and rounding moves
    those most); the study's own loop run in float64 lies as far from either (its weights
    1.7e-5 and 4.4e-4 from the study's float32 ones). The bounds below leave a margin of
    about 4 over those figures."""
    learned_within(fibctl_training(data, tmp_path, monkeypatch, "learned", base),
                   loss=1e-5, norm=2e-5, theta=1e-6, weight=5e-4)


def learned_within(trained, *, loss, norm, theta, weight):
    """fibctl's learned training (fibctl_training's result) beside the study's loop on the
    same initial weights and batches: losses within `loss`, gradient norms within `norm`
    (relative), thetas within `theta` and every other weight within `weight`."""
    config, initial, batches, losses, norms, weights = trained
    study_losses, study_norms, study_weights = study_training(initial, config.model, config.train, batches)
    assert losses == pytest.approx(study_losses, rel=0, abs=loss)
    assert norms == pytest.approx(study_norms, rel=norm)
    for name, w in study_weights.items():
        bound = theta if name.endswith("theta") else weight
        torch.testing.assert_close(weights[name], w, rtol=0, atol=bound, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("base", BASES)
def test_learned_trainer_in_float64_is_the_study_loop_to_float64_rounding(data, tmp_path, monkeypatch, base):
    """In float64 the learned path's other order of sums (see above) is all that separates
    the two, at float64's rounding. Measured (torch 2.13, the CPU, the 10 steps above; fib,
    then pow2): step losses within 1.8e-15 and 7.1e-15, gradient norms within 1.3e-15 and
    1.2e-14 of theirs (relative), theta within 1.5e-16 and 4.3e-16 (alpha within 2.3e-16,
    having moved 3e-3 from 1), every weight within 8.0e-14 and 3.3e-13. The bounds are about
    10 times those."""
    learned_within(fibctl_training(data, tmp_path, monkeypatch, "learned", base, dtype=torch.float64),
                   loss=7e-14, norm=1.2e-13, theta=5e-15, weight=3e-12)


def spread_model(cfg, dtype):
    """A model of `cfg` on the `mask` path in `dtype`, seeded, its learned layers' theta drawn
    from (-2, 2) (alphas 0.62 to 1.38) so that their rungs are fractional."""
    torch.manual_seed(0)
    model = FibLM(cfg, "mask").to(dtype)
    if cfg.schedule == "learned":
        with torch.no_grad():
            for block in model.blocks:
                block.attn.theta.uniform_(-2, 2)
    return model


@pytest.mark.parametrize("schedule,base", EVERY)
def test_float64_logits_and_gradients_are_the_study_models(schedule, base):
    """One forward and backward of the `mask` path in float64 beside the study's model on the
    same weights and tokens, the learned layers' alphas spread over 0.62 to 1.38: every
    integer schedule and dense gives its logits and every gradient bit for bit; learned
    ones, to float64's rounding. Measured (fib, then pow2): logits within 1.3e-14 and
    1.0e-14 (of logits up to 5), gradients within 2.4e-15 and 8.9e-16. The bounds are about
    10 times those."""
    cfg = dataclasses.replace(micro_run("f64", schedule).model, base=base, n_layers=LAYERS)
    model = spread_model(cfg, torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    w = {n: t.detach().clone().requires_grad_() for n, t in model.state_dict().items()}
    study = study_logits(w, cfg, x)
    F.cross_entropy(study.flatten(0, 1), y.flatten()).backward()
    exact = schedule != "learned"
    torch.testing.assert_close(logits, study, rtol=0, atol=0 if exact else 1.5e-13)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, w[name].grad, rtol=0, atol=0 if exact else 2.5e-14,
                                   msg=lambda m: f"{name}: {m}")
