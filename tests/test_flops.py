"""Model FLOPs per token (fibctl.flops) against torch's own FLOP counter and a pair-by-pair
count of what each layer scores; the MFU it gives to the dashboards and `bench train`; a bad
FIBCTL_PEAK_TFLOPS refused before anything runs."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fibctl.config import SCHEDULES, get_preset
from fibctl.data.streams import load_manifest
from fibctl.errors import FibctlError
from fibctl.flops import PEAK_ENV, attended_pairs, mfu, peak_flops, training_flops_per_token
from fibctl.model import FibLM
from fibctl.train.loggers import Tee
from fibctl.train.trainer import Trainer
from train_helpers import micro_run, queued_db, write_data

torch.set_num_threads(1)
T = 48


def micro(schedule: str, impl: str = "reference", theta: float | None = None) -> FibLM:
    cfg = dataclasses.replace(get_preset("micro").model, schedule=schedule, window=4, seq_len=T)
    torch.manual_seed(0)
    model = FibLM(cfg, impl)
    if theta is not None:
        with torch.no_grad():
            for block in model.blocks:
                block.attn.theta.fill_(theta)
    return model


def counted(model: FibLM, batch: int = 2) -> dict[str, int]:
    """torch's FLOP count of one forward and backward, by aten operator."""
    x = torch.randint(0, model.cfg.vocab_size, (batch, T + 1), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        model(x[:, :-1], x[:, 1:]).backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def weight_flops(model: FibLM) -> int:
    """6 FLOPs per token for each weight of a matrix multiplication: projections, SwiGLU, tied head."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6 * (weights + model.embed.weight.numel())


def attention_flops(model: FibLM) -> float:
    """The attention part of the count per token: all of it less the weight matrices'."""
    return training_flops_per_token(model, T) - weight_flops(model)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_weight_matrices_cost_what_torch_counts(schedule):
    # the reference paths score sparse columns elementwise: every aten.mm is a weight matrix
    # (the projections, the SwiGLU and the tied head), forward and backward
    model = micro(schedule)
    flops = counted(model)
    assert weight_flops(model) * 2 * T == flops["aten.mm"]
    assert set(flops) <= {"aten.mm", "aten.bmm"}  # bmm: dense attention's, below


def test_dense_attention_costs_the_causal_half_of_what_torch_counts():
    # torch counts every (query, key) product of the T x T matmuls; a causal layer uses
    # T (T + 1) / 2 of them, the pairs fibctl counts
    model = micro("dense")
    assert attention_flops(model) * 2 * T == pytest.approx(counted(model)["aten.bmm"] * (T + 1) / (2 * T))


@pytest.mark.parametrize("schedule,theta", [("fixed", None), ("stagger", None), ("learned", None), ("learned", 0.7),
                                            ("dense", None)])
def test_attended_pairs_are_the_pairs_each_layer_scores(schedule, theta):
    model = micro(schedule, "gather", theta)
    per_layer = model.attended(T)
    brute = 0
    for dists in per_layer:  # pair by pair: query i scores key j when i - j is an attended distance
        brute += sum(1 for i in range(T) for j in range(i + 1) if i - j in set(dists))
    assert attended_pairs(per_layer, T) == brute
    heads = model.cfg.n_heads * model.cfg.head_dim
    assert attention_flops(model) == pytest.approx(12 * heads * brute / T)


def test_a_learned_layer_counts_its_kept_rungs_at_its_alpha_now():
    from fibctl.schedules import attended_distances, built_base, fractional_rungs, window_distances

    model = micro("learned", "gather")
    cfg = model.cfg
    # at alpha = 1 (theta 0) a learned layer scores what a fixed one does
    fixed = attended_distances(cfg.base, "fixed", cfg.window, cfg.n_layers, T, cfg.n_rungs)
    assert model.attended(T) == fixed
    model = micro("learned", "gather", theta=2.0)
    base = torch.tensor(built_base(cfg.base, T, cfg.seq_len, cfg.n_rungs), dtype=torch.float32)
    kept = fractional_rungs((model.blocks[0].attn.alpha.detach() * base).tolist(), cfg.window, T)
    assert model.attended(T)[0] == window_distances(cfg.window, T) + [lo for _, lo in kept] != fixed[0]


def test_peak_flops_by_device_name_and_the_environment(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops(torch.device("cpu")) is None
    for name, tflops in [("NVIDIA H200", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 80GB HBM3", 989),
                         ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA GeForce RTX 3090", 71), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda")) == (None if tflops is None else tflops * 1e12), name
    monkeypatch.setenv(PEAK_ENV, "312")
    assert peak_flops(torch.device("cpu")) == 312e12
    for bad in ("fast", "0", "-5", "nan", "inf", "", "1e308", "1e-320", "1e309"):
        monkeypatch.setenv(PEAK_ENV, bad)
        with pytest.raises(FibctlError, match=f"{PEAK_ENV}=.* must be a positive number"):
            peak_flops(torch.device("cpu"))


def test_mfu_is_the_flops_the_speed_implies_over_every_devices_peak():
    assert mfu(6e8, 1e5, 1e15) == pytest.approx(0.06)
    assert mfu(6e8, 1e5, 1e15, devices=2) == pytest.approx(0.03)
    assert mfu(6e8, 1e5, None) is None


class Steps:
    def __init__(self):
        self.steps = {}

    def log_step(self, step, loss, lr, grad_norm, tokens_per_s, elapsed_s, mfu=None):
        self.steps[step] = (tokens_per_s, mfu)

    def __getattr__(self, name):
        return lambda *a, **k: True


def test_training_reports_mfu_where_the_peak_is_known(tmp_path, monkeypatch):
    data = load_manifest(write_data(tmp_path / "data"))
    config = micro_run("m", "stagger", steps=4, log_interval=2, checkpoint_interval=4)
    monkeypatch.delenv(PEAK_ENV, raising=False)
    reporter = Steps()
    Trainer(config, data, tmp_path / "cpu", reporter).run()
    assert [m for _, m in reporter.steps.values()] == [None, None]  # a CPU has no known peak
    monkeypatch.setenv(PEAK_ENV, "0.5")
    reporter = Steps()
    trainer = Trainer(config, data, tmp_path / "peak", reporter)
    trainer.run()
    per_token = training_flops_per_token(trainer.model, config.model.seq_len)
    assert sorted(reporter.steps) == [2, 4]
    for tokens_per_s, got in reporter.steps.values():
        assert got == pytest.approx(per_token * tokens_per_s / 0.5e12)


def test_the_dashboards_get_mfu_when_there_is_one():
    sent = []

    class Sink:
        def log(self, step, values):
            sent.append(values)

    tee = Tee(Steps(), [Sink()])
    tee.log_step(1, 2.0, 1e-3, 0.5, 1000.0, 1.0)
    tee.log_step(2, 2.0, 1e-3, 0.5, 1000.0, 1.0, 0.25)
    assert "train/mfu" not in sent[0] and sent[1]["train/mfu"] == 0.25


def fibctl(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80", **(env or {})}, timeout=300, **kwargs)


def test_bench_train_reports_model_flops_and_mfu_with_a_given_peak():
    done = fibctl("bench", "train", "--preset", "micro", "--schedule", "fixed", "--steps", "2", "--warmup", "1",
                  "--json", env={PEAK_ENV: "2"})
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    for row in record["results"]:
        assert row["tflops"] == pytest.approx(row["mfu"] * 2)
        assert row["tflops"] * 1e12 / row["tokens_per_s"] > 0
    table = fibctl("bench", "train", "--preset", "micro", "--schedule", "fixed", "--steps", "2", "--warmup", "1",
                   env={PEAK_ENV: "2"})
    assert table.returncode == 0 and "MFU" in table.stdout and "TFLOP/s" in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())


def test_a_bad_peak_is_one_line_exit_2_and_the_run_stays_queued(tmp_path):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    data = write_data(tmp_path / "data")
    for args in (["train", "run"], ["worker"], ["bench", "train", "--preset", "micro"]):
        done = fibctl(*args, *(["--db", str(db), "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                                "--device", "cpu"] if args[0] != "bench" else []), env={PEAK_ENV: "fast"})
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.strip() == (f"error: {PEAK_ENV}='fast' must be a positive number of TFLOP/s, "
                                       "from 1e-06 to 1,000,000,000"), args
    assert sqlite3.connect(db).execute("select status, attempts from runs").fetchall() == [("queued", 0)]
    assert not (tmp_path / "runs" / "run").exists()
