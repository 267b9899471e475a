"""Training and scoring one mechanism-probe run (docs/method.md, "Table 2: the mechanism probe").

A probe run is a run: the worker claims it, and `ProbeTrainer` shares the training loop,
checkpoints, bit-exact resume, stop and heartbeat handling of `Trainer`; only the data (fresh
marked shift-copy batches, fibctl.probe.task), the attention (blur rungs whose width anneals,
fibctl.probe.blur), the optimizer and what is measured differ. Alphas are logged every
`eval_interval` steps; at the last step the model is scored on held-out sequences and the
accuracy at each distance goes to aux_metrics under PROBE_METRICS, which Table 2 reads.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fibctl.device import autocast
from fibctl.model import NonFiniteAlpha
from fibctl.probe.cells import PROBE_METRICS
from fibctl.probe.task import IGNORE, MarkedBatches, MarkedCopy, heldout_generator
from fibctl.schedules import ALPHA_MIN, ALPHA_RANGE, probe_alphas
from fibctl.train.optim import EPS, marks_writes
from fibctl.train.trainer import Reporter, Trainer

SCORE_BATCH = 4  # held-out sequences per forward pass when scoring
# seconds between heartbeats while scoring: a long scoring (many --eval-sequences) must not
# look abandoned to other workers (worker --heartbeat-timeout, default 600 s)
SCORE_HEARTBEAT_S = 30.0


def set_alphas(model, alphas: list[float]) -> None:
    """theta of each layer such that alpha = 0.5 + sigmoid(theta) is `alphas[l]`."""
    with torch.no_grad():
        for block, alpha in zip(model.blocks, alphas):
            u = (alpha - ALPHA_MIN) / ALPHA_RANGE
            block.attn.theta.fill_(math.log(u / (1 - u)))


class ProbeTrainer(Trainer):
    def __init__(self, config, run_dir: Path, reporter: Reporter, *, device: torch.device = torch.device("cpu"),
                 stop: threading.Event | None = None, on_progress=None, on_checkpoint=None):
        if config.probe is None:
            raise ValueError(f"run {config.name!r} is not a probe run")
        self._setup(config, run_dir, reporter, device, stop, on_progress, on_checkpoint, group=None)
        self.probe = config.probe.validate(config.model)
        self.task = MarkedCopy.of(config.model, self.probe)
        self.data_hash, self.heldout = self.task.hash, {}
        self.holds_data = self.data_hash.__eq__
        self._build(compile=False)
        set_alphas(self.model, probe_alphas(self.probe.init, config.model.n_layers))
        # as the study's probe code trains (docs/method.md): AdamW at lr 1e-3,
        # torch's AdamW with its defaults, weight decay on every parameter
        # (theta and the norm scales included), at a constant lr. Fused: the same update in one
        # pass over the weights instead of a dozen (it differs from the default by rounding).
        self.optimizer = marks_writes(torch.optim.AdamW(
            self.model.parameters(), lr=self.tc.lr, betas=(self.tc.beta1, self.tc.beta2), eps=EPS,
            weight_decay=self.tc.weight_decay, fused=True))
        self.optimizer_name, self.optimizer_warning = "adamw", None
        self.sampler = MarkedBatches(self.task, self.tc.batch_size, config.data_seed)

    def train_step(self) -> tuple[float, float]:
        self.model.set_blur_width(self.probe.width_at(self.step - 1, self.tc.steps))  # self.step: this one
        return super().train_step()

    def _evaluate_and_checkpoint(self) -> tuple[Path | None, str | None]:
        """(the checkpoint written at this step, if one is due; the probe scores no held-out loss
        during training, but an alpha this step made NaN, which nothing can record, score or
        resume from, is said as a divergence: nothing logged or written)."""
        final = self.step == self.tc.steps
        log = final or self.step % self.tc.eval_interval == 0
        save = final or self.step % self.tc.checkpoint_interval == 0
        if log or save:
            try:
                alphas = self.model.finite_alphas()
            except NonFiniteAlpha as e:
                return None, e.reading
        if log:
            self.reporter.log_alphas(self.step, alphas)
            self._heartbeat()
        if final and self.score() is None:  # the run was taken over while it scored
            return None, None
        return (self.save() if save else None), None

    def score(self) -> dict[str, float] | None:
        """Accuracy (argmax = target) at each distance over `eval_sequences` held-out sequences,
        at the last step's width; recorded with the depth, the init and the held-out loss.
        Heartbeats every SCORE_HEARTBEAT_S seconds while it scores; None, nothing recorded,
        when a heartbeat finds the run no longer ours."""
        n = self.probe.eval_sequences
        x, y = self.task.sample(n, heldout_generator(self.config.data_seed))
        self.model.set_blur_width(self.probe.width_at(self.tc.steps - 1, self.tc.steps))
        distances = self.probe.distances
        correct, total = [0] * len(distances), [0] * len(distances)  # exact counts at any size
        loss_sum, loss_n = 0.0, 0
        beat = time.monotonic()
        with torch.no_grad():
            for s in range(0, n, SCORE_BATCH):
                if time.monotonic() - beat >= SCORE_HEARTBEAT_S:
                    self._heartbeat()
                    if self.lost:
                        return None
                    beat = time.monotonic()
                xb, yb = x[s:s + SCORE_BATCH].to(self.device), y[s:s + SCORE_BATCH].to(self.device)
                with autocast(self.device):
                    logits = self.model(xb).float()
                scored = yb != IGNORE
                loss_sum += float(F.cross_entropy(logits[scored], yb[scored], reduction="sum"))
                loss_n += int(scored.sum())
                hit = (logits.argmax(-1) == yb) & scored
                marker = self.task.marker(xb)
                for k in range(len(distances)):
                    correct[k] += int((hit & (marker == k)).sum())
                    total[k] += int((scored & (marker == k)).sum())
        # a distance no scored position asks for has no accuracy: None, NULL in the database
        # (a NaN is NULL on SQLite but a number on PostgreSQL, where it made Table 2's mean NaN)
        metrics = {"depth": self.config.model.n_layers, "staggered_init": int(self.probe.init == "staggered"),
                   **{f"acc_d{d}": correct[k] / total[k] if total[k] else None
                      for k, d in enumerate(distances)},
                   "eval_sequences": n, "heldout_loss": loss_sum / max(1, loss_n)}
        for name, value in metrics.items():
            self.reporter.log_metric(PROBE_METRICS, name, None if value is None else float(value))
        self.reporter.log_metric(PROBE_METRICS, "task", text=self.task.label)  # Table 2 groups by it
        return metrics
