"""The evaluation runner: a run's final checkpoint, rebuilt at each length, measured by
`fibctl.metrics` on each held-out set; the results written to the database.

Perplexity rows replace earlier ones with the same (run, step, dataset, length) key, so
evaluating again never duplicates. Every problem (an unknown run, a run without a
checkpoint, a vocabulary that does not match the data) is reported before any work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from fibctl.config import RunConfig
from fibctl.data.streams import DataManifest, load_manifest
from fibctl.db.schema import Evaluation, Run
from fibctl.db.store import RunRecorder
from fibctl.device import resolve_device
from fibctl.errors import FibctlError, shown_path
from fibctl.flows.removal import aside_hint
from fibctl.train import loggers
from fibctl.metrics import eval_windows, inference_speed, load_model, stream_loss
from fibctl.queue import no_run_named, removed, stored_config
from fibctl.train.checkpoint import DAMAGED, latest_checkpoint, load_checkpoint, resolve_path, stored_config_hash
from fibctl.train.trainer import no_checkpoint_loads


# what --speed adds to each row: the mean tokens/s and those of the slowest and fastest pass
SPEED_COLUMNS = ("tokens_per_s", "tokens_per_s_min", "tokens_per_s_max")


@dataclass
class _Target:
    run: Run
    config: RunConfig
    checkpoint: Path


def _current(path: Path, run: Run) -> Path:
    """`path`, or, where a run still in training has deleted it since its row named it (it keeps
    only its newest checkpoints), the newest one in its folder now."""
    if path.is_file() or run.status == "done":
        return path
    return latest_checkpoint(path.parent) or path


def _load(t: _Target) -> dict:
    """The target's checkpoint, followed to the newest of a run in training that deleted it
    after the plan found it (while eval measured the runs before it, say)."""
    while True:  # each turn a newer file: a trainer saving every second may outpace one
        try:
            return load_checkpoint(t.checkpoint)
        except FibctlError:
            newer = _current(t.checkpoint, t.run)
            if newer == t.checkpoint:
                raise
            t.checkpoint = newer


def check_chosen(names: list[str], all_runs: bool) -> None:
    """Runs named, or --all, and not both: checked before the database and data are (`fibctl
    eval` alone had said there was no data manifest, not that it names no run)."""
    if all_runs and names:  # --all would evaluate every run, a misspelt name among them unnoticed
        raise FibctlError(f"name runs or pass --all, not both (got --all and {', '.join(map(repr, names))})")
    if not all_runs and not names:
        raise FibctlError("name at least one run, or pass --all")


def find_runs(engine: Engine, names: list[str], all_runs: bool, runs_dir: Path | None = None, *,
              reads: str = "fibctl eval measures text") -> list[_Target]:
    """Runs to evaluate, each with a checkpoint; every problem is reported before any work.
    Checkpoints are looked for under `runs_dir`, by default the folder each run trained in.
    `reads`: what the command asks of a run, said to a probe run's name."""
    check_chosen(names, all_runs)
    with engine.connect() as conn:
        if all_runs:
            rows = conn.execute(select(Run).where(Run.checkpoint_path.is_not(None)).order_by(Run.id)).all()
        else:
            rows = conn.execute(select(Run).where(Run.name.in_(names))).all()
            missing = sorted(set(names) - {r.name for r in rows})
            if missing:
                raise no_run_named(missing, conn.execute(select(Run.name)).scalars(), " in the database")
            rows.sort(key=lambda r: names.index(r.name))
    if not rows:
        raise FibctlError("no run in the database has a checkpoint yet")
    targets = []
    for r in rows:
        config = stored_config(r.name, r.config_json)
        if config.probe is not None:  # scored on its own task by its worker, not on text
            if all_runs:
                continue
            raise FibctlError(f"run {r.name!r} is a probe run: its worker scored it on the probe's task "
                              f"(fibctl report table2); {reads}")
        if not r.checkpoint_path and r.source != "fibctl":  # not "train it first": it was trained elsewhere
            raise FibctlError(f"run {r.name!r} was imported from {r.source!r}, its numbers without its weights: "
                              "it has no checkpoint")
        if not r.checkpoint_path:
            raise FibctlError(f"run {r.name!r} has no checkpoint yet (status {r.status}); train it first")
        path = _current(resolve_path(r.checkpoint_path, runs_dir or Path(r.runs_dir or "runs"), r.name), r)
        if path.exists() and not path.is_file():
            raise FibctlError(f"run {r.name!r}: its checkpoint {shown_path(path)} is not a file")
        if not path.is_file() and path.with_name(path.name + DAMAGED).is_file():
            if all_runs:  # no checkpoint left that loads: as a run without one, not among --all's
                continue
            raise FibctlError(no_checkpoint_loads(r.name, f"run {r.name!r}: its checkpoint {path.name} was damaged"))
        if not path.is_file():
            hint = aside_hint(path.parent.parent, r.name, r.checkpoint_path) or "give the --runs-dir it was trained in"
            raise FibctlError(f"run {r.name!r}: its checkpoint {shown_path(path)} does not exist; {hint}")
        targets.append(_Target(r, config, path))
    if not targets:
        raise FibctlError("no run in the database has a checkpoint to evaluate on text (probe runs are scored "
                          "by their worker)")
    return targets


def evaluate(engine: Engine, names: list[str], lengths: list[int], *, data_dir: Path,
             all_runs: bool = False, datasets: list[str] | None = None, tokens: int | None = None,
             positions: bool = False, speed: bool = False, device: str | None = None,
             runs_dir: Path | None = None, on_result: Callable[[dict, int], None] | None = None,
             log_to: tuple[str, ...] | list[str] = (), on_note: Callable[[str], None] | None = None,
             on_start: Callable[[dict, int], None] | None = None) -> pd.DataFrame:
    """Evaluate runs' final checkpoints at each length on each held-out set; write the results.

    Perplexity rows replace earlier ones with the same (run, step, dataset, length) key.
    `tokens` defaults to each run's full evaluation budget (`final_eval_tokens`).
    Returns one row per run x length x dataset, with the run's inference tokens/s at that
    length when `speed` measured it, the mean and its slowest and fastest pass (else NaN);
    `on_result(row, total)` sees each as it is written, with the number of rows to expect,
    and `on_start(item, total)` each (its run, dataset and eval_length) as its measurement
    begins. `log_to` back-ends (fibctl.train.loggers) get a copy of each result, their files
    in the folder of the run's checkpoint. `on_note` hears
    of each run measured before it finished (its checkpoint is not its final step's).
    """
    log_to = loggers.check_loggers(log_to)
    lengths = list(dict.fromkeys(lengths))  # a length or set given twice is measured once
    targets, manifest, datasets, streams = plan(engine, names, lengths, data_dir=data_dir, all_runs=all_runs,
                                                datasets=datasets, tokens=tokens, runs_dir=runs_dir)
    for t in targets if log_to else ():  # before any run is measured
        loggers.check_run_folder(t.checkpoint.parent)
    dev = resolve_device(device)
    total = len(targets) * len(lengths) * len(datasets)
    report = (lambda row: on_result(row, total)) if on_result else None
    begin = (lambda item: on_start(item, total)) if on_start else None
    rows = []
    for t in targets:
        rows += _evaluate_run(engine, t, lengths, streams, tokens, positions, speed, dev, report, log_to,
                              data=manifest, on_note=on_note, on_start=begin)
    return pd.DataFrame(rows, columns=["run", "step", "dataset", "eval_length", "tokens", "loss", "ppl",
                                       *SPEED_COLUMNS, "speed_batch"])


def plan(engine: Engine, names: list[str], lengths: list[int], *, data_dir: Path, all_runs: bool = False,
         datasets: list[str] | None = None, tokens: int | None = None, runs_dir: Path | None = None):
    """What `evaluate` measures, every input checked (lengths, data, held-out sets, runs and
    their checkpoints) and nothing written: (targets, manifest, held-out sets, streams). On a
    read-only engine it is a command's check before the database is upgraded or switched to
    WAL mode (fibctl.db.engine.connect)."""
    for length in lengths:
        if length < 2:
            raise FibctlError(f"evaluation length {length} is below 2: a window must predict a token")
    if tokens is not None and tokens < 2:
        raise FibctlError(f"--tokens {tokens} is below 2")
    manifest = load_manifest(data_dir)
    if not manifest.heldout:  # nothing to evaluate on: exit 0 with nothing recorded said otherwise
        raise FibctlError(f"nothing to evaluate on: {manifest.no_heldout}")
    datasets = list(dict.fromkeys(datasets or manifest.heldout))
    unknown = [d for d in datasets if d not in manifest.heldout]
    if unknown:
        raise FibctlError(f"dataset {', '.join(map(repr, unknown))} is not in the data manifest; "
                          f"held-out sets: {', '.join(manifest.heldout)}")
    targets = find_runs(engine, names, all_runs, runs_dir)
    for t in targets:
        check_vocab(t, manifest)
    streams = {d: manifest.stream(d) for d in datasets}
    _check_fits(streams, lengths, datasets_given=datasets != manifest.heldout)
    return targets, manifest, datasets, streams


def check_vocab(t: _Target, manifest: DataManifest) -> None:
    """Refuse data whose vocabulary is not the run's: its ids are another tokenizer's."""
    if t.config.model.vocab_size != manifest.vocab_size:
        raise FibctlError(f"run {t.run.name!r} has vocab {t.config.model.vocab_size:,} but the data in "
                          f"{shown_path(manifest.data_dir)} has vocab {manifest.vocab_size:,}")


def _check_fits(streams: dict[str, np.ndarray], lengths: list[int], datasets_given: bool) -> None:
    """Refuse, before any run is measured, a held-out set too short for one window of a length."""
    length = max(lengths)
    short = [d for d, s in streams.items() if len(s) - 1 < length]
    if short:
        n, fit = len(streams[short[0]]), [d for d in streams if d not in short]
        raise FibctlError(
            f"held-out set {short[0]!r} holds {n:,} tokens, too few for one window of {length:,} and its next "
            f"token: evaluate it at lengths up to {max(n - 1, 0):,}"
            + (f", or leave it out: --dataset {' --dataset '.join(fit)}" if fit and not datasets_given else ""))


def checked_checkpoint(t: _Target, data: DataManifest,
                       other_data: str = "its results would replace the recorded ones") -> dict:
    """The target's checkpoint, refused unless it holds this run's weights, trained on `data`
    (`other_data`: what reading it with other data would do), at its final step (a finished
    run) and finite: what eval measures and sample samples."""
    ckpt = _load(t)
    theirs = stored_config_hash(ckpt)
    if theirs != t.config.config_hash:  # a runs folder reused by another run: not these weights
        raise FibctlError(f"checkpoint {shown_path(t.checkpoint)} has config hash {theirs} but run {t.run.name!r} has "
                          f"{t.config.config_hash}: it is another run's; pass this run's own --runs-dir")
    if t.run.status == "done" and t.run.final_step is not None and ckpt["step"] != t.run.final_step:
        # its results would be recorded at that step, where no report reads a finished run's numbers
        raise FibctlError(f"checkpoint {shown_path(t.checkpoint)} holds step {ckpt['step']}, but run {t.run.name!r} "
                          f"finished at step {t.run.final_step}: it is not the run's final checkpoint "
                          "(was the file replaced?)")
    if not data.holds(ckpt.get("data_hash", data.data_hash)):  # its held-out sets are other text
        raise FibctlError(f"run {t.run.name!r} was trained on data {ckpt['data_hash']} but "
                          f"{shown_path(data.data_dir)} has data {data.data_hash}: {other_data}; give the --data it "
                          "was trained on")
    # before any is measured, for every schedule: a learned layer cannot even place its rungs
    # at a NaN alpha (floor(nan) raised a ValueError traceback), where the others score NaN
    bad = next((name for name, w in ckpt["model"].items() if not bool(torch.isfinite(w).all())), None)
    if bad is not None:
        raise FibctlError(f"run {t.run.name!r} has no loss to score: its checkpoint {shown_path(t.checkpoint)} holds "
                          f"weights that are not finite ({bad} among them)")
    return ckpt


def model_at(t: _Target, weights: dict, length: int, device: torch.device):
    """The run's weights in its model rebuilt at `length` (fibctl.metrics.load_model), a file
    that does not fit it said in one line."""
    try:
        return load_model(t.config, weights, length, device)
    except RuntimeError as e:  # shapes or names that are not the run's model: a file changed by hand
        detail = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise FibctlError(f"checkpoint {shown_path(t.checkpoint)} does not fit run {t.run.name!r}'s model "
                          f"({detail[:160]})") from None


def _evaluate_run(engine, t: _Target, lengths, streams, tokens, positions, speed, device, on_result,
                  log_to: tuple[str, ...] = (), *, data: DataManifest,
                  on_note: Callable[[str], None] | None = None,
                  on_start: Callable[[dict], None] | None = None) -> list[dict]:
    ckpt = checked_checkpoint(t, data)
    step, budget = ckpt["step"], tokens or t.config.train.final_eval_tokens
    _check_budget(engine, t, step, {(d, length): len(eval_windows(s, length, budget)) * length
                                    for length in lengths for d, s in streams.items()})
    if t.run.status != "done" and on_note:  # a stopped run's checkpoint is not its trained model
        on_note(f"run {t.run.name!r} is not finished (status {t.run.status}): measuring its checkpoint "
                f"at step {step:,} of {t.config.train.steps:,}")
    recorder = RunRecorder(engine, t.run.id)
    with _kept_in_the_database(engine, t.run):
        if not log_to:
            return _measure(recorder, t, ckpt["model"], step, budget, lengths, streams, positions, speed, device,
                            on_result, on_start)
        tee = loggers.Tee(recorder, loggers.open_sinks(log_to, t.checkpoint.parent, t.run.name, t.config.to_dict(),
                                                       data.heldout), light_tokens=t.config.train.eval_tokens)
        try:
            tee.catch_up(step)  # a run trained without --log-to: its history first
            return _measure(tee, t, ckpt["model"], step, budget, lengths, streams, positions, speed, device,
                            on_result, on_start)
        finally:
            tee.close()


@contextmanager
def _kept_in_the_database(engine: Engine, run: Run) -> Iterator[None]:
    """A run that `fibctl queue rm` removed while it was measured (its row gone, or made again
    under its name: another id) fails the next write on the missing row, a FOREIGN KEY error:
    said in one line."""
    try:
        yield
    except IntegrityError:
        if not removed(engine, run.id):
            raise
        raise FibctlError(f"run {run.name!r} was removed from the database (fibctl queue rm) while eval measured "
                          "it; nothing more of it can be recorded") from None


def _check_budget(engine: Engine, t: _Target, step: int, planned: dict[tuple[str, int], int]) -> None:
    """A result over fewer tokens would replace the recorded one (a row per run, step, set and
    length): the final evaluation's 1,048,576 tokens by a quick look at 65,536, say. Refused
    before anything is measured. The same budget again replaces it in place, and a larger one
    replaces it too (a quick look must not block the full measurement)."""
    with engine.connect() as conn:
        recorded = conn.execute(select(Evaluation.dataset, Evaluation.eval_length, Evaluation.tokens).where(
            Evaluation.run_id == t.run.id, Evaluation.step == step)).all()
    for dataset, length, tokens in recorded:
        mine = planned.get((dataset, length))
        if mine is not None and tokens is not None and mine < tokens:
            raise FibctlError(f"run {t.run.name!r} has a step-{step} evaluation on {dataset} at length {length} over "
                              f"{tokens:,} tokens; this one would score {mine:,} and replace it: give --tokens "
                              f"{tokens} (or more) to measure it again")


def _measure(recorder, t: _Target, weights: dict, step, budget, lengths, streams, positions, speed, device,
             on_result, on_start=None) -> list[dict]:
    rows = []
    for length in lengths:
        model = model_at(t, weights, length, device)
        for dataset, stream in streams.items():
            if on_start:
                on_start({"run": t.run.name, "dataset": dataset, "eval_length": length})
            res = stream_loss(model, stream, length, budget, device,
                              position_tokens=t.config.train.position_tokens if positions else None)
            if not math.isfinite(res.loss):  # finite weights (_evaluate_run) that overflow: no number to record
                raise FibctlError(f"run {t.run.name!r} scores a loss of {res.loss} on {dataset} at length "
                                  f"{length}: there is no number to record (its checkpoint {shown_path(t.checkpoint)} "
                                  "holds finite weights)")
            # the perplexity and its positions: one transaction, never a new one beside old positions
            recorder.log_eval(step, dataset, length, res.tokens, res.loss,
                              *((res.position_losses.tolist(), res.position_windows) if positions else ()))
            row = {"run": t.run.name, "step": step, "dataset": dataset, "eval_length": length,
                   "tokens": res.tokens, "loss": res.loss, "ppl": math.exp(res.loss),
                   **dict.fromkeys(SPEED_COLUMNS, math.nan), "speed_batch": None}
            rows.append(row)
            if on_result:
                on_result(row)
        if speed:
            measured = inference_speed(model, length, device)
            for metric, value in measured.items():
                recorder.log_metric(f"speed@{length}", metric, value)
            for row in rows[-len(streams):]:  # this length's rows: the speed is the model's, not a set's
                row.update({c: measured[c] for c in SPEED_COLUMNS}, speed_batch=int(measured["batch"]))
        del model
    return rows
