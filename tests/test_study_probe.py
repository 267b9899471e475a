"""fibctl's probe trainer beside the study's probe loop (Table 2), transcribed (docs/method.md,
"Table 2: the mechanism probe" and "Rounding, not the function").

The transcription shares the study's transformer with tests/test_study_loop.py and adds, in
the project's words, what the study's probe changed: every layer attends to its window
exactly and, for each Fibonacci number past the window, to one column of a Gaussian band of
rows around alpha * b_k (its middle rounded on the host, its radius ceil(2.5 w), its offsets
clamped to [1, T - 1], its weights normalised), all columns scored elementwise; the width
blended from 40 to 0.5 over the first 80 % of the steps; the targets of the marked
shift-copy; a staggered start's theta; and a loop of torch's AdamW with its defaults but lr
1e-3, no clipping, a constant lr, and the loss of the logits cast to float32. Both start
from fibctl's initial weights and read the batches fibctl's sampler drew. The study's code
computed its bands' weights and its loss in float32 in a float64 model too; `as_coded`
False computes them in the model's dtype, the study's function in float64 throughout.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fibctl.probe.cells import probe_runs
from fibctl.probe.trainer import ProbeTrainer
from test_study_loop import attend_study_columns, study_logits, trained, window_columns
from test_transformer_by_hand import FIB
from train_helpers import NullReporter

torch.set_num_threads(1)
STEPS = 10  # the width anneals over 8 of them: 40, 35.06, ..., 0.5 at the last two


# ----------------------------------------------------------------------------- the study's probe


def study_blur(q, k, v, theta, window, width, as_coded=True):
    """The study's blur attention of one layer. Its Fibonacci numbers were a buffer, cast with
    the model (theta's dtype). `as_coded`: a band's weights in float32 whatever that dtype, as
    the study's code computed them (float32 offsets less a 0-dim centre stay float32); else
    in theta's dtype."""
    T = q.shape[2]
    width = max(width, 0.25)
    R = math.ceil(2.5 * width)
    rows = torch.arange(T)
    centres = (0.5 + 1.0 * torch.sigmoid(theta)) * torch.tensor([b for b in FIB if b > window], dtype=theta.dtype)
    cols = window_columns(k, v, window)
    for centre in centres:
        middle = round(float(centre.detach()))
        if middle <= window or middle > T - 1:
            continue
        offsets = torch.arange(middle - R, middle + R + 1).clamp(1, T - 1)
        band = torch.exp(-0.5 * ((offsets.to(torch.float32 if as_coded else theta.dtype) - centre) / width) ** 2)
        band = (band / band.sum())[None, None, :, None]
        at = (rows[:, None] - offsets[None, :]).clamp(min=0)  # (T, 2R + 1): the rows each query mixes
        cols.append(((band * k[:, :, at]).sum(3), (band * v[:, :, at]).sum(3), middle))
    return attend_study_columns(q, cols)


def study_blur_attention(width, as_coded):
    def attention(cfg, w, layer, q, k, v):
        return study_blur(q, k, v, w[f"blocks.{layer}.attn.theta"], cfg.window, width, as_coded)

    return attention


def study_targets(x, distances, vocab):
    """The marked shift-copy's targets from its inputs: x_{t - d} for the distance d whose
    marker x_t carries, -100 where t < d."""
    payloads, T = vocab // len(distances), x.shape[1]
    marker, t = x // payloads, torch.arange(T)
    y = torch.full_like(x, -100)
    for j, d in enumerate(distances):
        y = torch.where((marker == j) & (t[None, :] >= d), x.index_select(1, (t - d).clamp(min=0)), y)
    return y


def study_start_thetas(L, staggered):
    """theta of each layer at the start: 0 (alpha 1), or the ramp clamped to [0.55, 1.45]."""
    if not staggered:
        return [0.0] * L
    alphas = [min(1.45, max(0.55, 0.5 + 1.0 * (l / (L - 1)) if L > 1 else 1.0)) for l in range(L)]
    return [math.log((a - 0.5) / (1.5 - a)) for a in alphas]


def study_probe_training(weights, cfg, batches, steps, as_coded=True):
    """The study's probe loop over `batches`, one a step: (step losses, final weights).
    `as_coded`: its band weights and its loss in float32 whatever the weights' dtype, as its
    code computed them (it cast its logits to float32); else in the weights' dtype."""
    w = {n: t.clone().requires_grad_() for n, t in weights.items()}
    optimizer = torch.optim.AdamW(list(w.values()), lr=1e-3)
    losses = []
    for s, (x, y) in zip(range(steps), batches):
        p = min(1.0, s / (0.8 * steps))
        logits = study_logits(w, cfg, x, study_blur_attention(40.0 * (1 - p) + 0.5 * p, as_coded))
        logits = logits.float() if as_coded else logits
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: t.detach() for n, t in w.items()}


# ----------------------------------------------------------------------------- fibctl's probe


def probe_trainer(tmp_path, init, depth=3):
    """A probe run of STEPS steps at length 64, distances 20 and 35, d_model 64."""
    run = probe_runs(depths=(depth,), inits=(init,), seeds=(0,), steps=STEPS, length=64, distances=(20, 35))[0]
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, d_model=64))
    return ProbeTrainer(run, tmp_path, NullReporter())


def differences(losses, weights, study_losses, study_weights) -> dict[str, float]:
    """The largest difference of the step losses, the weights (theta apart), the thetas and
    the alphas."""
    thetas = [n for n in weights if n.endswith("theta")]
    alpha = lambda w: [0.5 + torch.sigmoid(w[n]).item() for n in thetas]  # noqa: E731
    return {"loss": max(abs(a - b) for a, b in zip(losses, study_losses, strict=True)),
            "weights": max((weights[n] - study_weights[n]).abs().max().item() for n in weights if n not in thetas),
            "theta": max((weights[n] - study_weights[n]).abs().max().item() for n in thetas),
            "alpha": max(abs(a - b) for a, b in zip(alpha(weights), alpha(study_weights)))}


def within(measured: dict[str, float], bounds: dict[str, float]) -> bool:
    return all(measured[k] <= bounds[k] for k in bounds)


def fibctl_probe(tmp_path, init, dtype):
    """fibctl's probe run, in `dtype`, started at the study's thetas: (config, initial weights,
    batches, step losses, final weights)."""
    trainer = probe_trainer(tmp_path, init)
    want = study_start_thetas(trainer.config.model.n_layers, init == "staggered")
    assert [b.attn.theta.item() for b in trainer.model.blocks] == [float(torch.tensor(t)) for t in want]
    initial, batches, losses, _, weights = trained(trainer, dtype)
    config = trainer.config
    assert len(batches) == STEPS  # one batch a step, as the study's loop drew them
    for x, y in batches:
        assert torch.equal(y, study_targets(x, config.probe.distances, config.model.vocab_size))
    return config, initial, batches, losses, weights


@pytest.mark.parametrize("init", ["uniform", "staggered"])
def test_probe_trainer_in_float64_is_the_study_probe_loop(tmp_path, init):
    """In float64, fibctl's probe trainer (its fast blur path sums in another order, its fused
    AdamW rounds otherwise) beside the study's probe loop, 10 steps through the whole width anneal,
    3 layers, from the study's start. The study's code left two things in float32 whatever
    the model's dtype: its bands' weights and its loss (of logits cast to float32); fibctl
    computes both in the model's dtype, as the study's function in float64 throughout does.
    Measured (torch 2.13, the CPU; uniform, then staggered), beside the function in float64
    throughout: step losses within 1.8e-15 and 2.7e-15, weights within 5.2e-15 and 4.2e-14,
    thetas within 1.0e-17 and 8.7e-18, alphas equal; beside the code as written, its float32
    islands, as far as float32 rounding: losses within 7.7e-7 and 8.3e-7, weights within
    1.9e-6 and 6.0e-6, thetas within 5.5e-9 and 6.0e-9, alphas within 1.4e-9 and 4.3e-10.
    The bounds are about 10 times those."""
    config, initial, batches, losses, weights = fibctl_probe(tmp_path, init, torch.float64)
    throughout = differences(losses, weights, *study_probe_training(initial, config.model, batches, STEPS, False))
    assert within(throughout, {"loss": 3e-14, "weights": 5e-13, "theta": 1e-16, "alpha": 2.3e-16}), throughout
    as_coded = differences(losses, weights, *study_probe_training(initial, config.model, batches, STEPS, True))
    assert within(as_coded, {"loss": 1e-5, "weights": 6e-5, "theta": 6e-8, "alpha": 1.5e-8}), as_coded


@pytest.mark.parametrize("init", ["uniform", "staggered"])
def test_probe_trainer_in_float32_is_the_study_probe_loop_within_rounding(tmp_path, init):
    """The same in float32, where the study's code and its function are one: fibctl's other
    order of operations moves the numbers by float32 rounding. Measured (uniform, then staggered):
    step losses within 9.5e-7 and 2.4e-6, weights within 1.1e-5 and 8.5e-5, thetas within
    8.4e-9 and 3.8e-8, alphas equal. The bounds are about 10 times those (the weights': 4)."""
    config, initial, batches, losses, weights = fibctl_probe(tmp_path, init, torch.float32)
    measured = differences(losses, weights, *study_probe_training(initial, config.model, batches, STEPS))
    assert within(measured, {"loss": 2.5e-5, "weights": 3.5e-4, "theta": 4e-7, "alpha": 1e-7}), measured
