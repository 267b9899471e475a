"""`--log-to tensorboard|wandb`: metrics copied beside the database, read back from the
back-ends' own files (TensorBoard event files; a W&B offline run folder)."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest

from fibctl.errors import FibctlError
from fibctl.train.loggers import Tee, check_loggers, open_sinks, wandb_records, wandb_run_id

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

    def history(self, upto):  # as RunRecorder.history reads the database back
        out = []
        for kind, args in self.calls:
            if kind == "step" and args[0] <= upto:
                out.append((args[0], kind, dict(zip(("loss", "lr", "grad_norm", "tokens_per_s"), args[1:5]))))
            elif kind == "eval" and args[0] <= upto:
                out.append((args[0], kind, dict(zip(("dataset", "eval_length", "tokens", "loss"), args[1:5]))))
            elif kind == "alphas" and args[0] <= upto:
                out.append((args[0], kind, {"alphas": args[1]}))
        return out


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


def hparams_data(folder) -> list:
    """The HParams plugin's records in a run's event files."""
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.plugins.hparams import plugin_data_pb2

    return [plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
            for path in sorted(folder.glob("events.out.tfevents.*"))
            for event in event_file_loader.EventFileLoader(str(path)).Load() for value in event.summary.value
            if value.metadata.plugin_data.plugin_name == "hparams"]


def test_tensorboard_gets_a_runs_settings_as_hyperparameters(tmp_path):
    """The config was a text entry only: TensorBoard's HParams tab could not filter or sort
    runs by schedule, W or lr."""
    pytest.importorskip("tensorboard")
    from fibctl.config import RunConfig

    config = RunConfig.resolve("r", "m", "micro", schedule="stagger", window=8).to_dict()
    sink = open_sinks(check_loggers(["tensorboard"]), tmp_path, "r", config)[0]
    sink.close()
    [settings] = [{k: v.string_value or v.number_value for k, v in data.session_start_info.hparams.items()}
                  for data in hparams_data(tmp_path / "tensorboard") if data.HasField("session_start_info")]
    assert (settings["model.schedule"], settings["model.window"], settings["train.lr"]) == ("stagger", 8, 0.003)
    assert settings["name"] == "r" and settings["preset"] == "micro"


def test_a_resumed_run_does_not_draw_its_steps_twice_in_tensorboard(tmp_path):
    """A worker killed at step 30 after checkpointing at 10 logged 20 and 30; the run resumes
    from 10 and logs them again. TensorBoard showed both copies, the curve running back in
    time; the steps after the checkpoint are now purged (as the database replaces them)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    db = Recorder()
    first = Tee(db, open_sinks(["tensorboard"], tmp_path, "run_a", {"seed": 42}))
    for step in (10, 20, 30):
        first.log_step(step, 1.0, 1e-3, 0.5, 1000.0, 1.0)
    first.close()
    again = Tee(db, open_sinks(["tensorboard"], tmp_path, "run_a", {"seed": 42}))
    again.event("resumed", "resumed from step 10", {"step": 10})
    for step in (20, 30, 40):
        again.log_step(step, 2.0, 1e-3, 0.5, 1000.0, 1.0)
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0), (20, 2.0), (30, 2.0), (40, 2.0)]
    assert len(events.Tensors("config/text_summary")) == 1  # the config once, not once per attempt


def test_tensorboard_hparams_compare_runs_on_their_held_out_evaluations(tmp_path):
    """The HParams metric was the training loss alone; the paper compares held-out loss and
    perplexity at the training length. Each is a metric now, named as log_eval names it: a
    light evaluation's and a full one's (the final among them)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train_helpers import micro_run

    config = micro_run("r").to_dict()
    tee = Tee(Recorder(), open_sinks(["tensorboard"], tmp_path, "r", config, ("docs_val", "code_val")),
              light_tokens=config["train"]["eval_tokens"])
    tee.log_step(10, 3.0, 1e-3, 0.5, 1000.0, 1.0)
    for tokens in (config["train"]["eval_tokens"], config["train"]["final_eval_tokens"]):
        for dataset in ("docs_val", "code_val"):
            tee.log_eval(30, dataset, 64, tokens, 2.0)
    tee.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    [listed] = [[m.name.tag for m in data.experiment.metric_infos]
                for data in hparams_data(tmp_path / "tensorboard") if data.HasField("experiment")]
    assert listed == ["train/loss", *(f"{kind}/{d}@64/{m}" for kind in ("eval", "eval_full")
                                      for d in ("docs_val", "code_val") for m in ("loss", "ppl"))]
    # the tags the run writes: each evaluation's listed
    assert set(listed) == {"train/loss", *(t for t in events.Tags()["scalars"] if t.startswith("eval"))}


def test_tensorboard_gets_the_history_it_lacks_on_resuming_without_drawing_any_twice(tmp_path):
    """A run logged to TensorBoard up to step 10, trained on without --log-to to 30 and
    resumed from 20 with it again: TensorBoard's curve went from 10 to the steps after 20.
    The database's rows from 11 to 20 are sent on resuming, those up to 10 not again."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    db = Recorder()
    first = Tee(db, open_sinks(["tensorboard"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    first.log_step(10, 4.0, 1e-3, 0.5, 1000.0, 1.0)
    first.log_eval(10, "docs_val", 64, 1024, 3.5)
    first.log_alphas(10, [0.5, 1.5])
    first.close()
    for step in (20, 30):  # trained without the back-end
        db.log_step(step, 4.0 - step / 20, 1e-3, 0.5, 1000.0, 1.0)
        db.log_eval(step, "docs_val", 64, 4096 if step == 30 else 1024, 3.5 - step / 20)
        db.log_alphas(step, [0.5 + step / 100, 1.5])
    again = Tee(db, open_sinks(["tensorboard"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    again.event("resumed", "resumed from step 20", {"step": 20})
    again.log_step(30, 2.0, 1e-3, 0.5, 1000.0, 1.0)
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 4.0), (20, 3.0), (30, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/docs_val@64/loss")] == [(10, 3.5), (20, 2.5)]
    assert [e.step for e in events.Scalars("alpha/layer0")] == [10, 20]
    assert "eval_full/docs_val@64/loss" not in events.Tags()["scalars"]  # step 30's: after the checkpoint
    assert "train/mfu" not in events.Tags()["scalars"]  # not recorded: not replayed


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


def wandb_points(folder, key: str) -> list[tuple[int, float]]:
    """A key's points over every W&B run file in `folder`, in the order `wandb sync` uploads them."""
    return [point for path in sorted(folder.glob("*run-*/run-*.wandb"))
            for point in wandb_history(wandb_records(path)).get(key, [])]


def test_wandb_gets_the_history_it_lacks_on_resuming_once_and_without_warnings(tmp_path, monkeypatch, capfd):
    """A run trained without --log-to and resumed with it: W&B's run began at the checkpoint.
    An attempt killed before W&B wrote out its file left it holding nothing. The database's
    rows up to the resume step are sent on resuming, but none that an earlier offline file of
    the run holds (`wandb sync` uploads them all, and W&B drops a step below its last with a
    warning a row), nor one below the W&B run's own step (a resumed online run's)."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    db = Recorder()
    for step in (10, 20):  # trained without the back-end
        db.log_step(step, 5.0 - step / 10, 1e-3, 0.5, 1000.0, 1.0)
    db.log_eval(20, "docs_val", 64, 4096, 2.0)
    db.log_alphas(20, [0.5, 1.5])
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    tee.event("resumed", "resumed from step 20", {"step": 20})
    tee.log_step(30, 2.0, 1e-3, 0.5, 1000.0, 1.0)
    tee.close()
    folder = tmp_path / "wandb"
    assert wandb_points(folder, "train/loss") == [(10, 4.0), (20, 3.0), (30, 2.0)]
    assert wandb_points(folder, "eval_full/docs_val@64/ppl") == [(20, pytest.approx(math.exp(2.0)))]
    assert wandb_points(folder, "alpha/layer1") == [(20, 1.5)]

    for step in (40, 50):  # an attempt whose W&B file held nothing of them: killed
        db.log_step(step, 1.0, 1e-3, 0.5, 1000.0, 1.0)
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    tee.log_step(45, 1.0, 1e-3, 0.5, 1000.0, 1.0)  # W&B's run at step 45: as an online one resumed there
    tee.event("resumed", "resumed from step 50", {"step": 50})
    tee.close()
    assert [s for s, _ in wandb_points(folder, "train/loss")] == [10, 20, 30, 45, 50]
    # resumed from 50 again: the earlier files hold every step, this one gets none again
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    tee.event("resumed", "resumed from step 50", {"step": 50})
    tee.close()
    assert len(list(folder.glob("*run-*/run-*.wandb"))) == 3
    assert [s for s, _ in wandb_points(folder, "train/loss")] == [10, 20, 30, 45, 50]
    assert "less than the current step" not in capfd.readouterr().err


def wandb_summary(path) -> dict[str, float]:
    """The summary values a W&B run file sets, the last of each key."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for r in wandb_records(path)
            if r.WhichOneof("record_type") == "summary" for i in r.summary.update}


def test_an_evaluation_at_a_step_wandb_is_past_goes_to_its_summary(tmp_path, monkeypatch, capfd):
    """`fibctl eval --log-to wandb` of a run W&B holds to its last step S logged the results at
    S into a new offline file; `wandb sync` uploads the training's file first, so W&B was past
    S and dropped them, warning. Online, a resumed run is past S at once. They go to the run's
    summary (its columns in W&B's run table) instead, and no history row W&B would drop."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    db = Recorder()
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    feed(tee)  # trained to step 20 with the back-end: W&B holds its history whole
    tee.close()
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}), light_tokens=1024)
    tee.catch_up(20)  # as fibctl eval does: nothing W&B lacks
    tee.log_eval(20, "docs_val", 512, 1_048_576, math.log(40.0))
    tee.log_step(45, 1.0, 1e-3, 0.5, 1000.0, 1.0)  # W&B's run at step 45, as an online one resumed there
    tee.log_eval(40, "docs_val", 1024, 1_048_576, math.log(50.0))
    tee.close()
    first, second = sorted((tmp_path / "wandb").glob("*run-*/run-*.wandb"))
    assert [s for s, _ in wandb_history(wandb_records(second)).get("train/loss", [])] == [45]
    assert not any(key.startswith("eval_full/") for key in wandb_history(wandb_records(second)))
    summary = wandb_summary(second)
    assert summary["eval_full/docs_val@512/ppl"] == pytest.approx(40.0)
    assert summary["eval_full/docs_val@1024/ppl"] == pytest.approx(50.0)
    assert "less than the current step" not in capfd.readouterr().err


def test_wandb_disabled_takes_the_replay_and_writes_nothing(tmp_path, monkeypatch):
    """WANDB_MODE=disabled (W&B's switch to turn logging off): no run file to read or wait for."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    db = Recorder()
    db.log_step(10, 1.0, 1e-3, 0.5, 1000.0, 1.0)
    tee = Tee(db, open_sinks(["wandb"], tmp_path, "run", {"seed": 42}))
    tee.event("resumed", "resumed from step 10", {"step": 10})
    tee.log_step(20, 1.0, 1e-3, 0.5, 1000.0, 1.0)
    tee.close()
    assert not list((tmp_path / "wandb").glob("*/*.wandb"))


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


# ----------------------------------------------------------------- files a co-user put in a run's folder


def within(seconds: float, call):
    """`call()`'s result, failing the test where it has not returned after `seconds` (a read
    of a pipe waits forever: a thread of its own, left behind)."""
    import threading

    out: list = []

    def run():
        try:
            out.append((call(), None))
        except Exception as e:  # noqa: BLE001 (raised again in the test's thread)
            out.append((None, e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still running after {seconds} s"
    result, error = out[0]
    if error is not None:
        raise error
    return result


def wandb_file(path: Path, steps: list[str]) -> Path:
    """A W&B run file of history rows whose _step is each of `steps` (JSON), one chunk each."""
    import struct

    from wandb.proto import wandb_internal_pb2

    chunks = b""
    for step in steps:
        record = wandb_internal_pb2.Record()
        item = record.history.item.add()
        item.key, item.value_json = "_step", step
        data = record.SerializeToString()
        chunks += struct.pack("<IHB", 0, len(data), 1) + data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b":W&B\x00\x00\x01" + chunks)
    return path


def test_wandb_files_put_in_a_run_folder_by_hand_neither_stop_nor_hold_its_logging(tmp_path):
    """A step that is not a whole number (int() of it raised ValueError: the run failed) is
    passed over; a pipe of a run file's name (its read waited forever) and a link (to a file
    elsewhere) are not read."""
    pytest.importorskip("wandb")
    from fibctl.train.loggers import wandb_steps

    odd = wandb_file(tmp_path / "a" / "run-x.wandb", ['"abc"', "1.5", "1e999", "9" * 5000, "true", "[[[1]]]", "7"])
    assert within(30, lambda: wandb_steps(odd)) == [7]
    (tmp_path / "b").mkdir()
    os.mkfifo(tmp_path / "b" / "run-x.wandb")
    assert within(30, lambda: wandb_steps(tmp_path / "b" / "run-x.wandb")) == []
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "run-x.wandb").symlink_to(wandb_file(tmp_path / "elsewhere.wandb", ["1000"]))
    assert within(30, lambda: wandb_steps(tmp_path / "c" / "run-x.wandb")) == []


def test_tensorboard_files_put_in_a_run_folder_by_hand_neither_stop_nor_hold_its_catching_up(tmp_path):
    """An event file whose record does not parse raised DecodeError, a folder of an event
    file's name IsADirectoryError (the run failed); a pipe's read waited forever."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer.record_writer import RecordWriter

    sink = open_sinks(["tensorboard"], tmp_path, "r", {"seed": 42})[0]
    sink.log(10, {"train/loss": 1.0})
    folder = tmp_path / "tensorboard"
    with open(folder / "events.out.tfevents.1.odd", "wb") as f:
        RecordWriter(f).write(b"\xff" * 8)  # its checksum right, its content no event
    (folder / "events.out.tfevents.2.folder").mkdir()
    os.mkfifo(folder / "events.out.tfevents.3.pipe")
    missing = within(30, lambda: sink.missing(20))
    sink.close()
    assert not missing("train/loss", 10) and missing("train/loss", 20)


def test_tensorboard_writes_no_event_file_through_a_link_put_at_its_name(tmp_path, monkeypatch):
    """The event file's name (time in seconds, host, PID, a count) is foreseeable and torch's
    SummaryWriter opens it without O_EXCL: a co-user's link at that name was written through,
    the run's metrics landing in (and truncating) the file it pointed at. The name now ends
    with a random suffix; fibctl still finds its own files (a resume's catching up)."""
    pytest.importorskip("tensorboard")
    import socket
    import types

    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    monkeypatch.setattr(event_file_writer, "_global_uid", types.SimpleNamespace(get=lambda: 0))
    folder = tmp_path / "tensorboard"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("kept\n")
    (folder / f"events.out.tfevents.1700000000.{socket.gethostname()}.{os.getpid()}.0").symlink_to(victim)
    sink = open_sinks(["tensorboard"], tmp_path, "r", {"seed": 42})[0]
    sink.log(10, {"train/loss": 1.0})
    sink.resume(10)  # a second writer, of the same foreseeable name
    sink.log(20, {"train/loss": 2.0})
    missing = sink.missing(20)
    sink.close()
    assert victim.read_text() == "kept\n"
    written = [p for p in folder.iterdir() if not p.is_symlink()]
    assert len(written) == 2 and all(re.fullmatch(r"events\.out\.tfevents\..*\.0\.[0-9a-f]{16}", p.name)
                                     for p in written), written
    assert not missing("train/loss", 10) and not missing("train/loss", 20) and missing("train/loss", 30)


def test_a_runs_wandb_id_file_is_read_and_written_only_as_fibctl_writes_it(tmp_path):
    """A co-user of a shared runs folder linked RUN/wandb/fibctl-run-id to another file: its
    content became the W&B id, the name of a folder anyone could list; and a link at the
    foreseeable .fibctl-run-id.PID was written through."""
    secret = tmp_path / "secret.txt"
    secret.write_text("token-0123\n")
    (tmp_path / "run" / "wandb").mkdir(parents=True)
    (tmp_path / "run" / "wandb" / "fibctl-run-id").symlink_to(secret)
    with pytest.raises(FibctlError, match=r"fibctl-run-id does not hold a W&B id fibctl wrote .*: remove it"):
        wandb_run_id(tmp_path / "run", "run")
    (tmp_path / "run" / "wandb" / "fibctl-run-id").unlink()
    (tmp_path / "run" / "wandb" / "fibctl-run-id").write_text("../../x\n")
    with pytest.raises(FibctlError, match="does not hold a W&B id"):
        wandb_run_id(tmp_path / "run", "run")
    (tmp_path / "new" / "wandb").mkdir(parents=True)
    (tmp_path / "new" / "wandb" / f".fibctl-run-id.{os.getpid()}").symlink_to(tmp_path / "victim")
    assert wandb_run_id(tmp_path / "new", "new").startswith("new-")
    assert not (tmp_path / "victim").exists()


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

    # W&B attached to a run by its evaluation: the run's history first, then the evaluation
    code, err = _fibctl(["eval", "tb_run", "--length", "128", "--dataset", "stories_val", "--tokens", "1024",
                         "--db", db, "--data", str(data), "--runs-dir", str(runs), "--log-to", "wandb"],
                        monkeypatch, capsys)
    assert code == 0, err
    history = wandb_history(wandb_records(next((runs / "tb_run" / "wandb").glob("*run-*/run-*.wandb"))))
    stored = sqlite3.connect(db).execute(
        "SELECT step, loss FROM train_steps JOIN runs ON runs.id = run_id WHERE name = 'tb_run' ORDER BY step").fetchall()
    assert history["train/loss"] == [(s, pytest.approx(v)) for s, v in stored]
    assert [s for s, _ in history["eval/stories_val@64/ppl"]] == [10, 20]
    assert [s for s, _ in history["eval/stories_val@128/ppl"]] == [30]


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


def test_a_sigkilled_attempts_steps_reach_wandb_once_through_the_resumed_one(tmp_path, monkeypatch):
    """`fibctl train --log-to wandb` SIGKILLed after its checkpoint at step 10: its offline
    W&B file held its header alone (W&B writes it out late), and the resumed attempt's run
    began at step 15, the steps up to 10 missing from W&B though the database has them. Now
    the resumed attempt sends them: every recorded step and evaluation once over the run's
    files, as `wandb sync` uploads them."""
    pytest.importorskip("wandb")
    import sqlite3

    from test_kills import fibctl, killed_at
    from train_helpers import micro_run, queued_db, write_data

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    # each attempt its own W&B service, as a worker's: this process's (an earlier test's) would
    # hold the killed attempt's run "in use"
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    data, runs, db = write_data(tmp_path / "data"), tmp_path / "runs", str(tmp_path / "r.db")
    queued_db(tmp_path / "r.db", micro_run("run")).dispose()
    args = ["train", "run", "--db", db, "--data", str(data), "--runs-dir", str(runs), "--plain",
            "--heartbeat-timeout", "1", "--log-to", "wandb"]
    killed_at(tmp_path, "fibctl.train.trainer:Trainer.save", *args, after=True)  # the step-10 checkpoint
    time.sleep(1.5)  # its heartbeat stale: the next claim takes the run back
    fibctl(tmp_path, *args)
    folder = runs / "run" / "wandb"
    assert len(list(folder.glob("*run-*/run-*.wandb"))) == 2
    stored = sqlite3.connect(db).execute("SELECT step, loss FROM train_steps ORDER BY step").fetchall()
    assert [s for s, _ in stored] == [5, 10, 15, 20, 25, 30]
    assert wandb_points(folder, "train/loss") == [(s, pytest.approx(v)) for s, v in stored]
    stored = sqlite3.connect(db).execute("SELECT step, ppl FROM evaluations WHERE dataset = 'math_val' "
                                         "ORDER BY step").fetchall()
    assert [s for s, _ in stored] == [10, 20, 30]  # each with a checkpoint: the full budget
    assert wandb_points(folder, "eval_full/math_val@64/ppl") == [(s, pytest.approx(v)) for s, v in stored]
    assert [s for s, _ in wandb_points(folder, "alpha/layer0")] == [0]


def tensorboard_points(folder, tag: str) -> list[int]:
    """The steps of every point of `tag` in every event file of `folder`, as written."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return sorted(event.step for path in folder.glob("events.out.tfevents.*") for event in EventFileLoader(str(path)).Load()
                  for value in event.summary.value if value.tag == tag)


def test_a_retry_from_start_leaves_the_new_attempts_curves_alone(tmp_path, monkeypatch, capsys):
    """`queue retry --from-start` deleted the run's rows past step 0 but kept its TensorBoard
    event files and its W&B folder: the new attempt's points were written beside the old
    one's at each step, and W&B (the same id) dropped the new ones below the old one's last
    step. They go with the rows, and the new attempt is a new W&B run."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    import sqlite3

    from train_helpers import micro_run, queued_db, write_data

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    data, runs, db = write_data(tmp_path / "data"), tmp_path / "runs", str(tmp_path / "r.db")
    queued_db(tmp_path / "r.db", micro_run("run", checkpoint_interval=30)).dispose()
    worker = ["worker", "--db", db, "--data", str(data), "--runs-dir", str(runs), "--plain", "--max-runs", "1",
              "--log-to", "tensorboard", "--log-to", "wandb"]
    assert _fibctl(worker, monkeypatch, capsys) == (0, "")
    first_id = wandb_run_id(runs / "run", "run")
    for path in (runs / "run").glob("step_*.pt"):  # none of its checkpoints loads: moved aside, the run failed
        path.rename(path.with_name(path.name + ".damaged"))
    sqlite3.connect(db).execute("UPDATE runs SET status = 'failed'").connection.commit()

    code, out, err = ran(monkeypatch, capsys, "queue", "retry", "run", "--from-start", "--db", db)
    assert code == 0, err
    said = "".join(out.split())  # wrapped at 80 columns, the paths folded
    assert said.endswith("".join(f"; also deleted its metric logs {runs / 'run' / 'tensorboard'}, "
                                 f"{runs / 'run' / 'wandb'}".split()))
    assert sorted(p.name for p in (runs / "run").iterdir()) == ["step_00000030.pt.damaged"]

    assert _fibctl(worker, monkeypatch, capsys) == (0, "")
    stored = [s for (s,) in sqlite3.connect(db).execute("SELECT step FROM train_steps ORDER BY step")]
    assert stored == [5, 10, 15, 20, 25, 30]
    assert tensorboard_points(runs / "run" / "tensorboard", "train/loss") == stored  # each once
    assert wandb_run_id(runs / "run", "run") != first_id
    assert [s for s, _ in wandb_points(runs / "run" / "wandb", "train/loss")] == stored


def test_a_retry_from_start_whose_logs_will_not_go_changes_nothing(tmp_path, monkeypatch, capsys):
    """A back-end's folder that cannot be deleted is one line, before the retry commits: the
    run stays failed with its rows. A link in a run's folder is not followed, nor deleted."""
    import shutil
    import sqlite3

    from cli_helpers import refused
    from train_helpers import micro_run, queued_db

    db = str(tmp_path / "r.db")
    queued_db(tmp_path / "r.db", micro_run("run")).dispose()
    sqlite3.connect(db).execute("UPDATE runs SET status = 'failed'").connection.commit()
    monkeypatch.chdir(tmp_path)  # the run's folder: runs/run, its default
    (tmp_path / "runs" / "run" / "tensorboard").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "run" / "wandb").symlink_to(tmp_path / "elsewhere")

    def refuses(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", refuses)
    err = refused(monkeypatch, capsys, "queue", "retry", "run", "--from-start", "--db", db)
    assert err == (f"error: cannot delete {Path('runs/run/tensorboard')}, the metric logs of the run's earlier "
                   "attempt (Permission denied): delete it by hand; the run was not queued again\n")
    assert sqlite3.connect(db).execute("SELECT status FROM runs").fetchall() == [("failed",)]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    code, out, err = ran(monkeypatch, capsys, "queue", "retry", "run", "--from-start", "--db", db)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "runs" / "run").iterdir()) == ["wandb"]
    assert (tmp_path / "elsewhere").is_dir()
