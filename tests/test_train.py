"""Training: the recipe, the worker and its database rows, crash-safe bit-exact resume."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fibctl.data.streams import load_manifest

from fibctl.config import get_preset
from fibctl.model import FibLM
from fibctl.errors import FibctlError
from fibctl.train.checkpoint import (latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
                                     stored_config_hash)
from fibctl.train.optim import build_optimizer, clip_gradients, lr_at
from fibctl.train.sampler import WindowSampler
from fibctl.train.trainer import Trainer
from fibctl.flows.worker import WorkerOptions, train_named, work
from test_study_loop import study_lr
from train_helpers import HELDOUT, NullReporter, Quiet, micro_run, queued_db, write_data

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


# A run long enough to be killed mid-way: checkpoints every 10 steps, evaluations every 50.
LONG = dict(steps=60, eval_interval=50, checkpoint_interval=10)


@pytest.fixture(scope="module")
def reference_weights(data, tmp_path_factory):
    """Final weights of an uninterrupted run of the LONG config."""
    trainer = Trainer(micro_run("ref", **LONG), load_manifest(data), tmp_path_factory.mktemp("ref"), NullReporter())
    assert trainer.run().status == "done"
    return trainer.model.state_dict()


def final_weights(engine, name, runs_dir):
    with engine.connect() as conn:
        path = conn.exec_driver_sql("select checkpoint_path from runs where name = ?", (name,)).scalar()
    return load_checkpoint(runs_dir / path)["model"]


def assert_bit_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def opts(data, tmp_path, **kw):
    return WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs", **kw)


# ----------------------------------------------------------------------------- the recipe


def test_lr_warms_up_linearly_then_decays_to_a_tenth_at_the_last_step():
    tc = get_preset("paper").train
    assert lr_at(1, tc) == pytest.approx(3e-4 / 300)
    assert lr_at(150, tc) == pytest.approx(1.5e-4)
    assert lr_at(300, tc) == pytest.approx(3e-4)
    assert lr_at(13000, tc) == pytest.approx(3e-5)
    mid = 300 + (13000 - 300) // 2
    assert lr_at(mid, tc) == pytest.approx(3e-5 + (3e-4 - 3e-5) / 2, rel=1e-3)
    decay = [lr_at(s, tc) for s in range(300, 13001, 100)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_lr_is_the_study_schedule_bit_for_bit_at_every_step():
    """The study's schedule: peak * step / warmup below the warm-up's end, then
    peak * (0.1 + 0.9 * 0.5 * (1 + cos(pi * progress))). The same value grouped otherwise
    differs in the last bit at thousands of the 13,000 steps. At the warm-up's last step the
    cosine's start is the peak itself, where peak * step / warmup may not be: 3e-3 * 3 / 3 is
    0.0030000000000000005 (the float64 trainer test saw it in the weights)."""
    tc = get_preset("paper").train
    assert [lr_at(s, tc) for s in range(1, 13_001)] == [study_lr(s, tc) for s in range(1, 13_001)]
    short = dataclasses.replace(tc, lr=3e-3, warmup_steps=3, steps=10)
    assert [lr_at(s, short) for s in range(1, 11)] == [study_lr(s, short) for s in range(1, 11)]
    assert lr_at(3, short) == 3e-3
    ends_warm = dataclasses.replace(short, steps=3)  # no cosine after the warm-up: it ends at the peak
    assert [lr_at(s, ends_warm) for s in range(1, 4)] == [study_lr(s, ends_warm) for s in range(1, 4)]
    probe = get_preset("probe").train  # min_lr_ratio 1: constant
    assert {lr_at(s, probe) for s in range(1, probe.steps + 1)} == {probe.lr}


def test_a_steps_loss_sums_its_micro_batches_as_the_study_did(data, tmp_path):
    """The study added each micro-batch's loss / grad_accum, a float32 number, to a Python
    float. Summed in float32 instead, the step's loss rounds on the way."""
    trainer = Trainer(micro_run("x", grad_accum=8), load_manifest(data), tmp_path / "x", NullReporter())
    model, micro = trainer.step_model, []

    def forward(x, y):
        loss = FibLM.forward(model, x, y)
        micro.append(float(loss.detach() / 8))
        return loss

    model.forward = forward
    trainer.step = 1
    loss, _ = trainer.train_step()
    study = 0.0
    for value in micro:
        study += value
    assert len(micro) == 8 and loss == study


def norm_of(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the per-tensor 2-norms, summed in the order given."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


@pytest.mark.parametrize("schedule", ["fixed", "learned"])
def test_clipping_sums_the_gradient_norms_in_the_study_order(data, tmp_path, schedule):
    """The study clipped with clip_grad_norm_(model.parameters()), whose total norm sums the
    per-tensor norms in its registration order (each block's two norms first); in fibctl's
    own order the float32 total rounds otherwise at some steps, and so do the clipped
    gradients. The norm each step returns, and clips by, is the study-order one."""
    trainer = Trainer(micro_run("x", schedule), load_manifest(data), tmp_path / "x", NullReporter())
    model = trainer.model
    grads = {}  # each parameter's gradient before clipping: the last accumulation's
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(p, p.grad.clone()))
    differs = 0
    for trainer.step in range(1, 7):
        _, grad_norm = trainer.train_step()
        study = norm_of([grads[p] for p in model.study_order()])
        assert grad_norm == float(study)
        differs += grad_norm != float(norm_of([grads[p] for p in model.parameters()]))
    assert differs  # fibctl's registration order would have given another norm


def model_with_gradients(seed: int = 0) -> FibLM:
    """The micro model, each parameter holding a random gradient."""
    torch.manual_seed(seed)
    model = FibLM(micro_run("x", "learned").model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


@pytest.mark.parametrize("drop_get_total_norm", [False, True])  # True: torch 2.4 and 2.5's path
def test_an_infinite_bound_measures_the_norm_and_leaves_the_gradients(monkeypatch, drop_get_total_norm):
    """grad_clip 0 (the probe's recipe): the study's probe never clipped. clip_grad_norm_
    with an infinite bound scaled every gradient by inf / inf = NaN once one was infinite;
    the others stay bit for bit, and the norm is the one clip_grad_norm_ reports."""
    if drop_get_total_norm:
        monkeypatch.delattr(torch.nn.utils, "get_total_norm")
    model, reference = model_with_gradients(), model_with_gradients()
    expected = torch.nn.utils.clip_grad_norm_(reference.study_order(), math.inf)
    assert torch.equal(clip_gradients(model, math.inf), expected)  # finite: the same norm, to the bit
    first, *others = model.study_order()
    first.grad.view(-1)[0] = math.inf
    before = [p.grad.clone() for p in others]
    assert clip_gradients(model, math.inf) == math.inf
    assert all(torch.equal(p.grad, g) for p, g in zip(others, before))


def test_a_finite_bound_clips_as_clip_grad_norm_does():
    model, reference = model_with_gradients(), model_with_gradients()
    expected = torch.nn.utils.clip_grad_norm_(reference.study_order(), 1.0)
    assert torch.equal(clip_gradients(model, 1.0), expected) and expected > 1.0
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(model.study_order(), reference.study_order()))


def test_weight_decay_applies_to_matrices_only():
    cfg = micro_run("x", "learned").model
    model = FibLM(cfg)
    opt = build_optimizer(model, get_preset("micro").train).optimizer
    decayed, plain = opt.param_groups
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert opt.defaults["betas"] == (0.9, 0.95)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.dim() >= 2 for p in decayed["params"])
    plain_names = {names[id(p)] for p in plain["params"]}
    assert "blocks.0.attn.theta" in plain_names and "norm.weight" in plain_names
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_sampler_resumes_its_random_sequence():
    stream = np.arange(1000, dtype=np.uint16)
    a = WindowSampler(stream, 16, 4, seed=1)
    a.next_batch()
    state = a.state_dict()
    x1, y1 = a.next_batch()
    b = WindowSampler(stream, 16, 4, seed=1)
    b.load_state_dict(state)
    x2, _ = b.next_batch()
    assert torch.equal(x1, x2) and torch.equal(y1, x1 + 1)  # targets are the next tokens


def test_a_split_batch_reads_the_whole_batchs_windows_in_order():
    """The study's learned runs drew 4 windows 8 times a step where its controls drew 8
    windows 4 times: one generator call per micro-batch, so the same windows in the same
    order. fibctl's sampler draws likewise."""
    stream = np.arange(50_000, dtype=np.uint16)
    whole, split = WindowSampler(stream, 16, 8, seed=42), WindowSampler(stream, 16, 4, seed=42)
    for _ in range(3):
        assert torch.equal(whole.next_batch()[0], torch.cat([split.next_batch()[0], split.next_batch()[0]]))


def test_a_run_resumed_from_a_torch_generator_checkpoint_keeps_its_order():
    """A checkpoint of a run whose sampler drew from torch's generator (fibctl's sampler
    before it drew as the study did) resumes that run's sequence, and its later checkpoints
    keep the same generator: one run, one order."""
    stream = np.arange(1000, dtype=np.uint16)
    before = torch.Generator().manual_seed(1)
    torch.randint(0, len(stream) - 17, (4,), generator=before)  # one batch drawn before the checkpoint
    sampler = WindowSampler(stream, 16, 4, seed=1)
    sampler.load_state_dict({"generator": before.get_state()})
    for _ in range(2):
        starts = torch.randint(0, len(stream) - 17, (4,), generator=before)
        assert sampler.next_batch()[0][:, 0].tolist() == starts.tolist()
    again = WindowSampler(stream, 16, 4, seed=1)
    again.load_state_dict(sampler.state_dict())
    assert torch.equal(again.next_batch()[0][:, 0], torch.randint(0, len(stream) - 17, (4,), generator=before))


@pytest.mark.parametrize("edit", [
    {"pos": 625}, {"pos": -1}, {"pos": 10 ** 30}, {"pos": True}, {"has_gauss": 2}, {"kind": "PCG64"},
    {"keys": torch.zeros(624, dtype=torch.int64)}, {"keys": torch.zeros(3, dtype=torch.int64)},
    {"keys": torch.full((624,), 2 ** 32)}, {"keys": torch.ones(624)}, {"keys": [1] * 624},
])
def test_a_sampler_state_that_is_no_mt19937_state_is_refused(edit):
    """numpy's set_state checks none of these: a position past the keys read beyond them (a
    segfault at 10**6), short keys raised an IndexError, all-zero keys drew start 0 forever.
    A ValueError is what Trainer._load names a damaged checkpoint."""
    stream = np.arange(1000, dtype=np.uint16)
    state = WindowSampler(stream, 16, 4, seed=1).state_dict()
    state["numpy"].update(edit)
    with pytest.raises(ValueError, match="numpy generator"):
        WindowSampler(stream, 16, 4, seed=2).load_state_dict(state)


def test_checkpoints_are_atomic_and_only_the_last_few_kept(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"step": step, "model": {}}, keep=2)
    (tmp_path / "step_00000040.pt.tmp").write_bytes(b"half-written")  # a crash mid-save
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000020.pt", "step_00000030.pt"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 30


@pytest.mark.parametrize("make,problem", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: torch.save({"weights": {}}, p), "is not a fibctl checkpoint (no model weights and step)"),
    (lambda p: torch.save([1, 2], p), "is not a fibctl checkpoint"),
    # each reader (a resume, fibctl eval) met these as a TypeError of its own, eval's a traceback
    (lambda p: torch.save({"model": 5, "step": 1}, p),
     "is damaged or not a checkpoint (its model weights are an int, not a dict of named tensors)"),
    (lambda p: torch.save({"model": {"w": [1.0]}, "step": 1}, p),
     "is damaged or not a checkpoint (its model weights hold a list under 'w', not a tensor)"),
    (lambda p: torch.save({"model": {}, "step": "10"}, p),
     "is damaged or not a checkpoint (its step is a str, not a count of steps)"),
    (lambda p: torch.save({"model": {}, "step": -1}, p),
     "is damaged or not a checkpoint (its step is -1, not a count of steps)"),
])
def test_a_checkpoint_that_is_not_one_is_named_in_one_error(tmp_path, make, problem):
    path = tmp_path / "step_00000010.pt"
    make(path)
    with pytest.raises(FibctlError, match=f"checkpoint {re.escape(str(path))} {re.escape(problem)}"):
        load_checkpoint(path)


def test_a_checkpoint_whose_weights_are_not_a_dict_is_set_aside_and_the_run_resumes_before_it(data, tmp_path):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path), Quiet(lambda p: p.step == 13 and stop.set()), stop=stop)
    newest = tmp_path / "runs" / "run" / "step_00000013.pt"
    torch.save({**load_checkpoint(newest), "model": 5}, newest)
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert outcome.status == "done" and newest.with_name("step_00000013.pt.damaged").is_file()
    [(damaged,)] = sqlite3.connect(tmp_path / "r.db").execute("select message from events where kind = 'damaged'")
    assert damaged.startswith(f"checkpoint {newest} is damaged or not a checkpoint (its model weights are an int"), \
        damaged
    assert "resuming from step 10" in damaged


def test_a_resumed_run_s_eta_is_at_its_pace_over_every_attempt(data, tmp_path):
    """The training line's ETA was at this attempt's pace alone, `fibctl status`'s at the last
    logged tokens/s: one function (fibctl.units.eta_s), the run's wall time per step over every
    attempt, gives both. Here an earlier attempt took 100 s a step."""
    from fibctl.units import eta_s

    stop = threading.Event()
    first = Trainer(micro_run("run", **LONG), load_manifest(data), tmp_path, NullReporter(), stop=stop,
                    on_progress=lambda p: p.step == 10 and stop.set())
    assert first.run().status == "stopped"
    path = tmp_path / "step_00000010.pt"
    save_checkpoint(tmp_path, 10, {**load_checkpoint(path), "elapsed_s": 1000.0}, keep=3)
    shown = []
    second = Trainer(micro_run("run", **LONG), load_manifest(data), tmp_path, NullReporter(), stop=stop,
                     on_progress=lambda p: (shown.append(p), stop.set()))
    stop.clear()
    assert second.run().status == "stopped"
    [p] = shown
    assert p.step == 11 and p.elapsed_s > 1000
    assert p.eta_s == eta_s(11, 60, p.elapsed_s) and p.eta_s > 49 * 1000 / 11


def test_a_checkpoint_without_a_config_has_no_hash_and_is_refused(data, tmp_path):
    config = micro_run("a")
    assert stored_config_hash({"model": {}, "step": 1}) == "(none recorded)"
    save_checkpoint(tmp_path / "a", 5, {"model": {}, "step": 5, "config": {"name": "a"}}, keep=2)
    trainer = Trainer(config, load_manifest(data), tmp_path / "a", reporter=NullReporter())
    with pytest.raises(FibctlError, match=r"has config hash \(none recorded\) but run 'a' has"):
        trainer.resume()


def test_a_checkpoint_of_another_optimizer_is_not_resumed(data, tmp_path):
    """A run whose checkpoint was written by adamw8bit (on a GPU) must not go on with adamw
    on a machine where 8-bit AdamW cannot run: the optimizer state would not be its own."""
    config = micro_run("a", optimizer="adamw8bit")
    trainer = Trainer(config, load_manifest(data), tmp_path / "a", reporter=NullReporter())
    assert trainer.optimizer_name == "adamw"  # the CPU's fallback
    save_checkpoint(tmp_path / "a", 5, {"model": {}, "step": 5, "config": config.to_dict(),
                                        "data_hash": trainer.data_hash, "optimizer_name": "adamw8bit"}, keep=2)
    with pytest.raises(FibctlError, match="was trained with adamw8bit, but this worker would resume with adamw "
                                          r"\(optimizer adamw8bit unavailable"):
        trainer.resume()


def test_a_worker_that_cannot_run_the_checkpoints_optimizer_leaves_the_run_queued(data, tmp_path, capsys,
                                                                                    monkeypatch):
    """A paper run checkpointed by adamw8bit on a GPU, claimed by a worker without bitsandbytes:
    the run was marked failed ('FibctlError: checkpoint ... was trained with adamw8bit'), though
    only that worker could not resume it; a GPU worker then passed it by."""
    config = micro_run("a", optimizer="adamw8bit")
    queued_db(tmp_path / "r.db", config)
    trainer = Trainer(config, load_manifest(data), tmp_path / "runs" / "a", reporter=NullReporter())
    save_checkpoint(tmp_path / "runs" / "a", 5, {"model": trainer.model.state_dict(), "step": 5,
                                                 "config": config.to_dict(), "data_hash": trainer.data_hash,
                                                 "optimizer_name": "adamw8bit", "logged_step": 0}, keep=2)
    with sqlite3.connect(tmp_path / "r.db") as c:  # as the GPU worker stopped left it
        c.execute("update runs set checkpoint_path = 'a/step_00000005.pt'")
    code, err = _cli(["worker", "--db", str(tmp_path / "r.db"), "--data", str(data), "--runs-dir",
                      str(tmp_path / "runs"), "--plain"], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("error: checkpoint "), err
    assert "was trained with adamw8bit, but this worker would resume with adamw" in err.splitlines()[-1]
    assert sqlite3.connect(tmp_path / "r.db").execute("select status, attempts, error from runs").fetchall() == [
        ("queued", 0, None)]


def test_a_training_stream_shorter_than_two_windows_starts_is_one_error():
    with pytest.raises(FibctlError, match="training stream has 17 tokens; training at length 16 needs 18"):
        WindowSampler(np.arange(17, dtype=np.uint16), 16, 4, seed=1)
    # the study's one start on 18 tokens: 0 (numpy's randint(0, 18 - 16 - 1)), every time
    x, y = WindowSampler(np.arange(18, dtype=np.uint16), 16, 4, seed=1).next_batch()
    assert x.tolist() == [list(range(16))] * 4 and y.tolist() == [list(range(1, 17))] * 4


def test_windows_start_where_the_study_drew_them_never_at_the_last_window():
    """Starts run 0 .. n - T - 2 (the study's numpy randint(0, n - T - 1)): on 20 tokens at
    T = 16, starts 0, 1 and 2, never 3 (the stream's last window)."""
    sampler = WindowSampler(np.arange(20, dtype=np.uint16), 16, 64, seed=3)
    starts = {int(row[0]) for _ in range(20) for row in sampler.next_batch()[0]}
    assert starts == {0, 1, 2}


@pytest.mark.parametrize("schedule,poison,said", [
    ("fixed", lambda m: next(m.parameters()), r"step 20 gave a held-out loss of nan on \w+"),
    # a NaN theta: the evaluation's rungs would floor NaN (a ValueError traceback in the error column)
    ("learned", lambda m: m.blocks[1].attn.theta, r"step 20 gave an alpha of nan in layer 1"),
])
def test_weights_a_step_made_nan_before_its_loss_shows_it_end_the_run_as_diverged(data, tmp_path, monkeypatch,
                                                                                   schedule, poison, said):
    """Step 20's update leaves NaN weights while its own loss was finite: the evaluation after
    it scores NaN. It fails the run as diverged, records no NaN (SQLite would refuse it, as a
    NOT NULL failure) and writes no checkpoint of those weights."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", schedule))

    def poisoned(self):
        loss = original(self)
        if self.step == 20:
            with torch.no_grad():
                poison(self.model).fill_(float("nan"))
        return loss
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", poisoned)
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert (outcome.status, outcome.step) == ("failed", 19)
    db = sqlite3.connect(tmp_path / "r.db")
    (error,) = db.execute("select error from runs").fetchone()
    assert re.fullmatch(said, error), error
    assert db.execute("select max(step) from evaluations").fetchone() == (10,)
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "run")] == ["step_00000010.pt"]


def test_a_learned_run_that_diverges_fails_as_a_fixed_one_does(data, tmp_path):
    """At lr 1e30 step 2's update makes every weight NaN, theta included: the fixed run said
    `step 3 gave a loss of nan`, the learned one failed at step 3 with `ValueError: cannot
    convert float NaN to integer` and a traceback in the error column (its rungs floor NaN)."""
    engine = queued_db(tmp_path / "r.db", micro_run("lnan", "learned", lr=1e30, warmup_steps=0),
                       micro_run("fnan", lr=1e30, warmup_steps=0))
    outcomes = work(engine, opts(data, tmp_path), Quiet())
    assert [(o.name, o.status, o.step, o.error) for o in outcomes] == [
        ("lnan", "failed", 2, "step 3 gave an alpha of nan in layer 0"),
        ("fnan", "failed", 2, "step 3 gave a loss of nan")]
    # a retry would diverge again at the same step (it resumes bit-exactly): the way on is said
    assert outcomes[1].hint == ("a retry repeats the same steps; train it again as a new run at a lower learning "
                                "rate: fibctl queue add MATRIX --only fnan --set train.lr=LOWER --suffix _lowlr")
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select name, error from runs order by id").fetchall() == [
        ("lnan", "step 3 gave an alpha of nan in layer 0"), ("fnan", "step 3 gave a loss of nan")]
    assert db.execute("select r.name, e.message from events e join runs r on r.id = e.run_id "
                      "where e.kind = 'diverged' order by r.id").fetchall() == [
        ("lnan", "step 3 gave an alpha of nan in layer 0"), ("fnan", "step 3 gave a loss of nan")]


def _poison_theta_at(monkeypatch, step):
    def poisoned(self):
        loss = original(self)
        if self.step == step:
            with torch.no_grad():
                self.model.blocks[0].attn.theta.fill_(float("nan"))
        return loss
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", poisoned)


def test_a_nan_alpha_is_never_checkpointed_without_an_evaluation(data, tmp_path, monkeypatch):
    """Checkpoints every 10 steps, evaluations every 25: step 20 saved theta NaN unscored, and
    every resume from it failed with the ValueError of its rungs."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", "learned", eval_interval=25, full_eval_interval=25))
    _poison_theta_at(monkeypatch, 20)
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert (outcome.status, outcome.step, outcome.error) == ("failed", 19, "step 20 gave an alpha of nan in layer 0")
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "run")] == ["step_00000010.pt"]


def test_a_nan_alpha_leaves_no_mfu_to_count_and_the_next_step_ends_the_run(data, tmp_path, monkeypatch):
    """With a peak to measure MFU against, the count of attended pairs after the step that made
    theta NaN read its rungs: the run failed with that error instead of as diverged."""
    monkeypatch.setenv("FIBCTL_PEAK_TFLOPS", "1")
    engine = queued_db(tmp_path / "r.db", micro_run("run", "learned"))
    _poison_theta_at(monkeypatch, 5)  # a logged step (log_interval 5), not an evaluated one
    [outcome] = work(engine, opts(data, tmp_path), Quiet())
    assert (outcome.status, outcome.step, outcome.error) == ("failed", 5, "step 6 gave an alpha of nan in layer 0")
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select step from train_steps").fetchall() == [(5,)]  # logged, its MFU left out


# ----------------------------------------------------------------------------- the worker


def test_worker_trains_the_queue_records_everything_and_survives_a_nan(data, tmp_path):
    engine = queued_db(tmp_path / "r.db", micro_run("fixed"), micro_run("nan", lr=1e6),
                       micro_run("learned", "learned"))
    display = Quiet()
    outcomes = work(engine, opts(data, tmp_path), display)
    assert [(o.name, o.status) for o in outcomes] == [("fixed", "done"), ("nan", "failed"), ("learned", "done")]
    db = sqlite3.connect(tmp_path / "r.db")
    q = lambda sql: db.execute(sql).fetchall()  # noqa: E731
    runs = {r[0]: r[1:] for r in q("select name, status, error, final_step, tokens_trained, wall_seconds, "
                                   "device, torch_version, params_total, checkpoint_path from runs")}
    status, error, final_step, tokens, wall, device, version, params, ckpt = runs["fixed"]
    assert (status, error, final_step, tokens) == ("done", None, 30, 30 * 4 * 2 * 64)
    assert wall > 0 and device.startswith("cpu") and version == torch.__version__
    assert params == FibLM(micro_run("x").model).param_counts()["total"]
    assert ckpt == "fixed/step_00000030.pt" and (tmp_path / "runs" / ckpt).is_file()  # relative to --runs-dir
    assert runs["learned"][7] == params + 2  # one theta per layer
    assert runs["nan"][0] == "failed" and re.fullmatch(r"step (\d+) gave a loss of nan", runs["nan"][1])
    # training steps every log_interval, evaluations every eval_interval on both held-out sets
    assert q("select step from train_steps where run_id = 1 order by step") == [(s,) for s in range(5, 31, 5)]
    assert q("select count(*), min(lr) > 0 from train_steps where run_id = 1 and grad_norm > 0 "
             "and tokens_per_s > 0") == [(6, 1)]
    evals = q("select step, dataset, eval_length, tokens from evaluations where run_id = 1 order by step, dataset")
    assert [(s, d) for s, d, _, _ in evals] == [(s, d) for s in (10, 20, 30) for d in ("math_val", "stories_val")]
    assert {(L, t) for _, _, L, t in evals} == {(64, 64 * 64)}  # full budget 4096 = 64 windows of 64 targets
    assert q("select count(*) from position_losses where run_id = 1 and step = 30 and eval_length = 64") == [(126,)]
    # alphas: a static schedule once, learned at every evaluation
    assert q("select distinct step from alphas where run_id = 1") == [(0,)]
    assert q("select distinct step from alphas where run_id = 3 order by step") == [(0,), (10,), (20,), (30,)]
    assert q("select count(*) from alphas where run_id = 3 and alpha != 1.0") == [(6,)]


def test_injected_stop_checkpoints_requeues_and_resumes_bit_exact(data, tmp_path, reference_weights):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    stop = threading.Event()
    display = Quiet(on_step=lambda p: p.step == 37 and stop.set())
    [first] = work(engine, opts(data, tmp_path), display, stop=stop)
    assert (first.status, first.step, first.checkpoint.name) == ("released", 37, "step_00000037.pt")
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select status, checkpoint_path from runs").fetchone() == ("queued", "run/step_00000037.pt")
    shown = Quiet()
    [second] = work(engine, opts(data, tmp_path), shown)
    assert second.status == "done"
    assert shown.notes == [f"run: resumed from step 37 ({tmp_path / 'runs' / 'run' / 'step_00000037.pt'})"]
    assert_bit_equal(final_weights(engine, "run", tmp_path / "runs"), reference_weights)
    kinds = [k for (k,) in db.execute("select kind from events order by id")]
    assert "released" in kinds and "resumed" in kinds


def test_a_run_resumed_in_torchs_older_order_says_so_once_and_records_its_sampler(data, tmp_path):
    """A run checkpointed while fibctl's sampler drew from torch's generator keeps that order
    when resumed (one run, one order), so its windows are not those of same-seed runs begun
    since: the worker says so once, as a warning and a deviation event, and runs.sampler
    records which generator drew each run's windows (what the reports compare)."""
    engine = queued_db(tmp_path / "r.db", micro_run("old", **LONG), micro_run("new", **LONG))
    stop = threading.Event()
    work(engine, opts(data, tmp_path, max_runs=1), Quiet(on_step=lambda p: p.step == 10 and stop.set()), stop=stop)
    path = tmp_path / "runs" / "old" / "step_00000010.pt"
    older = torch.Generator().manual_seed(42)  # as an earlier fibctl's sampler saved it
    save_checkpoint(path.parent, 10, {**load_checkpoint(path), "sampler": {"generator": older.get_state()}}, keep=3)
    shown = Quiet()
    assert [o.status for o in work(engine, opts(data, tmp_path), shown)] == ["done", "done"]
    [line] = shown.warnings
    assert line.startswith("old: resumed in its checkpoint's data order: windows from torch's generator"), line
    db = sqlite3.connect(tmp_path / "r.db")
    assert db.execute("select name, sampler from runs order by name").fetchall() == [("new", "numpy"),
                                                                                    ("old", "torch")]
    assert db.execute("select r.name, e.data from events e join runs r on r.id = e.run_id "
                      "where e.kind = 'deviation'").fetchall() == [("old", '{"sampler": "torch"}')]


def _spawn(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "fibctl", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc, timeout=60):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_or_terminated_worker_resumes_bit_exact(sig, data, tmp_path, reference_weights):
    engine = queued_db(tmp_path / "r.db", micro_run("run", **LONG))
    proc = _spawn(["worker", "--db", str(tmp_path / "r.db"), "--data", str(data),
                   "--runs-dir", str(tmp_path / "runs"), "--plain"], tmp_path)
    _wait_for(tmp_path / "runs" / "run" / "step_00000020.pt", proc)
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0]
    db = sqlite3.connect(tmp_path / "r.db")
    status, ckpt = db.execute("select status, checkpoint_path from runs").fetchone()
    if sig == signal.SIGTERM:  # graceful: checkpoint at the step it stopped at, back in the queue
        assert proc.returncode == 128 + signal.SIGTERM, out  # not "queue finished" (0)
        assert status == "queued" and (tmp_path / "runs" / ckpt).is_file(), out
        assert "released" in out
        [outcome] = work(engine, opts(data, tmp_path), Quiet())
    else:  # killed: still marked running; a new claim takes it once its heartbeat is stale
        assert status == "running"
        outcome = train_named(engine, "run", opts(data, tmp_path, heartbeat_timeout_s=0), Quiet())
    assert outcome.status == "done"
    assert_bit_equal(final_weights(engine, "run", tmp_path / "runs"), reference_weights)
    assert db.execute("select count(*) from events where kind = 'resumed'").fetchone() == (1,)


# ----------------------------------------------------------------------------- bad input


def _cli(args, capsys, monkeypatch) -> tuple[int, str]:
    """Run `fibctl ARGS` in-process: (exit code, stderr)."""
    from fibctl.cli import main
    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    return exit_.value.code, capsys.readouterr().err


def test_bad_input_is_one_line_exit_2_and_changes_no_row(data, tmp_path, capsys, monkeypatch):
    from fibctl.config import RunConfig
    queued_db(tmp_path / "r.db", micro_run("run"), RunConfig.resolve("big", "test", "tiny", schedule="fixed"))
    (tmp_path / "empty").mkdir()
    db = sqlite3.connect(tmp_path / "r.db")
    before = db.execute("select * from runs").fetchall()
    cases = {
        "no run named 'nope'": ["train", "nope", "--data", str(data)],
        "no data manifest": ["train", "run", "--data", str(tmp_path / "empty")],
        "vocab 4,096": ["train", "big", "--data", str(data)],
        "no data manifest ": ["worker", "--data", str(tmp_path / "empty")],
    }
    for expected, args in cases.items():
        code, err = _cli([*args, "--db", str(tmp_path / "r.db"), "--runs-dir", str(tmp_path / "new" / "runs")],
                         capsys, monkeypatch)
        assert code == 2, err
        assert expected.strip() in err and len(err.strip().splitlines()) == 1, err
    assert db.execute("select * from runs").fetchall() == before
    assert not (tmp_path / "new").exists()  # a refused command made no runs folder
    assert db.execute("select count(*) from events").fetchone() == (0,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_gpus_all_without_cuda_is_one_line_exit_2_and_a_missing_gpu_is_refused(data, tmp_path, capsys,
                                                                              monkeypatch):
    from fibctl.errors import FibctlError
    from fibctl.flows.worker import parse_gpus
    with pytest.raises(FibctlError, match="--gpus all: this machine has no CUDA device"):
        parse_gpus("all")  # not a silent CPU worker
    with pytest.raises(FibctlError, match="0 CUDA device"):
        parse_gpus("0,2")
    queued_db(tmp_path / "r.db", micro_run("run"))
    code, err = _cli(["worker", "--gpus", "all", "--db", str(tmp_path / "r.db"), "--data", str(data),
                      "--runs-dir", str(tmp_path / "runs")], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no CUDA device" in err and "--device cpu" in err
    assert sqlite3.connect(tmp_path / "r.db").execute("select status, attempts from runs").fetchall() == [
        ("queued", 0)]


def test_the_per_gpu_workers_get_the_options_a_ddp_group_gets(data, tmp_path, capsys, monkeypatch):
    """`worker --gpus` left --threads off its workers' command lines (`--ddp` passed it): each
    training process must be given every option this one trains with. No CUDA needed: the
    launches are caught, not run."""
    from fibctl.flows import worker

    queued_db(tmp_path / "r.db", micro_run("run"))
    launched = {}
    monkeypatch.setattr(worker, "parse_gpus", lambda spec: [0, 1])
    monkeypatch.setattr(worker, "launch_per_gpu", lambda gpus, args, *a, **kw: launched.setdefault("gpus", args) and 0)
    monkeypatch.setattr(worker, "check_launch", lambda opts, nproc: 2)
    monkeypatch.setattr(worker, "launch_ddp", lambda n, args, **kw: launched.setdefault("ddp", args) and 0)
    common = ["--db", str(tmp_path / "r.db"), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
              "--threads", "3", "--heartbeat-timeout", "60", "--max-runs", "2", "--compile"]
    assert _cli(["worker", "--gpus", "0,1", *common], capsys, monkeypatch)[0] == 0
    assert _cli(["worker", "--ddp", "--nproc", "2", *common], capsys, monkeypatch)[0] == 0
    assert launched["ddp"][:2] == ["worker", "--ddp"]
    assert launched["gpus"] == launched["ddp"][2:]
    assert launched["gpus"][launched["gpus"].index("--threads") + 1] == "3"


def test_a_run_cancelled_while_training_stops_at_its_next_heartbeat(data, tmp_path):
    from fibctl.queue import cancel
    engine = queued_db(tmp_path / "r.db", micro_run("run"))
    display = Quiet(on_step=lambda p: p.step == 3 and cancel(engine, "run"))
    [outcome] = work(engine, opts(data, tmp_path), display)
    assert (outcome.status, outcome.step) == ("lost", 5)  # log_interval 5: the first heartbeat after
    assert sqlite3.connect(tmp_path / "r.db").execute("select status from runs").fetchone() == ("cancelled",)


def test_a_run_taken_over_during_a_checkpoints_evaluation_writes_no_checkpoint(data, tmp_path):
    """Its heartbeat after the evaluation said the run was another worker's, yet it went on to
    save into the folder its new owner trains in (and prune that owner's checkpoints)."""
    engine = queued_db(tmp_path / "r.db", micro_run("run", steps=30, log_interval=3, eval_interval=10,
                                                    checkpoint_interval=10))

    def take_over(p):  # after step 9's heartbeat: step 10 logs nothing, its evaluation heartbeats
        if p.step == 9:
            with engine.begin() as conn:
                conn.exec_driver_sql("UPDATE runs SET worker = 'thief:1'")
    [outcome] = work(engine, opts(data, tmp_path), Quiet(on_step=take_over))
    assert (outcome.status, outcome.step) == ("lost", 10)
    assert list_checkpoints(tmp_path / "runs" / "run") == []


def test_a_worker_reads_the_manifest_and_checks_each_stream_once(tmp_path, monkeypatch):
    """Resolve once, pass the object: two runs, one manifest read, one check per split."""
    from fibctl.data import streams
    from fibctl.flows import worker

    data = write_data(tmp_path / "data")
    engine = queued_db(tmp_path / "r.db", micro_run("a", steps=2, eval_interval=2, checkpoint_interval=2),
                       micro_run("b", steps=2, eval_interval=2, checkpoint_interval=2))
    reads, opened = [], []
    real_load, real_open = worker.load_manifest, streams.DataManifest._open
    monkeypatch.setattr(worker, "load_manifest", lambda d: reads.append(d) or real_load(d))
    monkeypatch.setattr(streams.DataManifest, "_open", lambda self, split: opened.append(split) or real_open(self, split))
    outcomes = work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs"), Quiet())
    assert [o.status for o in outcomes] == ["done", "done"]
    assert len(reads) == 1 and sorted(opened) == sorted(["train", *HELDOUT])
