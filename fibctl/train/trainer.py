"""The training loop: the recipe of docs/method.md ("Training") on one device, resumable at any checkpoint.

It reports through `Reporter` (the database's `RunRecorder` implements it) and knows
nothing of SQL or queues. Each step accumulates `grad_accum` micro-batches, clips the
gradient norm, sets the scheduled lr and steps AdamW. Light evaluations run every
`eval_interval` steps on `eval_tokens` per held-out set; full ones (`final_eval_tokens`)
every `full_eval_interval` steps (unset: at every checkpoint) and at the last step, which
also records the per-position loss at the training length (Table 4, over the windows of
`position_tokens`). Alphas are logged at step 0 and, for `learned`, at every
evaluation. With `compile`, the training steps run through torch.compile (evaluations and
checkpoints use the same weights, eagerly): equal to eager within float rounding, not bit
for bit. With a `group` (fibctl.train.distributed: one run over several processes), each
rank computes its block of a step's micro-batches, DistributedDataParallel averages the
gradients and the loss is scaled so that the step equals one process's; rank 0 alone
evaluates and writes checkpoints, and stops and losses are decided by all ranks together.
A stop request (SIGTERM, Ctrl-C) ends the step in progress, writes a
checkpoint and returns; a NaN or infinite loss, or a learned alpha that is NaN (the model
raises NonFiniteAlpha where it would place the rungs), ends the run as diverged; a heartbeat
that finds the run cancelled or taken over ends it as lost, without touching its checkpoints.

Seeds follow the study: the initial weights are drawn after seeding with `init_seed`, then
everything else (the batch sampler included) is seeded with `data_seed`.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from fibctl.attention import agreeing, default_impl
from fibctl.config import SAMPLERS, RunConfig
from fibctl.data.streams import DataManifest
from fibctl.device import autocast
from fibctl.errors import FibctlError, WorkerError, first_line, shell_word, shown_path
from fibctl.flops import mfu, peak_flops, training_flops_per_token
from fibctl.metrics import stream_loss
from fibctl.model import FibLM, NonFiniteAlpha
from fibctl.schedules import deviations, rungs_always_kept
from fibctl.train import checkpoint as ckpt
from fibctl.train.distributed import Group, as_peer_lost, check_split, peer_failure
from fibctl.train.optim import build_optimizer, clip_gradients, lr_at, set_lr
from fibctl.train.sampler import WindowSampler
from fibctl.units import eta_s


class Reporter(Protocol):
    """Where the loop's measurements go (implemented by `fibctl.db.store.RunRecorder`)."""

    # `mfu`: for the dashboards (`--log-to`); the database keeps tokens_per_s, which gives it
    def log_step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                 elapsed_s: float, mfu: float | None = None) -> None: ...

    # `positions`: the mean loss at each position over `windows` windows, written with it
    def log_eval(self, step: int, dataset: str, eval_length: int, tokens: int, loss: float,
                 positions: list[float] | None = None, windows: int | None = None) -> None: ...

    def log_alphas(self, step: int, alphas: list[float]) -> None: ...

    def log_metric(self, name: str, metric: str, value: float | None = None, text=None) -> None: ...

    def heartbeat(self) -> bool: ...  # False: the run is no longer ours (cancelled, taken over)

    def event(self, kind: str, message: str, data: dict | None = None) -> None: ...


@dataclass
class Progress:
    """What a display shows after each step (and its evaluations, if it had any)."""

    step: int
    steps: int
    loss: float
    tokens_per_s: float
    elapsed_s: float
    lr: float = 0.0
    step_s: float = 0.0  # mean seconds of a training step since the last logged one
    eta_s: float | None = None  # fibctl.units.eta_s: the run's pace over every attempt
    evals: dict[str, float] = field(default_factory=dict)  # held-out loss by set, at this step


@dataclass(frozen=True)
class Recorded:
    """What the run's database holds of it (the worker reads it: fibctl.queue.recorded_progress),
    which a checkpoint must not be ahead of to be resumed from (`Trainer.recorded`)."""

    step: int  # the newest step of its train_steps, evaluations and alphas rows (0: none)
    restarts: int = 0  # times it was queued again from step 0 (`fibctl queue retry --from-start`)


@dataclass
class TrainResult:
    status: str  # done | stopped (checkpointed, to be resumed) | diverged | lost (no longer ours)
    step: int  # last completed step
    checkpoint: Path | None  # the newest checkpoint
    tokens_trained: int
    wall_seconds: float  # training time over every attempt
    error: str | None = None


def check_data(config: RunConfig, manifest: DataManifest | None,
               data_dir: Path | None = None) -> DataManifest | None:
    """The data manifest, after checking it fits the run: its vocabulary, held-out sets to
    evaluate on, and a window of the run's length in every stream (raises WorkerError
    otherwise: the data folder given is at fault, not the run). A probe run makes its own data.
    `data_dir`: the --data folder, named where it does not exist (a typo, or no FIBCTL_DATA)."""
    if config.probe is not None:
        return manifest
    if manifest is None:
        raise WorkerError(_no_data(config, data_dir))
    if manifest.vocab_size != config.model.vocab_size:
        raise WorkerError(f"run {config.name!r} (preset {config.preset}) has vocab "
                          f"{config.model.vocab_size:,} but the tokenizer of {shown_path(manifest.data_dir)} has "
                          f"{manifest.vocab_size:,}")
    # the run evaluates every held-out set of the manifest (Trainer.evaluate): with none it
    # would record no evaluation, the numbers the tables read
    if not manifest.heldout:
        raise WorkerError(f"run {config.name!r} records evaluations on held-out sets, but {manifest.no_heldout}")
    # a training batch and an evaluation each read windows of seq_len inputs and the next token;
    # training, as the study drew it, never starts at the stream's last window (WindowSampler)
    window = config.model.seq_len + 1
    for split in manifest.splits:
        need = window + (split == manifest.train_split)
        if manifest.tokens[split] < need:
            # what in the recipe makes the stream longer (docs/data.md, "Held-out sets")
            more = ("train_tokens, or more documents" if split == manifest.train_split else
                    "heldout_tokens or its source's heldout_fraction, or more documents")
            raise WorkerError(f"run {config.name!r}: the {split} stream of {shown_path(manifest.data_dir)} holds "
                              f"{manifest.tokens[split]:,} tokens; seq_len {config.model.seq_len:,} needs at least "
                              f"{need:,}: prepare more data (the recipe's {more})")
    return manifest


def _no_data(config: RunConfig, data_dir: Path | None) -> str:
    """What to do when the --data folder does not exist: prepare it with the recipe of the
    run's vocabulary, the command to paste."""
    from fibctl.data.recipe import shipped_for_vocab

    if data_dir is None:
        return (f"run {config.name!r} trains on text, and the --data folder does not exist: give a prepared one "
                "(fibctl data prepare makes one)")
    recipe = shipped_for_vocab(config.model.vocab_size) or "RECIPE"
    return (f"run {config.name!r} trains on text, and the --data folder {shown_path(data_dir)} does not exist: "
            f"prepare it (`fibctl data prepare {recipe} --data {shell_word(data_dir)}`) or give the one you prepared "
            "(--data, FIBCTL_DATA)")


class Trainer:
    def __init__(self, config: RunConfig, data: DataManifest, run_dir: Path, reporter: Reporter, *,
                 device: torch.device = torch.device("cpu"), stop: threading.Event | None = None,
                 on_progress: Callable[[Progress], None] | None = None,
                 on_checkpoint: Callable[["TrainResult"], None] | None = None, compile: bool = False,
                 group: Group | None = None):
        self._setup(config, run_dir, reporter, device, stop, on_progress, on_checkpoint, group)
        manifest = check_data(config, data)
        if group is not None:
            check_split(self.tc.grad_accum, group.world, config.name)
        self.data_hash, self.holds_data = manifest.data_hash, manifest.holds
        self.heldout = {name: manifest.stream(name) for name in manifest.heldout}
        self._build(compile)
        self.sampler = WindowSampler(manifest.stream(manifest.train_split), config.model.seq_len,
                                     self.tc.batch_size, config.data_seed)

    def _setup(self, config: RunConfig, run_dir: Path, reporter: Reporter, device: torch.device,
               stop: threading.Event | None, on_progress, on_checkpoint, group: Group | None) -> None:
        self.config, self.tc = config, config.train
        self.run_dir, self.reporter, self.device = Path(run_dir), reporter, device
        self.stop = stop or threading.Event()
        self.on_progress, self.on_checkpoint = on_progress, on_checkpoint
        self.on_warning: Callable[[str], None] | None = None  # a line for the user, beside the event
        self.on_resumed: Callable[[int, Path], None] | None = None  # told the step and checkpoint resumed from
        # told, once resumed or not, what draws this attempt's windows (runs.sampler records it)
        self.on_sampler: Callable[[str], None] | None = None
        self.lost = False
        self.group, self.main = group, group is None or group.main
        self.step, self.elapsed_s = 0, 0.0
        # the newest step whose rows (train step, evaluations, alphas) this run recorded, as its
        # checkpoints say; `recorded`: what the database holds (None: nothing to check against)
        self.logged_step = 0
        # the newest step whose every write (its train step, evaluations, alphas) is done: a
        # checkpoint of a later one would resume past rows the database never got
        self.complete_step = 0
        self.recorded: Recorded | None = None
        # reads `recorded` again (None: it cannot change, as under DDP, where every rank has rank 0's)
        self.recount: Callable[[], Recorded] | None = None
        self.peak = peak_flops(device)  # None on the CPU: no MFU
        self.evals: dict[str, float] = {}  # the held-out losses of the step in progress, for the display

    def _build(self, compile: bool) -> None:
        """The model (drawn after seeding with init_seed), its DDP and compiled wrappers, and
        the optimizer (after seeding with data_seed)."""
        config, device, group = self.config, self.device, self.group
        _seed_everything(config.init_seed)
        self.model = FibLM(config.model, default_impl(device)).to(device)
        self.compiled, self.ddp = compile, None
        if compile:  # before DDP's hooks: a traced layer cannot measure which path is fastest
            with self._agreeing():
                self.model.choose_paths(self.tc.batch_size, config.model.seq_len, device)
        self.step_model: torch.nn.Module = self.model
        if group is not None:
            from torch.nn.parallel import DistributedDataParallel

            m = config.model
            # a learned layer whose rungs can all fall inside the window (a window large for its
            # length) leaves theta out of the loss, its gradient empty in one process: DDP must
            # expect that there, and only there (it costs a graph walk and a warning per rank)
            unused = m.schedule == "learned" and not rungs_always_kept(m.base, m.window, m.seq_len, m.n_rungs)
            self.ddp = self.step_model = DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=unused)
        if compile:  # the caller checked that it can run (fibctl.device.check_compile)
            self.model.prepare(config.model.seq_len, device)
            self.step_model = torch.compile(self.step_model)
        _seed_everything(config.data_seed)
        built = build_optimizer(self.model, self.tc, device)
        self.optimizer, self.optimizer_name, self.optimizer_warning = built.optimizer, built.name, built.warning
        self.optimizer_fused = built.fused

    def _agreeing(self) -> contextlib.AbstractContextManager:
        """Where every rank runs the model alike (its training steps): each rank takes rank 0's
        choice of attention path (`auto`), which they could otherwise measure differently."""
        return agreeing(self.group.broadcast) if self.group is not None else contextlib.nullcontext()

    @property
    def tokens_per_step(self) -> int:
        return self.config.tokens_per_step

    def _mfu(self, tokens_per_s: float) -> float | None:
        """The MFU of `tokens_per_s` (global, over every rank's device), None without a peak;
        counted at the alphas of the step just taken."""
        if self.peak is None:
            return None
        try:
            per_token = training_flops_per_token(self.model, self.config.model.seq_len)
        except NonFiniteAlpha:  # the step made an alpha NaN: no rungs to count; the next forward ends the run
            return None
        return mfu(per_token, tokens_per_s, self.peak, self.group.world if self.group is not None else 1)

    # ------------------------------------------------------------------ the loop

    def run(self) -> TrainResult:
        if self.optimizer_warning:
            self.reporter.event("deviation", self.optimizer_warning,
                                {"requested": self.tc.optimizer, "used": self.optimizer_name})
        if self.optimizer_fused:
            self.reporter.event("fused_optimizer", "AdamW steps in torch's fused CUDA kernel",
                                {"torch": torch.__version__})
        if self.compiled:
            self.reporter.event("compiled", "training steps run through torch.compile", {"torch": torch.__version__})
        for note in deviations(self.config.model.schedule, self.config.model.n_layers):
            self.reporter.event("deviation", note)
        last = self.resume()
        if self.on_sampler and self.sampler.kind:
            self.on_sampler(self.sampler.kind)
        if self.group is not None:
            self._check_same_start()
        self._attempt_start, self._elapsed_before = time.perf_counter(), self.elapsed_s
        if self.step == 0 and self.config.model.schedule != "dense":
            self.reporter.log_alphas(0, self.model.alphas())
        step_time, steps_timed = 0.0, 0  # training time since the last log line: tokens/s
        while self.step < self.tc.steps:
            t0 = time.perf_counter()
            self.step += 1
            try:
                loss, grad_norm = self.train_step()
            except NonFiniteAlpha as e:  # the step before made theta NaN: as a loss of NaN would show it
                return self._diverged(e.reading)
            except RuntimeError as e:  # DDP's gradient exchange failing: another rank died or hangs
                if self.group is not None and peer_failure(e):
                    raise as_peer_lost(e) from None
                raise
            if not math.isfinite(loss):
                return self._diverged(loss)
            step_time, steps_timed = step_time + time.perf_counter() - t0, steps_timed + 1
            tokens_per_s, step_s = steps_timed * self.tokens_per_step / step_time, step_time / steps_timed
            self._tick()
            if self.step % self.tc.log_interval == 0 or self.step == self.tc.steps:
                self.reporter.log_step(self.step, loss, lr_at(self.step, self.tc), grad_norm,
                                       tokens_per_s, self.elapsed_s, self._mfu(tokens_per_s))
                self.logged_step = self.step
                self._heartbeat()
                step_time, steps_timed = 0.0, 0
            unscored = None  # a held-out loss that is not finite: weights this step made NaN or infinite
            self.evals = {}
            if not self.lost:
                saved, unscored = self._evaluate_and_checkpoint()
                last = saved or last
                if unscored is None:
                    self.complete_step = self.step
            if self.on_progress and unscored is None:  # after the evaluations, so that it shows them
                self._tick()
                self.on_progress(Progress(self.step, self.tc.steps, loss, tokens_per_s, self.elapsed_s,
                                          lr_at(self.step, self.tc), step_s,
                                          eta_s(self.step, self.tc.steps, self.elapsed_s), self.evals))
            stopping = self.stop.is_set()  # read once: a signal may set it at any moment
            if self.group is not None:  # every rank leaves the loop at the same step, the same way
                self.lost, stopping, diverged = self.group.any(self.lost, stopping, unscored is not None,
                                                               device=self.device)
                if diverged and unscored is None:  # rank 0 scored it
                    unscored = "a held-out loss that is not finite"
            if unscored is not None:
                return self._diverged(unscored)
            if self.lost:
                return self._result("lost", last, LOST)
            if stopping and self.step < self.tc.steps:
                if last != ckpt.checkpoint_path(self.run_dir, self.step):
                    saved = self.save() if self.main else ckpt.checkpoint_path(self.run_dir, self.step)
                    if saved is None:
                        return self._result("lost", last, LOST)
                    last = saved
                self.reporter.event("stopped", f"stopped at step {self.step}; checkpoint {last}",
                                    {"step": self.step})
                return self._result("stopped", last)
        return self._result("done", last)

    def _tick(self) -> None:
        """Wall seconds of training over every attempt, evaluations and checkpoints included."""
        self.elapsed_s = self._elapsed_before + time.perf_counter() - self._attempt_start

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over grad_accum micro-batches: (mean loss, grad norm before clipping)."""
        set_lr(self.optimizer, lr_at(self.step, self.tc))
        # float64, as the study summed each micro-batch's float32 loss into a Python float
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        mine = self.group.micro_batches(self.tc.grad_accum) if self.group else range(self.tc.grad_accum)
        # DDP averages the ranks' gradients: each rank divides by its own count of micro-batches
        # (grad_accum / ranks), so that the average is the one-process sum of loss / grad_accum
        share = len(mine)
        for i in range(self.tc.grad_accum):
            if i not in mine:
                self.sampler.skip_batch()
                continue
            x, y = self.sampler.next_batch(self.device)
            # gradients are exchanged once, after this rank's last micro-batch
            sync = self.ddp is None or i == mine[-1]
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with autocast(self.device), self._agreeing():
                    loss = self.step_model(x, y) / share
                loss.backward()
            total += loss.detach()
        if self.group is not None:
            total = self.group.sum(total) / self.group.world
        grad_norm = clip_gradients(self.model, self.tc.clip_bound)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total), float(grad_norm)  # one device sync per step

    def _evaluate_and_checkpoint(self) -> tuple[Path | None, str | None]:
        """(the checkpoint written at this step, if one is due; what a held-out set scored if it
        is not finite, in which case nothing is recorded and no checkpoint written)."""
        final = self.step == self.tc.steps
        save = final or self.step % self.tc.checkpoint_interval == 0
        full = final or self.step % (self.tc.full_eval_interval or self.tc.checkpoint_interval) == 0
        if not self.main:  # rank 0 evaluates and writes the checkpoint
            return (ckpt.checkpoint_path(self.run_dir, self.step) if save else None), None
        if full or self.step % self.tc.eval_interval == 0:
            unscored = self.evaluate(self.tc.final_eval_tokens if full else self.tc.eval_tokens, positions=final)
            if unscored is not None:
                return None, unscored
        if self.lost:  # its heartbeat said the run is another worker's now: not into that one's folder
            return None, None
        if save and self.config.model.schedule == "learned":
            try:  # a checkpoint without an evaluation before it: no NaN alpha is saved to resume from
                self.model.finite_alphas()
            except NonFiniteAlpha as e:
                return None, e.reading
        return (self.save() if save else None), None

    def evaluate(self, tokens: int, positions: bool) -> str | None:
        """Score every held-out set at the training length into the database; None, or (a loss
        that is not finite: the step's update diverged where its training loss did not yet
        show it) what it scored (or the learned alpha it found NaN), the sets after it not
        scored and no alpha recorded."""
        T = self.config.model.seq_len
        for name, stream in self.heldout.items():
            try:
                res = stream_loss(self.model, stream, T, tokens, self.device,
                                  position_tokens=self.tc.position_tokens if positions else None)
            except NonFiniteAlpha as e:  # the step made theta NaN: no loss to score, as a NaN one
                return e.reading
            if not math.isfinite(res.loss):
                return f"a held-out loss of {res.loss} on {name}"
            self.reporter.log_eval(self.step, name, T, res.tokens, res.loss,
                                   *((res.position_losses.tolist(), res.position_windows) if positions else ()))
            self.logged_step = self.step
            self.evals[name] = res.loss
            self._heartbeat()
        if self.config.model.schedule == "learned":
            self.reporter.log_alphas(self.step, self.model.alphas())
        return None

    # ------------------------------------------------------------------ checkpoints

    def write_checkpoint(self) -> Path:
        """The checkpoint file of the current step, and nothing else (no report, no callback)."""
        self._tick()
        state = {
            "step": self.step, "elapsed_s": self.elapsed_s, "config": self.config.to_dict(),
            "config_hash": self.config.config_hash, "data_hash": self.data_hash,
            "optimizer_name": self.optimizer_name,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(), "rng": ckpt.rng_states(),
            # what the database held of the run when it was written (Trainer._check_recorded)
            "logged_step": self.logged_step, "restarts": self.recorded.restarts if self.recorded else 0,
        }
        return ckpt.save_checkpoint(self.run_dir, self.step, state, self.tc.keep_checkpoints)

    def save(self) -> Path | None:
        """Write the step's checkpoint and report it; None, nothing written, where a heartbeat
        finds the run no longer ours: one removed (`queue rm --checkpoints`) since the last
        heartbeat would have its folder made again, in the way of the name queued anew."""
        self._heartbeat()
        if self.lost:
            return None
        path = self.write_checkpoint()
        self.reporter.event("checkpoint", f"step {self.step}: {shown_path(path)}", {"step": self.step, "path": str(path)})
        if self.on_checkpoint:
            self.on_checkpoint(self._result("running", path))
        return path

    def resume(self) -> Path | None:
        """Load the newest checkpoint of the run that loads, if any; returns its path.

        Stale temporary files of interrupted saves are deleted first. A checkpoint that is
        damaged (truncated, a part missing) is moved aside as `step_N.pt.damaged`, with a
        `damaged` event naming it: training goes on from the one before, and the rows logged
        past it are written again as the steps are. With none that loads the run fails, naming
        the way out (`fibctl queue retry NAME --from-start`). A checkpoint of another run, of
        another optimizer, refused as unsafe or that the database does not account for
        (`_check_recorded`) stops the resume: it is not damage."""
        if self.main:  # the other ranks see the same folder: one process tidies it
            ckpt.remove_temporaries(self.run_dir)
        damaged: list[tuple[Path, str]] = []
        for path in reversed(ckpt.list_checkpoints(self.run_dir)):
            try:
                self._load(path)
            except ckpt.DamagedCheckpoint as e:
                damaged.append((path, str(e)))
                continue
            except FibctlError:
                if not self.main and not path.exists():  # rank 0 moved it aside meanwhile: damaged
                    continue
                raise
            self._set_aside(damaged, f"resuming from step {self.step}", path)
            self.reporter.event("resumed", f"resumed from step {self.step}: {shown_path(path)}", {"step": self.step})
            if self.on_resumed:
                self.on_resumed(self.step, path)
            if self.sampler.kind == "torch":
                self._say_older_order()
            return path
        if damaged:
            self._set_aside(damaged, "and no checkpoint is left to resume from", None)
            raise FibctlError(no_checkpoint_loads(self.config.name, damaged[0][1]))
        return None

    def _load(self, path: Path) -> None:
        """Put the checkpoint's weights, optimizer, sampler, RNGs and step in place (each part
        whole: a damaged one half applied is overwritten by the next one loaded)."""
        state = ckpt.load_checkpoint(path)
        self._check_belongs(state, path)
        logged = self._check_recorded(state, path)
        used = state.get("optimizer_name", "adamw")  # checkpoints before the choice existed: adamw
        if used != self.optimizer_name:  # this worker's lack (no CUDA, no bitsandbytes), not the run's
            raise WorkerError(f"checkpoint {shown_path(path)} was trained with {used}, but this worker would resume "
                              f"with {self.optimizer_name}" + (f" ({self.optimizer_warning})"
                                                               if self.optimizer_warning else "")
                              + "; the run stays queued for a worker that can")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            ckpt.restore_rng_states(state["rng"])
            self.step, self.elapsed_s = state["step"], state["elapsed_s"]
            self.logged_step, self.complete_step = logged, state["step"]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:  # this run's, yet a part missing or unreadable
            raise ckpt.DamagedCheckpoint(f"checkpoint {shown_path(path)} is damaged ({type(e).__name__}: "
                                         f"{first_line(e)})") from None

    def _say_older_order(self) -> None:
        """A run resumed from a checkpoint of torch's generator keeps drawing from it (one run,
        one order), so its windows are not those its same-seed runs begun since read: said
        once, as an event and a line, before anyone compares them."""
        message = (f"resumed in its checkpoint's data order: windows from {SAMPLERS['torch']}, not "
                   "from numpy's as the study drew them; same-seed runs begun since read other windows "
                   "(docs/cli.md, \"Checkpoints, crashes and stopping\")")
        self.reporter.event("deviation", message, {"sampler": "torch"})
        if self.on_warning:
            self.on_warning(message)

    def _set_aside(self, damaged: list[tuple[Path, str]], then: str, left: Path | None) -> None:
        """Move the damaged checkpoints out of the run's list, saying which and why. The run's
        newest checkpoint is now `left`, as on_checkpoint is told: a record of one moved aside
        would send `fibctl eval` to a file that is gone. With none left (None) the record
        stays: it is how the worker tells this run's failure from a wrong --runs-dir."""
        if not (damaged and self.main):
            return
        for path, error in damaged:
            aside = ckpt.set_aside(path)
            message = f"{error}; moved aside as {aside.name}, {then}"
            self.reporter.event("damaged", message, {"path": str(aside)})
            if self.on_warning:
                self.on_warning(message)
        if self.on_checkpoint and left is not None:  # the loaded checkpoint's own step and time
            self.on_checkpoint(TrainResult("running", self.step, left, self.step * self.tokens_per_step,
                                           self.elapsed_s))

    def _check_same_start(self) -> None:
        """Every rank resumes from the step rank 0 resumed from. A node that does not see rank
        0's runs folder (no shared filesystem) would start from step 0 and train out of step
        with the others, silently."""
        lead = self.group.broadcast(self.step)
        if self.group.any(self.step != lead, device=self.device)[0]:
            mine = "" if self.step == lead else f", rank {self.group.rank} from step {self.step}"
            raise WorkerError(f"the ranks resumed {self.config.name!r} from different checkpoints (rank 0 from "
                              f"step {lead}{mine}): every node must see the same --runs-dir, on a shared "
                              "filesystem (docs/cluster.md)")

    def _check_belongs(self, state: dict, path: Path) -> None:
        """Refuse a checkpoint of another config or other data (a runs folder reused, say):
        resuming from it would report its weights as this run's."""
        theirs = ckpt.stored_config_hash(state)
        if theirs != self.config.config_hash:
            raise WorkerError(f"checkpoint {shown_path(path)} has config hash {theirs} but run {self.config.name!r} "
                              f"has {self.config.config_hash}: it is another run's; use this run's own --runs-dir")
        if not self.holds_data(state.get("data_hash", self.data_hash)):
            raise WorkerError(f"checkpoint {shown_path(path)} was trained on data {state['data_hash']} but "
                              f"{self.config.name!r} would resume on data {self.data_hash}: use the --data it "
                              "was trained on")

    def _check_recorded(self, state: dict, path: Path) -> int:
        """Refuse a checkpoint the database does not account for (with `recorded`): one written
        before the run was queued again from step 0, or one past the rows the database holds
        (restored from an older copy, say). Resuming from it would train on from weights whose
        steps and evaluations are not recorded, or not those recorded, and finish the run with
        its history missing. Returns the newest step whose rows the checkpoint says were recorded
        before it was written (one of an older fibctl: the last logged step before it, which a
        worker stopped by a failing database write may not have recorded)."""
        step, name, r = state["step"], self.config.name, self.recorded
        logged = state.get("logged_step")
        if not isinstance(logged, int) or isinstance(logged, bool):  # an older fibctl's checkpoint
            logged = (step - 1) // self.tc.log_interval * self.tc.log_interval if step > 0 else 0
        if r is None:
            return logged
        if logged > r.step and self.recount is not None:
            # read before the model was built: the worker this run was taken from may have
            # recorded the steps since, and it writes a checkpoint's rows before the file
            self.recorded = r = self.recount()
        restarts = state.get("restarts")
        if isinstance(restarts, int) and restarts < r.restarts:
            raise WorkerError(f"run {name!r} was queued again from step 0 (fibctl queue retry --from-start) after "
                              f"its checkpoint {shown_path(path)} was written: move {shown_path(self.run_dir)} away "
                              "to train the run from step 0")
        if logged > r.step:
            raise WorkerError(f"run {name!r} has rows up to step {r.step} in the database, but checkpoint "
                              f"{shown_path(path)} was written once step {logged} was recorded (a database restored "
                              "from an older copy, or another database's): resuming from it would leave steps "
                              f"{r.step + 1}-{logged} unrecorded; restore the database that recorded them, or move the "
                              f"checkpoints past step {r.step} out of {shown_path(self.run_dir)} (none left: `fibctl "
                              f"queue cancel {name}`, then `fibctl queue retry {name} --from-start`)")
        return logged

    def _heartbeat(self) -> None:
        if self.reporter.heartbeat() is False:
            self.lost = True

    def _diverged(self, loss: float | str) -> TrainResult:
        error = f"step {self.step} gave {loss if isinstance(loss, str) else f'a loss of {loss}'}"
        # shown after "failed at step N - 1"
        self.reporter.event("diverged", error, {"step": self.step})
        self.step -= 1  # the failed step did not complete
        return self._result("diverged", ckpt.latest_checkpoint(self.run_dir), error)

    def _result(self, status: str, last: Path | None, error: str | None = None) -> TrainResult:
        self._tick()
        return TrainResult(status, self.step, last, self.step * self.tokens_per_step, self.elapsed_s, error)


LOST = "the run was cancelled or taken over by another worker"


def no_checkpoint_loads(name: str, why: str) -> str:
    """The error of a run none of whose checkpoints loads: why, and the one way out."""
    return (f"{why}; no checkpoint of run {name!r} loads (moved aside as step_N.pt.damaged): "
            f"`fibctl queue retry {name} --from-start` trains it again from step 0")


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
