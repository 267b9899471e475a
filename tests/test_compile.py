"""`--compile`: training steps through torch.compile equal eager within 1e-4 on the CPU, and a
machine where the compiler cannot run is refused before any run is claimed."""

from __future__ import annotations

import copy
import dataclasses
import os
import sqlite3
import subprocess
import sys

import pytest
import torch

from fibctl.config import get_preset
from fibctl.data.streams import load_manifest
from fibctl.device import compile_unavailable
from fibctl.model import FibLM
from fibctl.train.trainer import Trainer
from train_helpers import micro_run, queued_db, write_data

torch.set_num_threads(1)
UNAVAILABLE = compile_unavailable(torch.device("cpu"))
needs_compile = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"torch.compile cannot run here: {UNAVAILABLE}")


class Steps:
    """A reporter that keeps the logged training losses and the events."""

    def __init__(self):
        self.losses, self.events = {}, []

    def log_step(self, step, loss, *rest):
        self.losses[step] = loss

    def event(self, kind, message, data=None):
        self.events.append(kind)

    def __getattr__(self, name):
        return lambda *a, **k: True


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data"))


@needs_compile
@pytest.mark.parametrize("schedule", ["fixed", "learned", "dense"])
def test_a_compiled_micro_model_has_the_loss_and_gradients_of_eager(schedule):
    cfg = dataclasses.replace(get_preset("micro").model, schedule=schedule, window=4)
    torch.manual_seed(0)
    eager = FibLM(cfg)
    if schedule == "learned":
        with torch.no_grad():
            for block in eager.blocks:
                block.attn.theta.fill_(0.3)  # every rung fractional: theta gets a gradient
    twin = copy.deepcopy(eager)
    twin.prepare(cfg.seq_len, "cpu")
    compiled = torch.compile(twin)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second call runs the compiled graph without recompiling
        twin.zero_grad(set_to_none=True)
        loss_c = compiled(x[:, :-1], x[:, 1:])
        loss_c.backward()
    loss_e = eager(x[:, :-1], x[:, 1:])
    loss_e.backward()
    assert abs(float(loss_c.detach()) - float(loss_e.detach())) < 1e-4
    for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
        assert q.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-4, rtol=0), name
    if schedule == "learned":
        assert float(eager.blocks[0].attn.theta.grad.abs()) > 0


@needs_compile
def test_a_compiled_learned_model_does_not_recompile_as_alpha_moves():
    # alpha's rungs are read on the host: traced, their values became guards and every
    # optimizer step recompiled (5 s a step on the CPU for `micro`)
    cfg = dataclasses.replace(get_preset("micro").model, schedule="learned", window=4)
    torch.manual_seed(0)
    model = FibLM(cfg)
    model.prepare(cfg.seq_len, "cpu")
    compiled = torch.compile(model)
    opt = torch.optim.SGD([b.attn.theta for b in model.blocks], lr=1.0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    alphas = []
    for step in range(4):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            compiled(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        alphas.append([float(b.attn.alpha.detach()) for b in model.blocks])
    assert alphas[0] != alphas[-1]  # alpha moved, and nothing was recompiled for it


@needs_compile
@pytest.mark.parametrize("measured_first", [True, False])
def test_auto_layers_measure_their_path_before_they_are_compiled(measured_first):
    # auto is the CUDA default: traced unmeasured, a layer took gather, the slowest integer
    # path there; choose_paths measures eagerly at the training shapes first
    from fibctl import attention

    cfg = dataclasses.replace(get_preset("micro").model, schedule="stagger", window=4)
    attention._chosen.clear()
    model = FibLM(cfg, impl="auto")
    before = [p.detach().clone() for p in model.parameters()]
    if measured_first:
        model.choose_paths(4, cfg.seq_len, "cpu")
        assert len(attention._chosen) == cfg.n_layers  # one setting per layer: their distances differ
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.prepare(cfg.seq_len, "cpu")
    defaults = attention.traced_defaults
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    torch.compile(model)(x[:, :-1], x[:, 1:]).backward()
    assert (attention.traced_defaults == defaults) == measured_first


@needs_compile
def test_a_compiled_training_run_follows_the_eager_one(data, tmp_path):
    config = micro_run("c", "stagger", steps=6, log_interval=1, checkpoint_interval=6)
    runs = {}
    for compiled in (False, True):
        reporter = Steps()
        trainer = Trainer(config, load_manifest(data), tmp_path / str(compiled), reporter, compile=compiled)
        assert trainer.run().status == "done"
        runs[compiled] = reporter, trainer.model.state_dict()
    (eager, eager_weights), (comp, comp_weights) = runs[False], runs[True]
    assert sorted(comp.losses) == list(range(1, 7))
    for step, loss in eager.losses.items():
        assert abs(comp.losses[step] - loss) < 1e-4, step
    for name, w in eager_weights.items():  # 3.5e-5 measured: AdamW's step amplifies rounding, hence 1e-3
        assert torch.allclose(w, comp_weights[name], atol=1e-3, rtol=0), name
    assert "compiled" in comp.events and "compiled" not in eager.events


def test_compile_without_a_compiler_is_one_line_exit_2_and_the_run_stays_queued(data, tmp_path):
    db = tmp_path / "r.db"
    queued_db(db, micro_run("run")).dispose()
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++")}  # inductor's C++ compiler
    for args in (["train", "run"], ["worker"]):
        done = subprocess.run([sys.executable, "-m", "fibctl", *args, "--compile", "--db", str(db),
                               "--data", str(data), "--runs-dir", str(tmp_path / "runs"), "--device", "cpu"],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
        assert "--compile: torch.compile cannot run on cpu" in done.stderr and "C++ compiler" in done.stderr
    rows = sqlite3.connect(db).execute("select status, attempts from runs").fetchall()
    assert rows == [("queued", 0)]
    assert not (tmp_path / "runs" / "run").exists()
