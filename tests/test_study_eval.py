"""fibctl's evaluation beside the study's three evaluators, transcribed (docs/method.md,
"Evaluation" and "Where fibctl differs": "A budget that is not a whole number of windows", "A
held-out stream shorter than the budget").

The transcription below follows the study's evaluators and shares no code with fibctl: its
model is tests/test_study_loop.py's transcription of the study's. All three read windows of T
inputs and their T targets at stride T from the start of a stream while T + 1 tokens remain,
put them into batches and, once whole batches have scored at least the budget's tokens, read
no further. The training-time one reads batches of 8 and starts its windows below
min(N, n - T - 1); the length-extrapolation one reads batches of 8, 4, 2 and 1 at T = 1,024,
2,048, 4,096 and 8,192 and of 1 elsewhere, and skips a stream of fewer than T + 2 tokens;
both add each batch's mean cross-entropy times its tokens to a Python float, and the
perplexity is exp of that sum over the tokens. The position-loss one reads batches of 8,
scores the first T - 1 positions of each window in float32 (its logits cast so), adds each
batch's sum over its windows, in float32, to a float64 sum per position and divides by the
windows; Table 4 bins those means into 8 with edges linspace(0, T - 1, 9) cast to integers.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sqlalchemy import insert

from fibctl import metrics
from fibctl import model as model_module
from fibctl.db import schema
from fibctl.db.engine import connect
from fibctl.errors import FibctlError
from fibctl.metrics import eval_windows, load_model, stream_loss
from fibctl.model import LOSS_TOKENS
from fibctl.reports import tables
from test_reports import add_run
from test_study_loop import LAYERS, spread_model, study_logits
from train_helpers import micro_run

torch.set_num_threads(1)
TRAINING_BATCH = POSITION_BATCH = 8  # train.py's eval_batch_size, posloss.py's --batch_size
EXTRAPOLATION_BATCH = {1024: 8, 2048: 4, 4096: 2, 8192: 1}  # lenextrap.py's, by length; 1 elsewhere
CASES = [("fixed", "fib"), ("stagger", "pow2"), ("coprime", "fib"), ("dense", "fib"),
         ("learned", "fib"), ("learned", "pow2")]


# ----------------------------------------------------------------------------- the study's evaluators


def study_reading(n, T, budget, batch, evaluator):
    """The window starts the study's `evaluator` reads from a stream of n tokens, batch by batch."""
    if evaluator == "training":  # its starts stop below min(N, n - T - 1)
        end = min(budget, n - T - 1)
    else:  # while a window's T + 1 tokens fit; the extrapolation skips a stream under T + 2
        end = 0 if evaluator == "extrapolation" and n < T + 2 else n - T
    scored, group = 0, []
    for start in range(0, max(end, 0), T):
        group.append(start)
        if len(group) == batch:
            yield group
            scored, group = scored + batch * T, []
        if scored >= budget:
            return
    if group:
        yield group


def study_batch(evaluator, T):
    if evaluator == "extrapolation":
        return EXTRAPOLATION_BATCH.get(T, 1)
    return TRAINING_BATCH if evaluator == "training" else POSITION_BATCH


def study_windows(stream, T, budget, evaluator):
    """(inputs, targets) of each batch the study's `evaluator` reads: (B, T) each."""
    for starts in study_reading(len(stream), T, budget, study_batch(evaluator, T), evaluator):
        tokens = torch.from_numpy(np.stack([stream[s:s + T + 1] for s in starts]).astype(np.int64))
        yield tokens[:, :-1], tokens[:, 1:]


def study_perplexity(w, cfg, stream, budget, evaluator="extrapolation"):
    """The training-time or length-extrapolation evaluator: (mean loss, perplexity, windows)."""
    total, count = 0.0, 0
    for x, y in study_windows(stream, cfg.seq_len, budget, evaluator):
        loss = F.cross_entropy(study_logits(w, cfg, x).view(-1, cfg.vocab_size), y.reshape(-1))
        total += loss.item() * x.numel()
        count += x.numel()
    return total / count, math.exp(total / count), count // cfg.seq_len


def study_position_loss(w, cfg, stream, budget, ce_dtype=torch.float32):
    """The position-loss evaluator: (mean loss at each of the first T - 1 positions, windows).
    Its logits cast to `ce_dtype`: float32, which widened its bf16 logits (as fibctl widens
    them) and narrows a float64 model's (ce_dtype float64 leaves that cast out)."""
    T = cfg.seq_len
    sums, windows = torch.zeros(T - 1, dtype=torch.float64), 0
    for x, _ in study_windows(stream, T, budget, "position"):  # it reads T tokens: x's own next ones
        logits = study_logits(w, cfg, x)[:, :-1].to(ce_dtype)
        ce = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), x[:, 1:].reshape(-1), reduction="none")
        sums += ce.view(len(x), T - 1).sum(0).double()
        windows += len(x)
    return sums / windows, windows


def study_bins(per_position):
    edges = np.linspace(0, len(per_position), 9, dtype=int)
    return [float(np.mean(per_position[a:b])) for a, b in zip(edges[:-1], edges[1:])]


# ----------------------------------------------------------------------------- beside fibctl's


@pytest.fixture(scope="module")
def stream():
    """Random tokens, more than the budget holds at every length (and its next token)."""
    return np.random.default_rng(3).integers(0, 512, 3_000).astype(np.uint16)


def models(schedule, base):
    """(the run's config, its float32 weights, the same in float64 for the transcription)."""
    config = micro_run("eval", schedule)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, base=base, n_layers=LAYERS))
    state = spread_model(config.model, torch.float32).state_dict()
    return config, state, {n: t.double() for n, t in state.items()}


def fibctl_eval(monkeypatch, config, state, stream, length, budget, chunked):
    """What `fibctl eval --positions` and the trainer compute: the run's weights in a model
    rebuilt at `length` (here on the `mask` path, in float64), its stream_loss; `chunked`,
    in batches of 3 windows (the study's were 8 or 1) and losses of 40 tokens at a time, as
    a long length would be (its memory bounded), else in one batch and one chunk."""
    monkeypatch.setattr(metrics, "default_impl", lambda device: "mask")
    monkeypatch.setattr(model_module, "LOSS_TOKENS", 40 if chunked else LOSS_TOKENS)
    model = load_model(config, state, length, torch.device("cpu")).double()
    assert {b.attn.impl for b in model.blocks} == {"mask"}
    return stream_loss(model, stream, length, budget, torch.device("cpu"), position_tokens=budget,
                       batch_tokens=3 * length if chunked else metrics.BATCH_TOKENS)


@pytest.mark.parametrize("schedule,base", CASES)
def test_evaluation_is_the_studys_evaluators_in_float64(stream, monkeypatch, schedule, base):
    """At T, 2T and 4T, a budget of 2,048 tokens (whole batches of every evaluator: 32, 16
    and 8 windows), fibctl's evaluation, in one batch or in batches and chunks, reads the
    windows the study's read and gives its mean loss, perplexity and per-position losses to
    float64's rounding: fibctl adds each position's losses over the windows and averages
    those sums, the study multiplied each batch's mean by its tokens, so the same losses are
    added in another order. Measured (torch 2.13, the CPU, the six cases): mean losses
    (about 6.3) within 1.8e-15, perplexities within 1.9e-15 (relative), per-position losses
    within 3.6e-15, bins within 1.8e-15; the bounds are about 10 times those. The study's
    float32 cast of the logits puts its per-position losses of a float64 model up to 9.7e-7
    from fibctl's (bound 1e-5)."""
    config, state, w = models(schedule, base)
    T, budget = config.model.seq_len, 2_048
    for length in (T, 2 * T, 4 * T):
        cfg = config.model.with_length(length)
        evaluators = ("training", "extrapolation") if length == T else ("extrapolation",)
        studied = [study_perplexity(w, cfg, stream, budget, evaluator) for evaluator in evaluators]
        per, windows = study_position_loss(w, cfg, stream, budget, torch.float64)
        narrowed, _ = study_position_loss(w, cfg, stream, budget)  # the study's float32 cast
        for chunked in (False, True):
            res = fibctl_eval(monkeypatch, config, state, stream, length, budget, chunked)
            for loss, ppl, read in studied:
                assert res.windows == read == budget // length
                assert res.loss == pytest.approx(loss, rel=0, abs=2e-14)
                assert math.exp(res.loss) == pytest.approx(ppl, rel=2e-14, abs=0)
            assert res.position_windows == windows == budget // length
            np.testing.assert_allclose(res.position_losses, per.numpy(), rtol=0, atol=4e-14)
            np.testing.assert_allclose(study_bins(res.position_losses), study_bins(per.numpy()), rtol=0, atol=2e-14)
            np.testing.assert_allclose(res.position_losses, narrowed.numpy(), rtol=0, atol=1e-5)


def windows_read(evaluator, n, T, budget):
    """(windows the study's `evaluator` reads, windows fibctl reads) from a stream of n tokens."""
    study = sum(len(g) for g in study_reading(n, T, budget, study_batch(evaluator, T), evaluator))
    try:
        return study, len(eval_windows(np.zeros(n, np.uint16), T, budget))
    except FibctlError:  # no window fits the budget
        return study, 0


LONG = 1_048_576 + 8 * 8_192 + 2  # a stream longer than every budget below


@pytest.mark.parametrize("evaluator,T,budget,study,fibctl", [
    ("training", 3_000, 1_048_576, 350, 349),  # T does not divide N: one window more
    ("extrapolation", 3_000, 1_048_576, 350, 349),
    ("position", 1_024, 500_000, 496, 488),  # a batch's tokens do not divide N: a batch more
    ("extrapolation", 1_024, 500_000, 496, 488),
    ("extrapolation", 2_048, 500_000, 248, 244),
    ("position", 1_024, 491_521, 488, 480),  # 491,521 to 499,712 tokens give the study 488
    ("position", 1_024, 499_712, 488, 488),
    ("position", 1_024, 499_713, 496, 488),
    ("extrapolation", 1_024, 1_024 * 9, 16, 9),  # T divides N: up to a batch less one window more
])
def test_a_budget_not_whole_batches_reads_the_documented_windows(evaluator, T, budget, study, fibctl):
    assert windows_read(evaluator, LONG, T, budget) == (study, fibctl)


@pytest.mark.parametrize("evaluator", ["training", "extrapolation", "position"])
@pytest.mark.parametrize("T", [64, 1_000, 1_024, 2_048, 3_000, 4_096, 8_192])
def test_the_study_reads_whole_batches_past_the_budget(evaluator, T):
    """Over budgets from one window to a few batches: the study reads b * ceil(N / bT) windows
    (b its batch; the training-time evaluator's starts stop below N, ceil(N / T)), fibctl
    N // T: the same where bT divides N, up to b - 1 more where T does, up to b more
    otherwise. The recorded budgets (262,144 and 1,048,576 tokens at 1,024, 2,048 and 4,096)
    are whole batches of every evaluator."""
    b = 1 if evaluator == "training" else study_batch(evaluator, T)
    for budget in [*range(T, 4 * b * T + 2, T // 7), *range(T, 4 * b * T + 1, T), 262_144, 1_048_576]:
        study, fibctl = windows_read(evaluator, LONG, T, budget)
        assert (study, fibctl) == (b * -(-budget // (b * T)), budget // T)
        extra = 0 if budget % (b * T) == 0 else b - 1 if budget % T == 0 else b
        assert 0 <= study - fibctl <= extra
        if T in (1_024, 2_048, 4_096) and budget in (262_144, 1_048_576):
            assert study == fibctl


@pytest.mark.parametrize("T", [64, 1_024])
def test_a_stream_shorter_than_the_budget(T):
    """A stream of n = kT + 1 tokens holds k windows: the length-extrapolation and
    position-loss evaluators read them all, as fibctl does; the training-time one, its starts
    below n - T - 1, one fewer. A stream of T + 1 tokens: fibctl and the position-loss
    evaluator read its window, the other two skip the stream."""
    for k in (1, 2, 9, 17):
        n = k * T + 1
        assert windows_read("training", n, T, 10 * n) == (k - 1, k)
        assert windows_read("extrapolation", n, T, 10 * n) == (0 if k == 1 else k, k)
        assert windows_read("position", n, T, 10 * n) == (k, k)



@pytest.mark.parametrize("T", [12, 64, 100, 1_024])
def test_table4_bins_positions_as_the_study_binned_them(tmp_path, T):
    """Table 4's SQL bins a run's T - 1 position losses as the study binned them: 8 bins
    with edges linspace(0, T - 1, 9) cast to integers, each the mean of its positions (to
    float64's rounding: SQL adds them in another order than numpy's pairwise mean; measured
    within 6.7e-16, relative, on SQLite)."""
    engine = connect(str(tmp_path / "r.db"))
    losses = {s: np.random.default_rng(i).uniform(1, 8, T - 1) for i, s in enumerate(("fixed", "stagger"))}
    with engine.begin() as conn:
        for schedule, per in losses.items():
            rid = add_run(conn, schedule, schedule, T=T)
            conn.execute(insert(schema.PositionLoss), [
                dict(run_id=rid, step=600, dataset="docs_val", eval_length=T, position=p, mean_loss=float(v),
                     windows=8) for p, v in enumerate(per)])
    frame = tables.table4(engine, dataset="docs_val").frame.set_index("Row")
    edges = np.linspace(0, T - 1, 9, dtype=int)
    bins = [c for c in frame.columns if c != "Run"]
    assert bins == [f"{a}-{b - 1}" for a, b in zip(edges[:-1], edges[1:])]
    for schedule, per in losses.items():
        np.testing.assert_allclose(frame.loc[f"{schedule} W8", bins].astype(float), study_bins(per), rtol=7e-15)
