"""Evaluation at any length: perplexity, per-position loss and inference speed.

Windows follow the study's protocol (docs/method.md, "Evaluation"): window j feeds the
`length` tokens x[jT : jT+T] and scores the `length` targets x[jT+1 : jT+T+1], windows at
stride T read in order from the start of a held-out stream, so consecutive windows share
one token (the last target of one is the first input of the next). Perplexity is
exp(mean loss) over those targets. The per-position loss (Table 4) keeps the first T-1
predicted positions of each window, as the study reports it (1023 positions of a 1024
window). The token budget is the same at every length (`tokens // length` windows), so
lengths are comparable, and the batch holds about `BATCH_TOKENS` tokens whatever the
length, so memory stays bounded: the model computes attention and the loss in chunks, and
dense attention goes through the fused (memory-linear) kernel. A length that still does
not fit is reported, not crashed on.

The training loop calls `stream_loss` for its own evaluations, so an evaluation here at
the training length reproduces the training-time one exactly.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine

from fibctl.config import RunConfig
from fibctl.data.streams import load_manifest, token_stream
from fibctl.db.schema import Run
from fibctl.db.store import RunRecorder
from fibctl.errors import FibctlError
from fibctl.model import FibLM
from fibctl.train.checkpoint import load_checkpoint, stored_config_hash, resolve_path
from fibctl.train.device import autocast, resolve_device, synchronize

BATCH_TOKENS = 65_536  # tokens per forward pass at any length
SPEED_REPEATS = 3  # timed passes per length (after one warm-up); the median is recorded


@dataclass
class StreamLoss:
    loss: float  # mean next-token cross-entropy, nats
    tokens: int  # predicted tokens the mean is over: windows * length
    windows: int
    position_losses: np.ndarray  # (length - 1,) mean loss at each of a window's first length - 1 positions


def eval_windows(stream: np.ndarray, length: int, tokens: int) -> np.ndarray:
    """The first `tokens // length` windows at stride `length`, each `length + 1` tokens
    (inputs are [:-1], targets [1:]): (n, length + 1), a view of the stream."""
    if length < 2:
        raise FibctlError(f"evaluation length {length} is below 2: a window must predict a token")
    n = min(tokens // length, (len(stream) - 1) // length)
    if n < 1:
        raise FibctlError(f"no window of {length:,} tokens (and its next token) fits in a budget of "
                          f"{tokens:,} tokens from a stream of {len(stream):,}")
    return np.lib.stride_tricks.sliding_window_view(stream[: n * length + 1], length + 1)[::length]


def stream_loss(model: FibLM, stream: np.ndarray, length: int, tokens: int,
                device: torch.device, batch_tokens: int = BATCH_TOKENS) -> StreamLoss:
    """Loss of `model` on the stream's first windows of `length` tokens."""
    windows = eval_windows(stream, length, tokens)
    batch = max(1, batch_tokens // length)
    while True:
        try:
            sums = _position_sums(model, windows, batch, device)
            break
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            if batch == 1:
                raise FibctlError(f"length {length:,} is out of reach on {device}: out of memory "
                                  "with a single window") from None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            batch //= 2
    per_position = sums / len(windows)  # (length,)
    return StreamLoss(float(per_position.mean()), len(windows) * length, len(windows),
                      per_position[:-1].numpy())


def _out_of_memory(e: Exception) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def _position_sums(model: FibLM, windows: np.ndarray, batch: int, device: torch.device) -> torch.Tensor:
    """Loss summed over windows at each of the `length` predicted positions, float64."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(windows.shape[1] - 1, dtype=torch.float64)
    with torch.no_grad(), autocast(device):
        for s in range(0, len(windows), batch):
            chunk = torch.from_numpy(windows[s:s + batch].astype(np.int64)).to(device)
            sums += model.token_losses(chunk[:, :-1], chunk[:, 1:]).double().sum(0).cpu()
    model.train(was_training)
    return sums


def inference_speed(model: FibLM, window: np.ndarray, device: torch.device) -> dict[str, float]:
    """Latency of one forward pass over one sequence (batch 1) and the tokens/s it implies."""
    x = torch.from_numpy(window[None, :-1].astype(np.int64)).to(device)
    y = torch.from_numpy(window[None, 1:].astype(np.int64)).to(device)
    times = []
    with torch.no_grad(), autocast(device):
        for i in range(SPEED_REPEATS + 1):
            synchronize(device)
            t0 = time.perf_counter()
            model.token_losses(x, y)
            synchronize(device)
            if i:  # the first pass warms caches and kernels
                times.append(time.perf_counter() - t0)
    latency = statistics.median(times)
    return {"latency_s": latency, "tokens_per_s": x.shape[1] / latency}


# ----------------------------------------------------------------------------- runs


@dataclass
class _Target:
    run: Run
    config: RunConfig
    checkpoint: Path


def find_runs(engine: Engine, names: list[str], all_runs: bool, runs_dir: Path | None = None) -> list[_Target]:
    """Runs to evaluate, each with a checkpoint; every problem is reported before any work.
    Checkpoints are looked for under `runs_dir`, by default the folder each run trained in."""
    with engine.connect() as conn:
        if all_runs:
            rows = conn.execute(select(Run).where(Run.checkpoint_path.is_not(None)).order_by(Run.id)).all()
        else:
            if not names:
                raise FibctlError("name at least one run, or pass --all")
            rows = conn.execute(select(Run).where(Run.name.in_(names))).all()
            missing = sorted(set(names) - {r.name for r in rows})
            if missing:
                raise FibctlError(f"no run named {', '.join(map(repr, missing))} in the database")
            rows.sort(key=lambda r: names.index(r.name))
    if not rows:
        raise FibctlError("no run in the database has a checkpoint yet")
    targets = []
    for r in rows:
        if not r.checkpoint_path:
            raise FibctlError(f"run {r.name!r} has no checkpoint yet (status {r.status}); train it first")
        path = resolve_path(r.checkpoint_path, runs_dir or Path(r.runs_dir or "runs"), r.name)
        if not path.is_file():
            raise FibctlError(f"run {r.name!r}: its checkpoint {path} does not exist; give the --runs-dir it "
                              "was trained in")
        targets.append(_Target(r, RunConfig.from_dict(json.loads(r.config_json)), path))
    return targets


def evaluate(engine: Engine, names: list[str], lengths: list[int], *, data_dir: Path,
             all_runs: bool = False, datasets: list[str] | None = None, tokens: int | None = None,
             positions: bool = False, speed: bool = False, device: str | None = None,
             runs_dir: Path | None = None, on_result: Callable[[dict, int], None] | None = None) -> pd.DataFrame:
    """Evaluate runs' final checkpoints at each length on each held-out set; write the results.

    Perplexity rows replace earlier ones with the same (run, step, dataset, length) key.
    `tokens` defaults to each run's full evaluation budget (`final_eval_tokens`).
    Returns one row per run x length x dataset; `on_result(row, total)` sees each as it is
    written, with the number of rows to expect.
    """
    for length in lengths:
        if length < 2:
            raise FibctlError(f"evaluation length {length} is below 2: a window must predict a token")
    if tokens is not None and tokens < 2:
        raise FibctlError(f"--tokens {tokens} is below 2")
    manifest = load_manifest(data_dir)
    datasets = list(datasets or manifest.heldout)
    unknown = [d for d in datasets if d not in manifest.heldout]
    if unknown:
        raise FibctlError(f"dataset {', '.join(map(repr, unknown))} is not in the data manifest; "
                          f"held-out sets: {', '.join(manifest.heldout)}")
    targets = find_runs(engine, names, all_runs, runs_dir)
    for t in targets:
        if t.config.model.vocab_size != manifest.vocab_size:
            raise FibctlError(f"run {t.run.name!r} has vocab {t.config.model.vocab_size:,} but the data in "
                              f"{data_dir} has vocab {manifest.vocab_size:,}")
    dev = resolve_device(device)
    streams = {d: token_stream(data_dir, d) for d in datasets}
    total = len(targets) * len(lengths) * len(datasets)
    report = (lambda row: on_result(row, total)) if on_result else None
    rows = []
    for t in targets:
        rows += _evaluate_run(engine, t, lengths, streams, tokens, positions, speed, dev, report)
    return pd.DataFrame(rows, columns=["run", "step", "dataset", "eval_length", "tokens", "loss", "ppl"])


def load_model(config: RunConfig, state: dict, length: int, device: torch.device) -> FibLM:
    """The run's trained weights in a model built at `length`."""
    model = FibLM(config.model.with_length(length))
    model.load_state_dict(state)
    return model.to(device)


def _evaluate_run(engine, t: _Target, lengths, streams, tokens, positions, speed, device, on_result) -> list[dict]:
    ckpt = load_checkpoint(t.checkpoint)
    theirs = stored_config_hash(ckpt)
    if theirs != t.config.config_hash:  # a runs folder reused by another run: not these weights
        raise FibctlError(f"checkpoint {t.checkpoint} has config hash {theirs} but run {t.run.name!r} has "
                          f"{t.config.config_hash}: it is another run's; pass this run's own --runs-dir")
    step, budget = ckpt["step"], tokens or t.config.train.final_eval_tokens
    recorder = RunRecorder(engine, t.run.id)
    rows = []
    for length in lengths:
        model = load_model(t.config, ckpt["model"], length, device)
        for dataset, stream in streams.items():
            res = stream_loss(model, stream, length, budget, device)
            recorder.log_eval(step, dataset, length, res.tokens, res.loss)
            if positions:
                recorder.log_positions(step, dataset, length, res.position_losses.tolist(), res.windows)
            row = {"run": t.run.name, "step": step, "dataset": dataset, "eval_length": length,
                   "tokens": res.tokens, "loss": res.loss, "ppl": math.exp(res.loss)}
            rows.append(row)
            if on_result:
                on_result(row)
        if speed:
            first = next(iter(streams.values()))
            for metric, value in inference_speed(model, eval_windows(first, length, length)[0], device).items():
                recorder.log_metric(f"speed@{length}", metric, value)
        del model
    return rows
