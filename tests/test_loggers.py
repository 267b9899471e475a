"""`--log-to tensorboard|wandb`: metrics copied beside the database, read back from the
back-ends' own files (TensorBoard event files; a W&B offline run folder)."""

from __future__ import annotations

import math

import pytest

from fibctl.errors import FibctlError
from fibctl.train.loggers import Tee, check_loggers, open_sinks


class Recorder:
    """The database side: remembers what it was told."""

    def __init__(self):
        self.calls = []

    def log_step(self, *args):
        self.calls.append(("step", args))

    def log_eval(self, *args):
        self.calls.append(("eval", args))

    def log_alphas(self, *args):
        self.calls.append(("alphas", args))

    def heartbeat(self):
        return True


def feed(tee: Tee) -> None:
    for step in (10, 20):
        tee.log_step(step, 5.0 - step / 10, 1e-3, 0.5, 1000.0, float(step))
    tee.log_eval(20, "docs_val", 64, 4096, math.log(30.0))
    tee.log_alphas(0, [0.5, 1.5])


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = Recorder()
    tee = Tee(recorder, open_sinks(check_loggers(["tensorboard"]), tmp_path, "run_a", {"seed": 42}))
    feed(tee)
    assert tee.heartbeat() is True  # everything else goes to the database reporter
    tee.close()
    assert [kind for kind, _ in recorder.calls] == ["step", "step", "eval", "alphas"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(10, pytest.approx(4.0)), (20, pytest.approx(3.0))]
    assert events.Scalars("eval/docs_val@64/ppl")[0].value == pytest.approx(30.0)
    assert [e.value for e in events.Scalars("alpha/layer1")] == [1.5]


def test_wandb_offline_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tee = Tee(Recorder(), open_sinks(check_loggers(["wandb"]), tmp_path, "run_b", {"seed": 42}))
    feed(tee)
    tee.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-run_b"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")) and (runs[0] / "files").is_dir()


def test_unknown_back_end_is_refused_naming_the_allowed_ones():
    with pytest.raises(FibctlError, match="--log-to 'mlflow': allowed: tensorboard, wandb"):
        check_loggers(["mlflow"])
