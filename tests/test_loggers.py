"""`--log-to tensorboard|wandb`: metrics copied beside the database, read back from the
back-ends' own files (TensorBoard event files; a W&B offline run folder)."""

from __future__ import annotations

import json
import math
import re

import pytest

from fibctl.errors import FibctlError
from fibctl.train.loggers import Tee, check_loggers, open_sinks, wandb_run_id

from cli_helpers import ran


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

    def event(self, *args):
        self.calls.append(("event", args))

    def heartbeat(self):
        return True


def wandb_records(path) -> list:
    """The records of a W&B run file (`run-ID.wandb`, LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header of crc32, length and type 1 whole, 2 first, 3 middle, 4 last),
    as W&B's own protobuf Records: what `wandb sync` would upload."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, records, pos, pending = path.read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
    """Each logged key's (step, value) points."""
    import json

    out: dict[str, list] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    out.setdefault(key, []).append((row["_step"], value))
    return out


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


def test_tensorboard_gets_a_runs_settings_as_hyperparameters(tmp_path):
    """The config was a text entry only: TensorBoard's HParams tab could not filter or sort
    runs by schedule, W or lr."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.plugins.hparams import plugin_data_pb2

    from fibctl.config import RunConfig

    config = RunConfig.resolve("r", "m", "micro", schedule="stagger", window=8).to_dict()
    sink = open_sinks(check_loggers(["tensorboard"]), tmp_path, "r", config)[0]
    sink.close()
    started = []
    for path in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        for event in event_file_loader.EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    if data.HasField("session_start_info"):
                        started.append({k: v.string_value or v.number_value
                                        for k, v in data.session_start_info.hparams.items()})
    [settings] = started
    assert (settings["model.schedule"], settings["model.window"], settings["train.lr"]) == ("stagger", 8, 0.003)
    assert settings["name"] == "r" and settings["preset"] == "micro"


def test_a_resumed_run_does_not_draw_its_steps_twice_in_tensorboard(tmp_path):
    """A worker killed at step 30 after checkpointing at 10 logged 20 and 30; the run resumes
    from 10 and logs them again. TensorBoard showed both copies, the curve running back in
    time; the steps after the checkpoint are now purged (as the database replaces them)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = Tee(Recorder(), open_sinks(["tensorboard"], tmp_path, "run_a", {"seed": 42}))
    for step in (10, 20, 30):
        first.log_step(step, 1.0, 1e-3, 0.5, 1000.0, 1.0)
    first.close()
    again = Tee(Recorder(), open_sinks(["tensorboard"], tmp_path, "run_a", {"seed": 42}))
    again.event("resumed", "resumed from step 10", {"step": 10})
    for step in (20, 30, 40):
        again.log_step(step, 2.0, 1e-3, 0.5, 1000.0, 1.0)
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0), (20, 2.0), (30, 2.0), (40, 2.0)]
    assert len(events.Tensors("config/text_summary")) == 1  # the config once, not once per attempt


def test_wandb_offline_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tee = Tee(Recorder(), open_sinks(check_loggers(["wandb"]), tmp_path, "run_b", {"seed": 42}))
    feed(tee)
    tee.close()
    run_id = (tmp_path / "wandb" / "fibctl-run-id").read_text().strip()
    assert re.fullmatch(r"run_b-[0-9a-f]{8}", run_id)
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")) and (runs[0] / "files").is_dir()


def test_a_runs_wandb_id_stays_with_its_folder_and_differs_from_another_databases(tmp_path):
    """Run names are unique within one database only: the same name in two run folders (two
    databases, the demo's run names) must not share a W&B run, where the second run's steps
    below the first's last would be dropped; a resumed run keeps its id."""
    one, other = wandb_run_id(tmp_path / "a" / "dense", "dense"), wandb_run_id(tmp_path / "b" / "dense", "dense")
    assert one != other and one.startswith("dense-") and other.startswith("dense-")
    assert wandb_run_id(tmp_path / "a" / "dense", "dense") == one
    assert len(wandb_run_id(tmp_path / "long", "x" * 100)) == 64
    # a run that logged to W&B with its name as the id (before the suffix) continues that W&B run
    (tmp_path / "old" / "wandb" / "offline-run-20261201_101010-dense").mkdir(parents=True)
    assert wandb_run_id(tmp_path / "old", "dense") == "dense"


def test_unknown_back_end_is_refused_naming_the_allowed_ones():
    with pytest.raises(FibctlError, match="--log-to 'mlflow': allowed: tensorboard, wandb"):
        check_loggers(["mlflow"])


# ----------------------------------------------------------------------------- through the commands


def _fibctl(args, monkeypatch, capsys) -> tuple[int, str]:
    """`fibctl ARGS` in this process: its exit code and stderr."""
    code, _, err = ran(monkeypatch, capsys, *args)
    return code, err


def test_worker_and_eval_log_to_tensorboard_and_train_to_wandb(tmp_path, monkeypatch, capsys):
    """A micro run trained by `fibctl worker --log-to tensorboard` leaves event files under
    runs/<name>/tensorboard with the training loss of every logged step and its evaluations;
    `fibctl eval --log-to tensorboard` adds the evaluation at another length; `fibctl train
    --log-to wandb` leaves a W&B offline run folder (no API key, WANDB_MODE unset)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import sqlite3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from train_helpers import micro_run, queued_db, write_data

    data, runs, db = write_data(tmp_path / "data"), tmp_path / "runs", str(tmp_path / "r.db")
    # light evaluations at steps 10 and 20, the full one with the checkpoint at 30
    queued_db(tmp_path / "r.db", micro_run("tb_run", checkpoint_interval=30),
              micro_run("wb_run", checkpoint_interval=30)).dispose()
    common = ["--db", db, "--data", str(data), "--runs-dir", str(runs), "--plain"]
    code, err = _fibctl(["worker", *common, "--max-runs", "1", "--log-to", "tensorboard"], monkeypatch, capsys)
    assert code == 0, err

    events = EventAccumulator(str(runs / "tb_run" / "tensorboard"))
    events.Reload()
    stored = sqlite3.connect(db).execute(
        "SELECT step, loss FROM train_steps JOIN runs ON runs.id = run_id WHERE name = 'tb_run' ORDER BY step").fetchall()
    assert [s for s, _ in stored] == [5, 10, 15, 20, 25, 30]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(s, pytest.approx(v)) for s, v in stored]
    # the two budgets apart: the full evaluation scores more of the stream, a jump in the light curve
    assert [e.step for e in events.Scalars("eval/stories_val@64/loss")] == [10, 20]
    assert [e.step for e in events.Scalars("eval_full/stories_val@64/loss")] == [30]
    tb_tags = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "alpha/layer0", "alpha/layer1",
               *(f"{kind}/{d}@64/{m}" for kind in ("eval", "eval_full") for d in ("stories_val", "math_val")
                 for m in ("loss", "ppl"))}
    assert set(events.Tags()["scalars"]) == tb_tags
    for tag in tb_tags - {"alpha/layer0", "alpha/layer1"}:  # a fixed run's alphas: step 0 alone
        steps = [e.step for e in events.Scalars(tag)]
        assert steps == sorted(set(steps)) and steps[-1] == (20 if tag.startswith("eval/") else 30), tag

    code, err = _fibctl(["eval", "tb_run", "--length", "128", "--dataset", "stories_val", "--tokens", "1024",
                         "--db", db, "--data", str(data), "--runs-dir", str(runs), "--log-to", "tensorboard"],
                        monkeypatch, capsys)
    assert code == 0, err
    events = EventAccumulator(str(runs / "tb_run" / "tensorboard"))
    events.Reload()
    [ppl] = events.Scalars("eval/stories_val@128/ppl")
    stored = sqlite3.connect(db).execute("SELECT step, ppl FROM evaluations WHERE eval_length = 128").fetchone()
    assert (ppl.step, ppl.value) == (stored[0], pytest.approx(stored[1], rel=1e-5))

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, err = _fibctl(["train", "wb_run", *common, "--log-to", "wandb"], monkeypatch, capsys)
    assert code == 0, err
    run_id = wandb_run_id(runs / "wb_run", "wb_run")
    [folder] = (runs / "wb_run" / "wandb").glob(f"offline-run-*-{run_id}")
    assert list(folder.glob("*.wandb")) and (folder / "files").is_dir()
    records = wandb_records(folder / f"run-{run_id}.wandb")
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    # named and grouped as the database has it, with its config
    assert (run.run_id, run.display_name, run.run_group, run.project) == (run_id, "wb_run", "test", "fibctl")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["name"] == "wb_run" and config["model"]["schedule"] == "fixed" and config["train"]["steps"] == 30
    history = wandb_history(records)
    assert set(history) == tb_tags
    stored = sqlite3.connect(db).execute(
        "SELECT step, loss FROM train_steps JOIN runs ON runs.id = run_id WHERE name = 'wb_run' ORDER BY step").fetchall()
    assert history["train/loss"] == [(s, pytest.approx(v)) for s, v in stored]
    assert [s for s, _ in history["eval/math_val@64/ppl"]] == [10, 20]
    assert [s for s, _ in history["eval_full/math_val@64/ppl"]] == [30]
    assert not (runs / "wb_run" / "tensorboard").exists() and not (runs / "tb_run" / "wandb").exists()


def test_a_back_end_that_is_not_installed_is_refused_before_any_claim(tmp_path, monkeypatch, capsys):
    import sqlite3
    import sys

    from train_helpers import micro_run, queued_db, write_data

    data, db = write_data(tmp_path / "data", train_tokens=2_000, heldout_tokens=1_000), str(tmp_path / "r.db")
    queued_db(tmp_path / "r.db", micro_run("run")).dispose()
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    for command in (["worker"], ["train", "run"], ["eval", "run", "--length", "64"]):
        code, err = _fibctl([*command, "--db", db, "--data", str(data), "--runs-dir", str(tmp_path / "runs"),
                             "--log-to", "wandb"], monkeypatch, capsys)
        assert code == 2 and err.strip().splitlines() == [
            "error: --log-to wandb needs the wandb package: pip install -e '.[wandb]'"], err
    code, err = _fibctl(["worker", "--db", db, "--data", str(data), "--log-to", "mlflow"], monkeypatch, capsys)
    assert code == 2 and "--log-to 'mlflow': allowed: tensorboard, wandb" in err
    assert sqlite3.connect(db).execute("SELECT status, attempts FROM runs").fetchall() == [("queued", 0)]
    assert not (tmp_path / "runs").exists()


def test_a_back_end_that_cannot_start_leaves_the_run_queued(tmp_path, monkeypatch, capsys):
    """A bad WANDB_MODE (pydantic refuses it), a file where the TensorBoard folder goes, or a
    link there: one line, exit 2, the run queued as it was. They failed every run of the queue,
    each with a traceback in its error; the link was written through."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import sqlite3

    from train_helpers import micro_run, queued_db, write_data

    data, runs, db = write_data(tmp_path / "data", train_tokens=2_000, heldout_tokens=1_000), tmp_path / "runs", \
        str(tmp_path / "r.db")
    queued_db(tmp_path / "r.db", micro_run("run"), micro_run("other")).dispose()
    common = ["--db", db, "--data", str(data), "--runs-dir", str(runs), "--plain"]
    monkeypatch.setenv("WANDB_MODE", "bogus")
    monkeypatch.setenv("WANDB_SILENT", "true")
    code, err = _fibctl(["worker", *common, "--log-to", "wandb"], monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--log-to wandb could not start for run" in err and "Traceback" not in err
    assert "ValidationError: mode: " in err  # the setting at fault, not "1 validation error for Settings"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_SILENT", "")  # a stray empty setting
    import wandb
    wandb.teardown()  # W&B reads the environment once per process: as a new worker's would be read
    code, err = _fibctl(["worker", *common, "--log-to", "wandb"], monkeypatch, capsys)
    assert code == 2 and "ValidationError: silent: Input should be a valid boolean" in err, err
    monkeypatch.setenv("WANDB_SILENT", "true")
    (runs / "run").mkdir(parents=True, exist_ok=True)
    (runs / "run" / "tensorboard").write_text("a file\n")
    code, err = _fibctl(["train", "run", *common, "--log-to", "tensorboard"], monkeypatch, capsys)
    assert code == 2 and err.strip().splitlines() == [
        f"error: --log-to tensorboard: {runs / 'run' / 'tensorboard'} is a file; tensorboard's files are "
        "written only into a folder of the run's own: remove it"], err
    (runs / "run" / "tensorboard").unlink()
    (tmp_path / "outside").mkdir()
    (runs / "run" / "tensorboard").symlink_to(tmp_path / "outside")
    code, err = _fibctl(["train", "run", *common, "--log-to", "tensorboard"], monkeypatch, capsys)
    assert code == 2 and "tensorboard is a link" in err, err
    assert not list((tmp_path / "outside").iterdir())
    assert sqlite3.connect(db).execute("SELECT status, attempts, error FROM runs").fetchall() == [
        ("queued", 0, None), ("queued", 0, None)]
