"""The mechanism probe (Table 2): the task, the blur attention (fast paths held to the
reference), the alphas' start, the width schedule, and the pipeline queue -> worker -> table2."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import text
from torch.utils._python_dispatch import TorchDispatchMode

from fibctl.config import ConfigError, ProbeConfig, RunConfig, get_preset
from fibctl.db.engine import connect
from fibctl.flows.worker import WorkerOptions, train_named
from fibctl.model import FibLM
from fibctl.probe import blur as blur_module
from fibctl.probe.blur import blur_attention
from fibctl.probe.cells import probe_runs
from fibctl.probe.task import IGNORE, MarkedBatches, MarkedCopy, heldout_generator
from fibctl.probe.trainer import ProbeTrainer
from fibctl.queue import add_runs
from fibctl.reports import tables
from fibctl.schedules import FIB, blur_rungs, probe_alphas
from fibctl.train.checkpoint import load_checkpoint
from cli_helpers import refused
from train_helpers import NullReporter, Quiet

REPO = Path(__file__).resolve().parent.parent
WIDTHS = (40, 10, 2.5, 1, 0.5, 0.25)


# ----------------------------------------------------------------------------- the task


def test_marked_copy_targets_are_the_token_its_marker_names():
    task = MarkedCopy(512, 64, (20, 35))
    x, y = task.sample(3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 64) and int(x.max()) < 512
    marker = task.marker(x)
    assert set(marker.unique().tolist()) == {0, 1}
    for b in range(3):
        for t in range(64):
            d = (20, 35)[int(marker[b, t])]
            assert int(y[b, t]) == (int(x[b, t - d]) if t >= d else IGNORE)
    again = task.sample(3, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)  # seeded: the same batches


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1])
def test_held_out_sequences_share_no_payload_row_with_training_batches(seed):
    """Seeded data_seed + 2**32, the scoring generator replayed the training stream (torch reads
    a seed's low 32 bits): 8 of the 16 scored payload rows were those of training steps 1-4."""
    task = MarkedCopy(512, 512, (200, 350))
    held, _ = task.sample(16, heldout_generator(seed))
    batches = MarkedBatches(task, 2, seed)
    trained = {tuple((x % task.payloads).tolist()) for _ in range(50) for x in batches.next_batch()[0]}
    assert not {tuple((x % task.payloads).tolist()) for x in held} & trained


@pytest.mark.parametrize("change, message", [
    (dict(distances=(200, 512)), "distance 512 must be from 1"),
    (dict(distances=(0, 200)), "distance 0 must be from 1"),
    (dict(init="ramp"), "unknown probe init"),
    (dict(eval_sequences=0), "eval_sequences"),
])
def test_probe_config_refuses_bad_values(change, message):
    model = get_preset("probe").model
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(ProbeConfig(), **change).validate(model)
    with pytest.raises(ConfigError, match="not divisible by the 3 distances"):
        ProbeConfig(distances=(100, 200, 300)).validate(model)


def test_width_anneals_from_40_to_half_over_80_percent_then_holds():
    p = ProbeConfig()
    assert p.width_at(0, 2500) == 40
    assert p.width_at(1000, 2500) == pytest.approx(40 - 39.5 * 1000 / 2000)
    assert p.width_at(2000, 2500) == p.width_at(2500, 2500) == 0.5
    assert dataclasses.replace(p, width_end=0.25).width_at(2500, 2500) == 0.25


def test_width_is_the_study_blend_whose_last_bit_sets_the_band_radius():
    """The study blended the two widths, 40 (1 - p) + 0.5 p. At 395 steps, step 129 (p =
    128 / 316) gives 24.000000000000004 that way and exactly 24 as 40 - 39.5 p: the band
    radius ceil(2.5 w) is 61 offsets, not 60, so the band itself differs."""
    w = ProbeConfig().width_at(128, 395)
    assert w == 24.000000000000004 and math.ceil(2.5 * w) == 61


def test_the_first_step_trains_at_the_starting_width(tmp_path):
    """As in the study's probe: step s (from 1) trains at the width after s - 1 steps, 40 at
    step 1 (not 40 - 39.5 / 2000), and the model is scored at the last step's width."""
    run = small_runs(steps=5)[0]
    trainer = ProbeTrainer(run, tmp_path, NullReporter())
    widths = []
    set_width = trainer.model.set_blur_width
    trainer.model.set_blur_width = lambda w: (widths.append(w), set_width(w))
    assert trainer.run().status == "done"
    p = run.probe
    assert widths[:5] == [p.width_at(s, 5) for s in range(5)] and widths[0] == p.width_start
    assert widths[5:] == [p.width_at(4, 5)]


def test_the_probe_recipe_does_not_clip():
    """grad_clip 0 means no clipping: an infinite bound, which leaves gradients as they are."""
    assert get_preset("probe").train.clip_bound == math.inf and get_preset("tiny").train.clip_bound == 1.0
    grads = [torch.tensor([3.0, 4.0])]
    params = [torch.zeros(2, requires_grad=True)]
    params[0].grad = grads[0].clone()
    assert float(torch.nn.utils.clip_grad_norm_(params, get_preset("probe").train.clip_bound)) == 5.0
    assert torch.equal(params[0].grad, grads[0])


def test_staggered_start_is_the_ramp_clamped():
    assert probe_alphas("uniform", 4) == [1.0] * 4
    assert probe_alphas("staggered", 2) == [0.55, 1.45]
    assert probe_alphas("staggered", 4) == pytest.approx([0.55, 0.5 + 1 / 3, 0.5 + 2 / 3, 1.45])
    assert probe_alphas("staggered", 1) == [1.0]


def test_blur_rungs_keep_centres_past_the_window_and_inside_the_length():
    base = FIB[:15]
    assert blur_rungs(base, [1.0 * b for b in base], 8, 512) == [(k, b) for k, b in enumerate(base) if 8 < b <= 511]
    assert blur_rungs([13, 21, 377, 610], [8.4, 8.6, 511.4, 511.6], 8, 512) == [(1, 9), (2, 511)]


def test_blur_rungs_scale_only_base_values_past_the_window():
    """The study's probe drops b_k <= W before scaling: at alpha 1.45, b = 8 lands on 11.6, past
    W = 8, and is still not a rung (the integer rule of the language models would keep it)."""
    base = FIB[:15]
    kept = blur_rungs(base, [1.45 * b for b in base], 8, 512)
    assert [base[k] for k, _ in kept] == [13, 21, 34, 55, 89, 144, 233]
    assert [c for _, c in kept][:2] == [19, 30]


# ----------------------------------------------------------------------------- blur attention


def _blur(T, width, impl, alpha=1.13, dtype=torch.float64, B=1, H=4, Hkv=2, D=8):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(B, H, T, D, dtype=dtype, generator=g)
    k, v = (torch.randn(B, Hkv, T, D, dtype=dtype, generator=g) for _ in range(2))
    theta = torch.tensor(math.log((alpha - 0.5) / (1.5 - alpha)), dtype=dtype, requires_grad=True)
    centres = (0.5 + torch.sigmoid(theta)) * torch.tensor(FIB[:15], dtype=dtype)
    kept = blur_rungs(FIB[:15], centres.detach().tolist(), 8, T)
    idx = torch.tensor([i for i, _ in kept], dtype=torch.long)
    out = blur_attention(q, k, v, list(range(min(8, T - 1) + 1)), [c for _, c in kept], centres[idx], width, impl)
    weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
    if kept:
        (out * weights).sum().backward()
    return out.detach(), theta.grad


@pytest.mark.parametrize("T, alpha", [(T, a) for T in (1, 2, 9, 10, 14, 100) for a in (0.55, 0.98, 1.13, 1.45)]
                         # 0.98 * 610 = 598: the farthest band clamped at T-1 = 599
                         + [(378, 1.13), (600, 0.98)])
def test_fast_blur_equals_the_reference_in_output_and_theta_gradient(T, alpha):
    for width in WIDTHS:
        ref_out, ref_grad = _blur(T, width, "reference", alpha=alpha)
        out, grad = _blur(T, width, "fast", alpha=alpha)
        assert (out - ref_out).abs().max() <= 1e-5, width
        if ref_grad is None:  # no rung fits at this length: no gradient to alpha
            assert grad is None
        else:
            assert abs(float(grad - ref_grad)) <= 1e-5 * max(1.0, abs(float(ref_grad))), width


@pytest.mark.parametrize("T", [14, 30, 100])
def test_fast_blur_in_query_blocks_equals_the_reference(T, monkeypatch):
    # blocks of 4 and 7 queries: partial last blocks, and bands reaching past a block's keys
    for block in (4, 7):
        monkeypatch.setattr(blur_module, "BLUR_BLOCK", block)
        for width in WIDTHS:
            ref_out, ref_grad = _blur(T, width, "reference")
            out, grad = _blur(T, width, "fast")
            assert (out - ref_out).abs().max() <= 1e-5, (block, width)
            if ref_grad is None:  # no rung fits at this length
                assert grad is None
            else:
                assert abs(float(grad - ref_grad)) <= 1e-5 * max(1.0, abs(float(ref_grad))), (block, width)


def test_fast_blur_in_float32_at_the_probe_shape():
    for width in (40, 0.5):
        ref_out, ref_grad = _blur(512, width, "reference", dtype=torch.float32, D=64)
        out, grad = _blur(512, width, "fast", dtype=torch.float32, D=64)
        assert (out - ref_out).abs().max() <= 1e-5
        assert abs(float(grad - ref_grad)) <= 1e-5 * max(1.0, abs(float(ref_grad)))


@pytest.mark.parametrize("alpha", [0.55, 1.13])
def test_fast_blur_far_past_the_bands_reach_equals_the_reference(alpha):
    """At T = 1,500 every band ends well before the last queries (0.55: the farthest offset
    543 + R; 1.13: 1,115 + R), so most query blocks score only the key rows their offsets
    reach, and the last block is a partial one."""
    for width in (40, 2.5, 0.25):
        ref_out, ref_grad = _blur(1500, width, "reference", alpha=alpha)
        out, grad = _blur(1500, width, "fast", alpha=alpha)
        assert (out - ref_out).abs().max() <= 1e-5, width
        assert abs(float(grad - ref_grad)) <= 1e-5 * max(1.0, abs(float(ref_grad))), width


class _Sizes(TorchDispatchMode):
    """The most elements of any tensor an op makes while active, forward and backward."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def _blur_memory(T: int, width: float = 2.5) -> tuple[int, int]:
    """(the largest tensor in elements, bytes kept for the backward) of a forward and backward
    of the fast path at length T, rungs 13 to 89 at alpha 1.13: every band within offset 109."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, T, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, T, 8, generator=g, requires_grad=True) for _ in range(2))
    theta = torch.tensor(math.log(0.63 / 0.37), requires_grad=True)
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    sizes = _Sizes()
    with sizes, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        centres = (0.5 + torch.sigmoid(theta)) * torch.tensor(FIB[:10])
        kept = blur_rungs(FIB[:10], centres.detach().tolist(), 8, T)
        idx = torch.tensor([i for i, _ in kept])
        out = blur_attention(q, k, v, list(range(9)), [c for _, c in kept], centres[idx], width, "fast")
        out.sum().backward()
    assert theta.grad is not None and len(kept) == 5
    return sizes.most, sum(storages.values())


def test_fast_blur_memory_grows_linearly_with_the_length():
    """`fibctl probe --length 65536` was queued, then its worker failed asking for 32 GiB: the
    fast path built a T x T table of key rows by offset (int64), and kept every query block's
    scores against all the key rows before it, O(T^2) for the backward. It scores each block
    against only the rows its offsets reach: at 4x the length, 4x the memory, not 16x (6: a
    generous margin), and no tensor of T x T elements."""
    most, saved = _blur_memory(512)
    most4, saved4 = _blur_memory(2048)
    assert most4 < 2048 * 2048
    assert most4 <= 6 * most and saved4 <= 6 * saved, (most, most4, saved, saved4)


def test_the_model_attends_through_blur_rungs_only_when_asked():
    cfg = dataclasses.replace(get_preset("probe").model, n_layers=2, seq_len=64, d_model=32, n_heads=4)
    torch.manual_seed(0)
    fast, ref = FibLM(cfg), FibLM(cfg, impl="reference")
    ref.load_state_dict(fast.state_dict())
    x = torch.randint(0, 512, (2, 64))
    plain = fast(x)
    for model in (fast, ref):
        model.set_blur_width(2.5)
    assert not torch.allclose(fast(x), plain)  # blur rungs are not the fractional ones
    assert (fast(x) - ref(x)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="learned"):
        FibLM(dataclasses.replace(cfg, schedule="fixed")).set_blur_width(1.0)


@pytest.mark.parametrize("width", [40, 2.5, 0.5])
def test_the_band_weights_carry_the_loss_gradient_to_theta(width):
    """Autograd's d loss / d theta of a whole probe model equals central finite differences
    (float64): the gradient is the loss's own, reaching alpha through the band's weights."""
    cfg = dataclasses.replace(get_preset("probe").model, n_layers=2, seq_len=64, d_model=32, n_heads=4)
    torch.manual_seed(0)
    model = FibLM(cfg).double()
    with torch.no_grad():  # alphas 0.83 and 1.17: no centre near a rounding boundary
        for block, alpha in zip(model.blocks, (0.83, 1.17)):
            block.attn.theta.fill_(math.log((alpha - 0.5) / (1.5 - alpha)))
    model.set_blur_width(width)
    x, y = MarkedCopy(512, 64, (20, 35)).sample(2, torch.Generator().manual_seed(1))

    def loss():
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    loss().backward()
    for block in model.blocks:
        theta, eps = block.attn.theta, 1e-6
        with torch.no_grad():
            theta += eps
            up = float(loss())
            theta -= 2 * eps
            down = float(loss())
            theta += eps
        numeric = (up - down) / (2 * eps)
        assert abs(numeric) > 1e-6  # theta moves the loss: the test can tell a lost gradient
        assert float(theta.grad) == pytest.approx(numeric, rel=1e-5, abs=1e-9)


# ----------------------------------------------------------------------------- runs

SMALL = dict(length=64, distances=(20, 35))


def small_runs(steps=30, **train) -> list[RunConfig]:
    runs = probe_runs(depths=(2,), seeds=(0,), steps=steps, **SMALL)
    return [dataclasses.replace(r, train=dataclasses.replace(r.train, **train)) for r in runs]


def test_probe_runs_name_every_cell_and_refuse_bad_input():
    names = [r.name for r in probe_runs()]
    assert len(names) == 12 == len(set(names)) and names[0] == "probe_d2_uniform_s0"
    assert probe_runs(depths=(2,), seeds=(0,), steps=200)[0].name == "probe_d2_uniform_s0_200steps"
    assert small_runs()[0].name.startswith("probe_d2_uniform_s0_30steps_")  # another task, another name
    for bad, message in ((dict(depths=(0,)), "--depth 0"), (dict(steps=0), "--steps 0"),
                         (dict(distances=(200, 600)), "distance 600"), (dict(vocab=511), "not divisible"),
                         (dict(seeds=(-1,)), "--seed")):
        with pytest.raises(ConfigError, match=message):
            probe_runs(**bad)


def test_a_value_given_twice_is_one_cell():
    """--depth 2 --depth 2 made the same run twice and the insert failed with a traceback."""
    twice = probe_runs(depths=(2, 2), inits=("uniform", "uniform"), seeds=(0, 0))
    assert [r.name for r in twice] == ["probe_d2_uniform_s0"]
    assert [r.name for r in probe_runs(depths=(4, 2, 4), inits=("uniform",), seeds=(1, 0, 1))] == [
        "probe_d4_uniform_s1", "probe_d4_uniform_s0", "probe_d2_uniform_s1", "probe_d2_uniform_s0"]


def test_probe_config_round_trips_and_leaves_lm_hashes_alone():
    run = probe_runs()[0]
    assert RunConfig.from_dict(run.to_dict()) == run
    lm = RunConfig.resolve("x", "m", "tiny", schedule="fixed")
    assert "probe" not in lm.to_dict()


def test_probe_trainer_learns_alphas_and_scores_each_distance(tmp_path):
    run = small_runs(steps=20, eval_interval=10)[1]  # staggered
    logged = []

    class Keep(NullReporter):
        def log_metric(self, name, metric, value=None, text=None):
            logged.append((name, metric, value if text is None else text))

        def log_alphas(self, step, alphas):
            logged.append(("alphas", step, list(alphas)))

    trainer = ProbeTrainer(run, tmp_path, Keep())
    assert trainer.model.alphas() == pytest.approx([0.55, 1.45])
    assert trainer.run().status == "done"
    alphas = {step: a for kind, step, a in logged if kind == "alphas"}
    assert sorted(alphas) == [0, 10, 20] and alphas[20] != alphas[0]  # alpha is trained
    metrics = {m: v for name, m, v in logged if name == "marked_retrieval"}
    assert metrics["depth"] == 2 and metrics["staggered_init"] == 1 and metrics["eval_sequences"] == 16
    assert 0 <= metrics["acc_d20"] <= 1 and 0 <= metrics["acc_d35"] <= 1 and metrics["heldout_loss"] > 0
    assert metrics["task"] == f"length {run.model.seq_len}, vocab {run.model.vocab_size}, distances 20/35"


def test_a_distance_no_held_out_position_asks_for_has_no_accuracy(tmp_path, db_url):
    """At distance T-1 only position T-1 can ask; with one held-out sequence, a model whose
    position T-1 asks for the other distance scores nothing there. Its accuracy is none (NULL)
    on every backend: recorded as NaN, it was a number on PostgreSQL and made Table 2's mean
    over the seeds NaN, with no note. (The study's code divided by at least one position.)"""
    task = MarkedCopy(512, 64, (20, 63))
    asks = {seed: int(task.marker(task.sample(1, heldout_generator(seed))[0])[0, 63]) for seed in range(20)}
    scored, unscored = (next(s for s, k in asks.items() if k == want) for want in (1, 0))
    runs = probe_runs(depths=(2,), inits=("uniform",), seeds=(scored, unscored), steps=1, length=64,
                      distances=(20, 63), eval_sequences=1)
    assert ProbeTrainer(runs[1], tmp_path / "direct", NullReporter()).score()["acc_d63"] is None
    engine = connect(db_url)
    add_runs(engine, runs)
    opts = WorkerOptions(data_dir=tmp_path / "no-data", runs_dir=tmp_path / "runs")
    for run in runs:
        assert train_named(engine, run.name, opts, Quiet()).status == "done"
    with engine.connect() as conn:
        accs = dict(conn.execute(text("SELECT r.name, m.value FROM aux_metrics m JOIN runs r ON r.id = m.run_id "
                                      "WHERE m.metric = 'acc_d63'")).all())
    assert accs[runs[1].name] is None and accs[runs[0].name] in (0.0, 1.0)
    table = tables.table2(engine)
    assert table.frame["acc d=63"].tolist() == [accs[runs[0].name]] and table.frame["Seeds"].tolist() == [2]
    assert [n for n in table.notes if n.startswith("Fewer seeds")] == [
        "Fewer seeds: depth 2 uniform's acc d=63 is the mean over 1 of its 2 models (the others scored no "
        "position at that distance)."]
    engine.dispose()


def test_scoring_heartbeats_and_stops_when_the_run_is_taken_over(tmp_path, monkeypatch):
    """Scoring many held-out sequences sent no heartbeat: past worker --heartbeat-timeout
    (600 s: from about 20,000 sequences at depth 2 on one CPU core) another worker took the
    run over as abandoned while this one still scored it."""
    from fibctl.probe import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "SCORE_HEARTBEAT_S", 0.0)  # a heartbeat every batch
    [run] = small_runs(steps=1)[:1]
    run = dataclasses.replace(run, probe=dataclasses.replace(run.probe, eval_sequences=12))  # 3 batches
    beats, logged = [], []

    class Count(NullReporter):
        ours = True

        def heartbeat(self):
            beats.append(1)
            return self.ours

        def log_metric(self, name, metric, value=None, text=None):
            logged.append(metric)

    reporter = Count()
    trainer = ProbeTrainer(run, tmp_path, reporter)
    assert trainer.score()["eval_sequences"] == 12 and len(beats) >= 2
    beats.clear(), logged.clear()
    reporter.ours = False  # taken over: scoring stops at the next heartbeat, records nothing
    assert trainer.score() is None and trainer.lost and beats == [1] and logged == []


def test_blur_centres_follow_the_trained_alphas(tmp_path):
    """The probe's fused AdamW writes theta without bumping its version; each band must still
    be centred on round(alpha * b_k) of the alpha just trained, not of the starting one."""
    run = small_runs(steps=6, lr=0.3)[0]
    trainer = ProbeTrainer(run, tmp_path, NullReporter())
    assert trainer.run().status == "done"
    T, W, base = run.model.seq_len, run.model.window, [float(b) for b in FIB[:run.model.n_rungs]]
    start = [c for _, c in blur_rungs(base, base, W, T)]  # alpha 1
    moved = 0
    for block in trainer.model.blocks:
        centres, _ = block.attn.blur_columns(T)
        products = (block.attn.alpha.detach() * torch.tensor(base)).tolist()
        trained = [c for _, c in blur_rungs(base, products, W, T)]
        assert centres == trained
        moved += trained != start
    assert moved  # the run trained some alpha far enough to move a centre


@pytest.mark.parametrize("interval,failed", [
    (10, 2),  # step 2's update made theta NaN: step 3's blur rungs read it (a ValueError traceback)
    (1, 1),  # logged and checkpointed at every step: step 2's NaN alphas failed the insert (NOT NULL)
])
def test_a_probe_run_whose_alpha_goes_nan_fails_as_diverged(tmp_path, interval, failed):
    [run] = small_runs(steps=12, lr=1e30, eval_interval=interval, checkpoint_interval=interval)[:1]
    engine = connect(str(tmp_path / "r.db"))
    add_runs(engine, [run])
    opts = WorkerOptions(data_dir=tmp_path / "no-data", runs_dir=tmp_path / "runs")
    outcome = train_named(engine, run.name, opts, Quiet())
    said = f"step {failed + 1} gave an alpha of nan in layer 0"
    assert (outcome.status, outcome.step, outcome.error) == ("failed", failed, said)
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select error from runs").fetchall() == [(said,)]
    assert db.execute("select max(step) from alphas").fetchone() == (failed if interval == 1 else 0,)
    saved = sorted(p.name for p in (tmp_path / "runs" / run.name).glob("step_*"))
    assert saved == ([f"step_{failed:08d}.pt"] if interval == 1 else [])  # none of NaN weights


def _worker(tmp_path, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "fibctl", "worker", "--db", str(tmp_path / "r.db"),
                             "--runs-dir", str(tmp_path / "runs"), "--data", str(tmp_path / "no-data"),
                             "--plain", *extra], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_killed_probe_run_resumes_bit_exact(tmp_path):
    [run] = small_runs(steps=30, checkpoint_interval=10)[:1]
    uninterrupted = dataclasses.replace(run, name="uninterrupted")
    engine = connect(str(tmp_path / "r.db"))
    add_runs(engine, [run, uninterrupted])
    opts = WorkerOptions(data_dir=tmp_path / "no-data", runs_dir=tmp_path / "runs")
    assert train_named(engine, "uninterrupted", opts, Quiet()).status == "done"
    proc = _worker(tmp_path)
    first = tmp_path / "runs" / run.name / "step_00000010.pt"
    deadline = time.time() + 120
    while not first.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert train_named(engine, run.name, dataclasses.replace(opts, heartbeat_timeout_s=1e-9), Quiet()).status == "done"
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select count(*) from events e join runs r on r.id = e.run_id "
                      "where r.name = ? and kind = 'resumed'", (run.name,)).fetchone() == (1,)
    a, b = (load_checkpoint(tmp_path / "runs" / n / "step_00000030.pt")["model"] for n in (run.name, "uninterrupted"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    scores = "select m.metric, m.value from aux_metrics m join runs r on r.id = m.run_id where r.name = ? order by 1"
    assert db.execute(scores, (run.name,)).fetchall() == db.execute(scores, ("uninterrupted",)).fetchall()
    # each probe run's alpha trajectories, one panel per run
    figure = _fibctl(tmp_path, "figure", "alphas", "--db", "r.db", "--matrix", "probe", "-o", "alphas.png")
    assert figure.returncode == 0 and (tmp_path / "alphas.png").stat().st_size > 10_000, figure.stderr


def _fibctl(tmp_path, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "fibctl", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _refused(tmp_path, monkeypatch, capsys, *args) -> str:
    """`fibctl ARGS` refused in this process, run in `tmp_path`."""
    monkeypatch.chdir(tmp_path)
    return refused(monkeypatch, capsys, *args)


def test_quick_probe_end_to_end_queue_worker_table2(tmp_path):
    """`fibctl probe --quick` (depth 2, both inits, seed 0; 40 steps here, not its 200: a
    minute less), a worker with no data folder, then Table 2 from fibctl's own runs: the
    pipeline of the study's probe."""
    queued = _fibctl(tmp_path, "probe", "--quick", "--steps", "40", "--db", "r.db")
    assert queued.returncode == 0 and "queued 2 probe run(s)" in queued.stdout, queued.stderr
    again = _fibctl(tmp_path, "probe", "--quick", "--steps", "40", "--db", "r.db")
    assert "queued 0 probe run(s); 2 already present" in again.stdout  # idempotent
    # two 1-thread workers, a run each: on 2 cores they beat one 2-thread worker
    # (docs/benchmarks.md, "The probe's whole table")
    workers = [_worker(tmp_path) for _ in range(2)]
    for worker in workers:
        output = worker.communicate(timeout=300)[0]
        assert worker.returncode == 0, output
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select name, status from runs order by id").fetchall() == [
        ("probe_d2_uniform_s0_40steps", "done"), ("probe_d2_staggered_s0_40steps", "done")]
    assert db.execute("select distinct sampler from runs").fetchall() == [(None,)]  # a probe draws no windows
    assert db.execute("select count(*) from events where kind = 'claimed'").fetchone() == (2,)  # each once
    assert db.execute("select count(distinct step) from alphas").fetchone() == (2,)  # steps 0 and 40 (the last)
    table = _fibctl(tmp_path, "report", "table2", "--db", "r.db")
    assert table.returncode == 0, table.stderr
    said = " ".join(table.stdout.split())
    assert "fibctl's models, 40 steps" in said and "staggered" in table.stdout
    assert "Task: marked copy at length 512, vocab 512, distances 200/350." in said  # the one task: no column
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    frame = tables.table2(connect(str(tmp_path / "r.db"), must_exist=True)).frame.set_index("Init")
    assert frame.loc["staggered", "Depth"] == 2 and frame.loc["staggered", "Seeds"] == 1
    assert frame.loc["staggered", "Scored"] == 16
    assert 0.5 <= frame.loc["staggered", "α min"] < frame.loc["staggered", "α max"] <= 1.5


def test_probe_says_the_worker_command_on_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    """`Train them with: fibctl worker --db` ended one line at 80 columns and the path began
    the next: a command to copy, split from its value."""
    from cli_helpers import ran

    db = str(tmp_path / "a-folder-with-a-long-name" / "small-probe.db")
    (tmp_path / "a-folder-with-a-long-name").mkdir()
    code, out, err = ran(monkeypatch, capsys, "probe", "--quick", "--db", db)
    assert code == 0, err
    assert out.splitlines() == ["queued 2 probe run(s); 0 already present. Train them with:",
                                f"  fibctl worker --db {db}"], out


def test_quick_probe_queues_depth_2_both_inits_seed_0_for_200_steps(tmp_path):
    from typer.testing import CliRunner

    from fibctl.cli import app

    done = CliRunner().invoke(app, ["probe", "--quick", "--db", str(tmp_path / "r.db")])
    assert done.exit_code == 0, done.output
    runs = sqlite3.connect(tmp_path / "r.db").execute("select name from runs order by id").fetchall()
    assert runs == [("probe_d2_uniform_s0_200steps",), ("probe_d2_staggered_s0_200steps",)]


def test_a_probe_of_other_task_settings_under_the_same_names_says_a_way_out_probe_has(tmp_path, monkeypatch,
                                                                                        capsys):
    """The run names hold depth, init, seed and steps, not --eval-sequences: the refusal sent
    the user to `queue add --suffix`, which `fibctl probe` does not have."""
    from typer.testing import CliRunner

    from fibctl.cli import app

    assert CliRunner().invoke(app, ["probe", "--quick", "--db", str(tmp_path / "r.db")]).exit_code == 0
    said = " ".join(_refused(tmp_path, monkeypatch, capsys, "probe", "--quick", "--eval-sequences", "32",
                             "--db", "r.db").split())
    assert "differs in probe.eval_sequences" in said and "another database (--db)" in said, said
    assert "--suffix" not in said


@pytest.mark.parametrize("args, message", [
    (["--depth", "0"], "--depth 0 must be from 1 to 1024"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
    (["--distance", "512"], "distance 512 must be from 1 to the length - 1"),
    (["--vocab", "513"], "vocab 513 is not divisible by the 2 distances"),
    (["--init", "ramp"], "--init 'ramp'"),
    (["--length", "0"], "seq_len=0 must be >= 1"),  # 0 is a value, not "the default"
    (["--length", "100000000"], "--length 100,000,000 is too large: a probe takes at most 65,536"),
    (["--vocab", "1000000000"], "--vocab 1,000,000,000 is too large: a probe takes at most 65,536"),
    (["--eval-sequences", "0"], "--eval-sequences 0 must be from 1 to 1,000,000"),
    (["--seed", "4294967296"], "--seed = 4294967296 must be an integer from 0 to 2**32 - 1"),
    (["--quick", "--steps", "0"], "--steps 0 must be >= 1"),  # not replaced by --quick's 200
    # each within its own bound, but not together: queued, they ran the worker out of memory
    (["--depth", "8", "--length", "65536"], "depth 8 at length 65,536 and vocab 512 needs about 79 GiB while "
                                            "training, more than the 64 GiB a probe run may use"),
    (["--depth", "2", "--length", "65536", "--vocab", "65536"], "while scoring 16 held-out sequences"),
    (["--length", "65536", "--eval-sequences", "1000000"], "while scoring 1,000,000 held-out sequences"),
])
def test_probe_bad_input_is_one_line_and_queues_nothing(tmp_path, monkeypatch, capsys, args, message):
    assert message in _refused(tmp_path, monkeypatch, capsys, "probe", "--db", "r.db", *args)
    if (tmp_path / "r.db").exists():
        assert sqlite3.connect(tmp_path / "r.db").execute("select count(*) from runs").fetchone() == (0,)


def test_a_worker_without_data_puts_back_a_run_that_needs_text(tmp_path, monkeypatch, capsys):
    from train_helpers import micro_run

    engine = connect(str(tmp_path / "r.db"))
    add_runs(engine, [micro_run("text")])
    assert "trains on text" in _refused(tmp_path, monkeypatch, capsys, "worker", "--db", "r.db", "--data",
                                        "no-data", "--plain")
    assert sqlite3.connect(tmp_path / "r.db").execute("select status, attempts from runs").fetchone() == ("queued", 0)


def test_worker_compile_says_on_stderr_that_a_probe_run_trains_eagerly(tmp_path):
    [run] = small_runs(steps=2, checkpoint_interval=2)[:1]
    add_runs(connect(str(tmp_path / "r.db")), [run])
    r = _fibctl(tmp_path, "worker", "--db", "r.db", "--data", "no-data", "--runs-dir", "runs", "--plain",
                "--device", "cpu", "--compile")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"warning: {run.name}: a probe run trains eagerly; --compile does not apply"
    assert "warning" not in r.stdout and f"{run.name}: done at step 2" in r.stdout


def test_eval_refuses_probe_runs_and_all_skips_them(tmp_path):
    from sqlalchemy import text

    from fibctl.errors import FibctlError
    from fibctl.flows.evaluation import find_runs

    engine = connect(str(tmp_path / "r.db"))
    [run] = small_runs()[:1]
    add_runs(engine, [run])
    with pytest.raises(FibctlError, match="is a probe run: its worker scored it"):
        find_runs(engine, [run.name], False)
    with engine.begin() as conn:
        conn.execute(text("UPDATE runs SET checkpoint_path = 'x/step_00000030.pt'"))
    with pytest.raises(FibctlError, match="probe runs are scored by their worker"):
        find_runs(engine, [], True)


def test_a_probe_run_trains_in_one_process(tmp_path, monkeypatch, capsys):
    from fibctl.errors import WorkerError
    from fibctl.flows.worker import check_group_run

    [run] = small_runs()[:1]
    add_runs(connect(str(tmp_path / "r.db")), [run])
    refused = _refused(tmp_path, monkeypatch, capsys, "train", run.name, "--db", "r.db", "--nproc", "2",
                       "--device", "cpu")
    assert "is a probe run: it trains in one process" in refused
    assert sqlite3.connect(tmp_path / "r.db").execute("select status, attempts from runs").fetchone() == ("queued", 0)
    with pytest.raises(WorkerError, match="probe run"):  # what worker --ddp's rank 0 checks at each claim
        check_group_run(run, None, 2)


def test_bench_probe_times_both_paths_in_one_run_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    from fibctl.flows.bench import ProbeBench, bench_probe

    df = bench_probe(ProbeBench(width=2.0, length=64, batch=1, repeats=1, warmup=0))
    assert list(df.impl) == ["reference", "fast"] and df.time_vs_reference.iloc[0] == 1.0
    assert (df.fwd_bwd_ms > 0).all() and df.rungs.iloc[0] == 4  # 13, 21, 34 and 55
    assert "--width 0 must be > 0" in _refused(tmp_path, monkeypatch, capsys, "bench", "probe", "--width", "0")


def test_alphas_figure_keeps_each_probe_runs_name_inside_its_panel(tmp_path, monkeypatch):
    """Four probe runs of 300 steps: each panel's title (probe_d2_staggered_s0_300steps) was
    wider than its panel and ran into the next one's."""
    from sqlalchemy import insert

    from fibctl.db import schema
    from fibctl.db.engine import connect_readonly
    from fibctl.reports import figures
    from test_reports import add_run

    path = str(tmp_path / "a.db")
    engine = connect(path)
    names = [f"probe_d2_{init}_s{seed}_300steps" for init in ("staggered", "uniform") for seed in (0, 1)]
    with engine.begin() as conn:
        for name in names:
            rid = add_run(conn, name, "learned")
            conn.execute(insert(schema.Alpha), [dict(run_id=rid, step=step, layer=layer, alpha=0.55 + 0.9 * layer)
                                                for step in (0, 100, 200, 300) for layer in (0, 1)])
    engine.dispose()
    seen = []
    save = figures._save

    def check(fig, out):
        panels = [ax for ax in fig.axes if ax.get_title()]
        for ax in panels:
            box, title = ax.get_window_extent(), ax.title.get_window_extent()
            seen.append(ax.get_title().replace("\n", ""))
            assert title.width <= box.width, ax.get_title()
        boxes = [ax.title.get_window_extent() for ax in panels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        return save(fig, out)

    monkeypatch.setattr(figures, "_save", check)
    figures.alphas(connect_readonly(path), tmp_path / "a.png")
    assert sorted(seen) == sorted(names)  # broken into lines, never cut
