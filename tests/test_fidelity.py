"""fibctl computes the study's function: the distances each layer attends, the rounding of
half-way rungs, the learned rung's row and weight, the evaluation windows, the two seeds and
the optimizer actually used (docs/method.md)."""

from __future__ import annotations

import dataclasses
import math
import re
import sqlite3
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fibctl.data.streams import load_manifest
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.config import BASES, PRESETS, SCHEDULES, ConfigError, RunConfig, get_preset
from fibctl.errors import FibctlError
from fibctl.metrics import inference_speed, stream_loss
from fibctl.matrix import load_matrix
from fibctl.model import Attention, FibLM
from fibctl.schedules import attended_distances, base_sequence, layer_alphas
from fibctl.train.optim import build_optimizer
from fibctl.train.trainer import Trainer
from train_helpers import micro_run, write_data

torch.set_num_threads(1)
SPARSE = [s for s in SCHEDULES if s != "dense"]
runner = CliRunner()


def layer_columns(cfg, layer: int, T: int) -> list[int]:
    """What the model's attention layer attends at length T: integer distances, then rungs."""
    device = "cpu" if cfg.schedule == "learned" else "meta"  # learned rungs read theta's value
    with torch.device(device):
        attn = Attention(cfg, layer)
    cols = attn.columns(T)
    if cols.frac is not None:
        assert bool((cols.frac.detach() == 0).all())  # at initialisation alpha = 1: whole distances
    return list(cols.dist) + list(cols.lo)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("schedule", SPARSE)
@pytest.mark.parametrize("base", BASES)
def test_every_layer_attends_what_coverage_counts(preset, schedule, base):
    """One function decides what a layer attends: the model's columns at T, 2T, 4T and 16T are
    exactly attended_distances, which `fibctl model`, `fibctl coverage` and the figure print."""
    for window in (6, 8, 10, 12):
        cfg = dataclasses.replace(get_preset(preset).model, schedule=schedule, base=base, window=window)
        for T in (cfg.seq_len * m for m in (1, 2, 4, 16)):
            expected = attended_distances(base, schedule, window, cfg.n_layers, T, cfg.n_rungs)
            for layer in range(cfg.n_layers):
                assert layer_columns(cfg, layer, T) == expected[layer], (window, T, layer)


def test_half_way_rungs_round_from_the_float64_alpha():
    """5/6 x 21 = 17.5 rounds to 18 in Python floats (the study) but 17 from a float32 alpha."""
    fib = base_sequence("fib", 1024)
    changed = {}
    for schedule in ("stagger", "coprime"):
        alphas = layer_alphas(schedule, 16)
        changed[schedule] = {l for l, a in enumerate(alphas) if any(
            round(a * b) != round(float(torch.tensor(a)) * b) and round(a * b) > 8 for b in fib)}
    assert changed == {"stagger": {5, 6, 12}, "coprime": {3, 4, 10}}  # the cases at W = 8
    cfg = dataclasses.replace(get_preset("paper").model, schedule="stagger")
    assert 18 in layer_columns(cfg, 5, 1024) and 17 not in layer_columns(cfg, 5, 1024)
    assert layer_alphas("stagger", 16)[5] * 21 == 17.5


def test_paper_stagger_model_and_coverage_command_agree_on_133():
    cfg = dataclasses.replace(get_preset("paper").model, schedule="stagger", window=8)
    with torch.device("meta"):
        model = FibLM(cfg)
    union = set().union(*(b.attn.columns(1024).dist for b in model.blocks))
    result = runner.invoke(app, ["coverage", "--base", "fib", "--schedule", "stagger", "--window", "8",
                                 "--length", "1024"])
    assert result.exit_code == 0, result.output
    printed = re.search(r"union over layers\s*│?\s*(\d+)", result.output)
    assert printed and int(printed.group(1)) == len(union) == 133


def test_learned_rung_row_and_weight_come_from_one_product():
    """At this theta, alpha * 233 is 134.0 in float32 but 133.99999... in float64: the row is
    134 with weight 0 (from the float32 product), never 133 with weight 1."""
    theta = torch.tensor(-2.5107600688934326)
    alpha = 0.5 + torch.sigmoid(theta)
    assert float(alpha * 233) == 134.0 and math.floor(float(alpha) * 233) == 133  # the trap exists
    cfg = dataclasses.replace(get_preset("paper").model, schedule="learned", window=8)
    attn = Attention(cfg, 0)
    with torch.no_grad():
        attn.theta.copy_(theta)
    cols = attn.columns(1024)
    targets = (attn.alpha * torch.tensor(base_sequence("fib", 1024), dtype=torch.float32)).tolist()
    assert 134 in cols.lo and float(cols.frac[cols.lo.index(134)].detach()) == 0.0
    assert bool(((cols.frac >= 0) & (cols.frac < 1)).all())
    for lo, f in zip(cols.lo, cols.frac.detach().tolist()):
        assert any(t == lo + f for t in targets)  # row + weight is exactly one float32 product


class Echo(torch.nn.Module):
    """A 'model' whose loss at each position is the target token's id: the mean loss says
    exactly which tokens a window scored."""

    def token_losses(self, idx, targets):
        assert idx.shape == targets.shape
        return targets.float()


@pytest.mark.parametrize("n_tokens,windows", [(20, 3), (13, 3), (12, 2), (5, 1)])
def test_evaluation_scores_t_targets_per_window_at_stride_t(n_tokens, windows):
    """Inputs x[i:i+T], targets x[i+1:i+T+1], windows at stride T: with T = 4 and a budget of
    12 tokens on the stream 0, 1, 2, ... the scored targets are 1..12 (1..8 when only 12
    tokens exist: a third window would need a 13th; and a stream of T + 1 tokens holds one
    window, which the study's length-extrapolation evaluator skipped: docs/method.md)."""
    res = stream_loss(Echo(), np.arange(n_tokens), 4, 12, torch.device("cpu"))
    scored = list(range(1, 4 * windows + 1))
    assert (res.windows, res.tokens) == (windows, 4 * windows)
    assert res.loss == pytest.approx(sum(scored) / len(scored))
    # per position (Table 4): the first T - 1 predicted positions, averaged over windows
    expected = [np.mean([4 * w + p + 1 for w in range(windows)]) for p in range(3)]
    assert res.position_losses.tolist() == pytest.approx(expected)


@pytest.mark.parametrize("position_tokens,head", [(None, 5), (8, 2), (11, 2), (1, 1), (400, 5)])
def test_per_position_loss_averages_the_first_windows_of_its_budget(position_tokens, head):
    """T = 4, 5 windows: the perplexity scores all of them; the per-position loss only the
    first position_tokens // T (at least one, at most all)."""
    res = stream_loss(Echo(), np.arange(40), 4, 20, torch.device("cpu"), position_tokens=position_tokens)
    assert (res.windows, res.position_windows) == (5, head)
    assert res.loss == pytest.approx(np.mean(range(1, 21)))
    expected = [np.mean([4 * w + p + 1 for w in range(head)]) for p in range(3)]
    assert res.position_losses.tolist() == pytest.approx(expected)


class Cramped(Echo):
    """Echo on a device that runs out of memory above `fits` windows per batch."""

    def __init__(self, fits: int):
        super().__init__()
        self.fits, self.batches = fits, []

    def token_losses(self, idx, targets):
        self.batches.append(len(idx))
        if len(idx) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().token_losses(idx, targets)


def test_evaluation_halves_its_batch_until_it_fits_and_says_when_nothing_does():
    stream, cpu = np.arange(400), torch.device("cpu")
    plain = stream_loss(Echo(), stream, 4, 80, cpu, batch_tokens=64)  # 16 windows per batch
    model = Cramped(fits=3)
    cramped = stream_loss(model, stream, 4, 80, cpu, batch_tokens=64)
    assert (cramped.loss, cramped.windows) == (plain.loss, plain.windows)
    assert cramped.position_losses.tolist() == plain.position_losses.tolist()
    assert model.batches[:3] == [16, 8, 4] and set(model.batches[3:]) <= {1, 2}
    with pytest.raises(FibctlError, match="^length 4 is out of reach on cpu: out of memory with a single window$"):
        stream_loss(Cramped(fits=0), stream, 4, 80, cpu)


class Timed(torch.nn.Module):
    """A 'model' that counts its forward passes and the batches they saw, and runs out of
    memory above `fits` sequences."""

    def __init__(self, fits: int = 1_000, vocab_size: int = 50):
        super().__init__()
        self.cfg = SimpleNamespace(vocab_size=vocab_size)
        self.fits, self.shapes, self.grad = fits, [], []

    def forward(self, idx):
        self.shapes.append(tuple(idx.shape))
        self.grad.append(torch.is_grad_enabled())
        if len(idx) > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        assert idx.dtype == torch.int64 and 0 <= int(idx.min()) and int(idx.max()) < self.cfg.vocab_size
        return idx


@pytest.mark.parametrize("fits,batch", [(1_000, 8), (5, 4), (1, 1)])
def test_inference_speed_is_timed_as_the_study_timed_it(fits, batch):
    """Batch 8 of random tokens at the length, 2 untimed forward passes then 5 timed, without
    gradients, in eval mode (restored after); a batch out of memory is halved, and said."""
    model = Timed(fits).train()
    measured = inference_speed(model, 16, torch.device("cpu"))
    fitted = [s for s in model.shapes if s[0] <= fits]
    assert fitted == [(batch, 16)] * 7 and not any(model.grad) and model.training
    assert measured["batch"] == batch
    assert measured["tokens_per_s"] == pytest.approx(batch * 16 / measured["latency_s"])
    with pytest.raises(FibctlError, match="^length 16 is out of reach on cpu: out of memory with a single sequence$"):
        inference_speed(Timed(fits=0), 16, torch.device("cpu"))


def test_inference_speed_says_the_slowest_and_fastest_timed_pass():
    """It gave the mean of the 5 timed passes alone: a pass slowed by another job went unseen.
    The spread is of the timed passes, the untimed ones (slower still here) left out."""
    import time

    sleeps = iter([0.2, 0.2, 0.02, 0.04, 0.02, 0.08, 0.02])  # 2 untimed, then 5 timed

    class Slow(Timed):
        def forward(self, idx):
            time.sleep(next(sleeps))
            return super().forward(idx)

    measured = inference_speed(Slow(), 16, torch.device("cpu"))
    tokens = 8 * 16
    assert measured["tokens_per_s_min"] == pytest.approx(tokens / 0.08, rel=0.2)
    assert measured["tokens_per_s_max"] > measured["tokens_per_s"] > measured["tokens_per_s_min"]
    assert measured["tokens_per_s"] == pytest.approx(tokens / measured["latency_s"])
    assert measured["latency_s"] == pytest.approx(0.036, rel=0.3)


@pytest.mark.parametrize("length,tokens,problem", [
    (1, 100, "evaluation length 1 is below 2: a window must predict a token"),
    (64, 32, "no window of 64 tokens (and its next token) fits in a budget of 32 tokens from a stream of 400"),
    (400, 10_000, "no window of 400 tokens (and its next token) fits in a budget of 10,000 tokens"),
])
def test_an_evaluation_without_a_window_is_one_error(length, tokens, problem):
    with pytest.raises(FibctlError, match=re.escape(problem)):
        stream_loss(Echo(), np.arange(400), length, tokens, torch.device("cpu"))


def test_optional_train_settings_leave_older_config_hashes_alone():
    """Unset, `full_eval_interval` and `position_tokens` are left out of a run's config, so
    a run queued before they existed keeps its hash (and resumes from its checkpoints)."""
    config = micro_run("x")
    d = config.to_dict()
    assert "full_eval_interval" not in d["train"] and "position_tokens" not in d["train"]
    assert RunConfig.from_dict(d).config_hash == config.config_hash
    cadence = micro_run("x", full_eval_interval=20, position_tokens=512)
    assert RunConfig.from_dict(cadence.to_dict()) == cadence and cadence.config_hash != config.config_hash


def test_full_evaluations_keep_their_own_cadence_apart_from_checkpoints(tmp_path):
    """full_eval_interval 4, checkpoints every 3, light evaluations every 2: full budgets at
    4, 8 and 12 only, light ones at 2, 6 and 10, checkpoints at 3, 6, 9 and 12; the last
    step's per-position loss over the windows of position_tokens."""
    from sqlalchemy import text

    from fibctl.flows.worker import WorkerOptions, work
    from fibctl.train.checkpoint import list_checkpoints
    from train_helpers import Quiet, queued_db

    data = write_data(tmp_path / "data")
    config = micro_run("cadence", steps=12, eval_interval=2, checkpoint_interval=3, keep_checkpoints=10,
                       full_eval_interval=4, eval_tokens=128, final_eval_tokens=256, position_tokens=128)
    engine = queued_db(tmp_path / "r.db", config)
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs", device="cpu"), Quiet())
    with engine.connect() as conn:
        budgets = dict(conn.execute(text("SELECT step, MAX(tokens) FROM evaluations GROUP BY step")).all())
        windows = conn.execute(text("SELECT DISTINCT step, windows FROM position_losses")).all()
    assert budgets == {2: 128, 4: 256, 6: 128, 8: 256, 10: 128, 12: 256}
    assert windows == [(12, 2)]  # 128 tokens: 2 windows of 64, of the 4 the perplexity scores
    assert [int(p.stem.split("_")[-1]) for p in list_checkpoints(tmp_path / "runs" / "cadence")] == [3, 6, 9, 12]


def test_replicas_share_initial_weights_and_differ_in_data_order(tmp_path):
    data = write_data(tmp_path / "data")
    same_init = [dataclasses.replace(micro_run("a"), init_seed=42, data_seed=s) for s in (42, 43)]
    other_init = dataclasses.replace(micro_run("b"), init_seed=7, data_seed=42)

    def start(cfg):
        t = Trainer(cfg, load_manifest(data), tmp_path / cfg.name, reporter=None)
        return t.model.state_dict(), t.sampler.next_batch()[0]

    (w1, x1), (w2, x2), (w3, x3) = map(start, [*same_init, other_init])
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not torch.equal(x1, x2)  # another data seed: other batches
    assert not torch.equal(w1["embed.weight"], w3["embed.weight"]) and torch.equal(x1, x3)


def test_paper_matrix_fixes_the_init_seed_and_uses_the_study_optimizer():
    configs = {c.name: c for c in load_matrix("paper").resolve()}
    assert {c.init_seed for c in configs.values()} == {42}
    assert {c.data_seed for c in configs.values()} == {42, 43, 44}
    assert configs["h02__fib_stagger_w12_s44"].data_seed == 44
    assert {c.train.optimizer for c in configs.values()} == {"adamw8bit"}



def test_paper_matrix_splits_each_step_as_the_study_did():
    """The study's runs record their split: 8 windows x 4 micro-batches, and 4 x 8 for its
    learned runs; always 32,768 tokens per optimizer step."""
    for c in load_matrix("paper").resolve():
        split = (c.train.batch_size, c.train.grad_accum)
        assert split == ((4, 8) if c.model.schedule == "learned" else (8, 4)), c.name
        assert c.train.batch_size * c.train.grad_accum * c.model.seq_len == 32_768


def test_paper_preset_evaluates_on_the_study_cadence_and_table4_budget():
    """Full evaluations with the study's checkpoints (every 2,500 steps and the last), the
    per-position loss over 488 windows of 1,024 as in its published file."""
    tc = get_preset("paper").train
    full = [s for s in range(1, tc.steps + 1) if s == tc.steps or s % tc.full_eval_interval == 0]
    assert full == [2500, 5000, 7500, 10000, 12500, 13000]
    assert tc.checkpoint_interval < tc.full_eval_interval  # checkpoints stay more frequent
    assert tc.position_tokens // 1024 == 488


def test_old_configs_with_one_seed_load_with_both_seeds_equal():
    d = micro_run("x").to_dict()
    d["seed"] = d.pop("init_seed")
    del d["data_seed"], d["train"]["optimizer"]
    old = RunConfig.from_dict(d)
    assert (old.init_seed, old.data_seed, old.train.optimizer) == (42, 42, "adamw")


def test_eight_bit_optimizer_falls_back_on_a_cpu_with_a_warning():
    model = FibLM(micro_run("x").model)
    tc = dataclasses.replace(get_preset("micro").train, optimizer="adamw8bit")
    built = build_optimizer(model, tc, torch.device("cpu"))
    assert built.name == "adamw" and isinstance(built.optimizer, torch.optim.AdamW)
    assert "adamw8bit unavailable" in built.warning and "CUDA" in built.warning
    plain = build_optimizer(model, get_preset("micro").train, torch.device("cpu"))
    assert (plain.name, plain.warning) == ("adamw", None)
    assert plain.optimizer.defaults["eps"] == 1e-8 and plain.optimizer.defaults["betas"] == (0.9, 0.95)


def test_unknown_optimizer_in_a_matrix_is_one_line_exit_2_nothing_queued(tmp_path, monkeypatch, capsys):
    from fibctl.cli import main

    matrix = tmp_path / "m.toml"
    matrix.write_text('[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\n'
                      'window = 4\ntrain = { optimizer = "sgd" }\n')
    db = tmp_path / "r.db"
    monkeypatch.setattr(sys, "argv", ["fibctl", "queue", "add", str(matrix), "--db", str(db)])
    with pytest.raises(SystemExit) as done:  # fibctl's main in this process: no new Python to start
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err
    assert "unknown optimizer 'sgd'; allowed: adamw, adamw8bit" in err
    assert len(err.strip().splitlines()) == 1
    if db.exists():
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)


@pytest.mark.parametrize("override,problem", [
    ("steps = 0", "train.steps = 0 must be >= 1"),
    ('steps = "20"', "train.steps = '20' must be an integer"),
    ("lr = nan", "train.lr = nan must be a finite number"),
    ("batch_size = 0", "train.batch_size = 0 must be >= 1"),
    ("beta2 = 1.0", "train.beta2 = 1.0 is out of range"),
    ("full_eval_interval = 0", "train.full_eval_interval = 0 must be >= 1"),
    ("position_tokens = 1.5", "train.position_tokens = 1.5 must be an integer"),
    ("eval_tokens = 63", "train.eval_tokens = 63 is below one window of 64 tokens"),
    ("final_eval_tokens = 1", "train.final_eval_tokens = 1 is below one window of 64 tokens"),
])
def test_train_overrides_are_validated_when_the_matrix_is_read(tmp_path, override, problem):
    matrix = tmp_path / "m.toml"
    matrix.write_text(f'[matrix]\npreset = "micro"\n\n[[runs]]\nname = "a"\nschedule = "fixed"\n'
                      f'window = 4\ntrain = {{ {override} }}\n')
    with pytest.raises(FibctlError, match=re.escape(problem)):
        load_matrix(str(matrix))


@pytest.mark.parametrize("seeds,problem", [
    (dict(seed=-1), "^seed = -1 must be"),  # the seed given, not init_seed, which defaults to it
    (dict(seed=2**32), "^seed = 4294967296 must be an integer from 0 to 2\\*\\*32 - 1$"),
    (dict(seed=1, init_seed=2**32), "^init_seed = 4294967296 must be"),
])
def test_seeds_are_validated(seeds, problem):
    with pytest.raises(ConfigError, match=problem):
        RunConfig.resolve("a", "m", "micro", schedule="fixed", **seeds)
    RunConfig.resolve("a", "m", "micro", schedule="fixed", seed=2**32 - 1)  # the largest numpy takes


def _replicates_db(path, init_seeds):
    """Two W=12 replicates of one micro configuration with final evaluations; the first
    recorded as trained with adamw though its config asks for adamw8bit."""
    from fibctl.db.engine import connect
    from fibctl.db.store import RunRecorder
    from fibctl.queue import add_runs, list_runs

    configs = [RunConfig.resolve(f"r{s}", "m", "micro", schedule="stagger", window=12, seed=s, init_seed=i,
                                 optimizer="adamw8bit")
               for s, i in zip((42, 43), init_seeds)]
    engine = connect(str(path))
    add_runs(engine, configs)
    for row, ppl in zip(list_runs(engine), (40.0, 41.0)):
        rec = RunRecorder(engine, row["id"])
        rec.log_eval(30, "docs_val", 64, 4096, math.log(ppl))
        rec.update_run(final_step=30, optimizer="adamw" if row["name"] == "r42" else "adamw8bit")
    return engine


@pytest.mark.parametrize("init_seeds,varied", [((42, 42), "data"), ((42, 43), "init + data")])
def test_table5_says_which_seeds_varied_and_notes_the_optimizer_deviation(tmp_path, init_seeds, varied):
    from fibctl.reports import render, tables

    engine = _replicates_db(tmp_path / "r.db", init_seeds)
    t = tables.table5(engine, dataset="docs_val")
    assert t.frame["Varied"].tolist() == [varied]
    assert "Deviation: r42 trained with adamw, not adamw8bit as configured." in t.notes
    assert "Deviation: r42" in render.render(t, "md") and "Deviation: r42" in render.render(t, "rich")
    assert "r43" not in " ".join(t.notes)
    t1 = tables.table1(engine, seed=42)
    assert t1.notes == ["Deviation: r42 trained with adamw, not adamw8bit as configured."]


def test_the_worker_records_the_optimizer_it_used_and_warns(tmp_path):
    from sqlalchemy import text

    from fibctl.flows.worker import WorkerOptions, work
    from train_helpers import queued_db

    class Display:
        warnings = []

        def start(self, name, steps):
            return lambda p: None

        def warn(self, message):
            self.warnings.append(message)

        def note(self, message):
            pass

        def finish(self, outcome):
            assert outcome.status == "done", outcome

    data = write_data(tmp_path / "data")
    engine = queued_db(tmp_path / "r.db", micro_run("eight", optimizer="adamw8bit", steps=4, eval_interval=4,
                                                    checkpoint_interval=4))
    display = Display()
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs", device="cpu"), display)
    with engine.connect() as conn:
        used = conn.execute(text("SELECT optimizer, init_seed, data_seed FROM runs")).one()
        events = conn.execute(text("SELECT message FROM events WHERE kind = 'deviation'")).scalars().all()
    assert tuple(used) == ("adamw", 42, 42)
    assert len(display.warnings) == 1 and "adamw8bit unavailable" in display.warnings[0]
    assert events and "training with adamw" in events[0]


def test_coprime_where_the_study_defines_no_stride_is_said_and_recorded(tmp_path):
    """L = 3, 4, 6: fibctl's own choice, said by `fibctl coverage`, written as a `deviation`
    event by a run that trains so, and noted under the tables."""
    from fibctl.data.streams import load_manifest
    from fibctl.reports import tables
    from fibctl.schedules import deviations

    assert [L for L in range(1, 17) if deviations("coprime", L)] == [3, 4, 6]
    assert deviations("stagger", 4) == [] and "slots 0, 2, 1, 3" in deviations("coprime", 4)[0]
    shown = runner.invoke(app, ["coverage", "--schedule", "coprime", "--layers", "4", "--length", "128"])
    assert shown.exit_code == 0 and "note: coprime at L=4" in shown.output.replace("\n", " ")

    events = []

    class Events:
        def __getattr__(self, name):
            return lambda *a, **k: events.append(a) if name == "event" else True

    base = micro_run("hdc4", "coprime", steps=1, eval_interval=1, checkpoint_interval=1)
    config = dataclasses.replace(base, model=dataclasses.replace(base.model, n_layers=4))
    Trainer(config, load_manifest(write_data(tmp_path / "data")), tmp_path / "run", Events()).run()
    assert ("deviation", deviations("coprime", 4)[0]) in events

    engine = _replicates_db(tmp_path / "r.db", (42, 42))
    from fibctl.db.store import RunRecorder
    from fibctl.queue import add_runs, list_runs
    add_runs(engine, [config])
    run_id = next(r["id"] for r in list_runs(engine) if r["name"] == "hdc4")
    RunRecorder(engine, run_id).log_eval(1, "docs_val", 64, 4096, math.log(50.0))
    RunRecorder(engine, run_id).update_run(final_step=1)
    notes = tables.table1(engine, seed=42).notes
    assert any(n.startswith("Deviation: hdc4: coprime at L=4") for n in notes)


@pytest.mark.parametrize("schedule", SPARSE)
@pytest.mark.parametrize("base", BASES)
def test_a_prefix_is_read_as_the_model_built_at_its_length_reads_it(schedule, base):
    """A model built at T and fed fewer tokens keeps the rungs of T (pow2's base is that of the
    length it is built at; docs/method.md): its output on a prefix is the prefix of its output.
    Rebuilt from the input's length, a stagger layer at alpha 0.5 lost pow2's rung 0.5 * 32."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(get_preset("micro").model, schedule=schedule, base=base, n_layers=3, window=2)
    model = FibLM(cfg).eval()
    if schedule == "learned":
        with torch.no_grad():
            for block, theta in zip(model.blocks, (-5.0, 0.3, 1.7)):  # alphas 0.507, 1.07, 1.35
                block.attn.theta.fill_(theta)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    with torch.no_grad():
        whole = model(idx)
        for t in (1, 17, 33):
            assert torch.allclose(model(idx[:, :t]), whole[:, :t], atol=1e-5, rtol=0), t
