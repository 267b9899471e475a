"""Optional metric back-ends beside the database: TensorBoard and Weights & Biases.

The database always gets every metric (it is what the reports read); `--log-to tensorboard`
and `--log-to wandb` also send the training loss, learning rate, gradient norm, throughput,
evaluations and alphas to the tools researchers already watch. `Tee` wraps the run's
database reporter and forwards each call to every back-end. Both back-ends are extras
(`pip install -e '.[tensorboard]'`, `'.[wandb]'`); W&B runs offline unless WANDB_MODE or an
API key says otherwise, so it works without an account.

A back-end holds only what it was sent while attached: a run trained without `--log-to` and
resumed with it, or an attempt killed before W&B wrote its history out, would leave the
curve starting at the checkpoint. On resuming (and before `fibctl eval` logs) `Tee.catch_up`
sends each back-end the database's rows up to that step which it does not hold yet.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path

from fibctl.config import flatten
from fibctl.errors import FibctlError, WorkerError, first_line, shown_path
from fibctl.names import is_name

LOGGERS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_loggers(names) -> tuple[str, ...]:
    """The back-ends asked for, each importable; else one line naming the extra to install."""
    names = tuple(dict.fromkeys(names))
    for name in names:
        if name not in LOGGERS:
            raise FibctlError(f"--log-to {name!r}: allowed: {', '.join(LOGGERS)}")
        module, extra = LOGGERS[name]
        try:
            importlib.import_module(module)
        except ImportError:
            raise FibctlError(f"--log-to {name} needs the {extra} package: pip install -e '.[{extra}]'") from None
    return names


# TensorBoard's event files: it reads every file whose name holds "tfevents"
EVENT_FILES = "events.out.tfevents.*"


def _summary_writer(log_dir: str, **options):
    """torch's SummaryWriter, its event file named with a random suffix: the name it makes
    (time in seconds, host, PID, a count) is foreseeable, and the file is opened without
    O_EXCL, so a link a co-user put at that name was written through."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir, filename_suffix=f".{secrets.token_hex(8)}", **options)


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, run_dir: Path, name: str, config: dict, heldout: tuple[str, ...] = ()):
        log_dir = Path(run_dir) / "tensorboard"
        fresh = not any(log_dir.glob(EVENT_FILES))  # a resumed or evaluated run has its config
        self.writer = _summary_writer(str(log_dir))
        if fresh:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, sort_keys=True)}\n```", 0)
            self._add_hparams(config, heldout)

    def _add_hparams(self, config: dict, heldout: tuple[str, ...]) -> None:
        """The run's settings as TensorBoard hyperparameters, in the run's own folder (add_hparams
        would start another run beside it): the HParams tab then filters and sorts runs by
        schedule, W or lr, against their training loss and their held-out loss and perplexity
        at the training length (the light evaluations' and the full ones', the final among
        them: what the paper compares)."""
        from torch.utils.tensorboard.summary import hparams

        settings = {key: value for key, value in flatten(config).items()
                    if isinstance(value, (bool, int, float, str))}
        metrics = ["train/loss"]
        if heldout:  # a probe run has none
            length, train = config["model"]["seq_len"], config["train"]
            kinds = ("eval", "eval_full") if train["final_eval_tokens"] > train["eval_tokens"] else ("eval",)
            metrics += [key for kind in kinds for dataset in heldout for key in eval_values(kind, dataset, length, 0)]
        for summary in hparams(settings, dict.fromkeys(metrics, math.nan)):
            self.writer.file_writer.add_summary(summary)

    def missing(self, upto: int) -> Callable[[str, int], bool]:
        """Whether the event files lack a tag's point at a step: one after the tag's last up to
        `upto` (what an earlier attempt logged after it is purged: `resume`)."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        from google.protobuf.message import DecodeError

        last: dict[str, int] = {}
        for path in Path(self.writer.log_dir).glob(EVENT_FILES):
            if not _plain(path):  # a pipe's read waited forever, a folder's raised
                continue
            try:
                for event in EventFileLoader(str(path)).Load():
                    if event.step <= upto:
                        for value in event.summary.value:
                            last[value.tag] = max(last.get(value.tag, -1), event.step)
            except (DecodeError, OSError):  # a damaged file (or one put there) holds what it held so far
                pass
        return lambda key, step: step > last.get(key, -1)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def resume(self, step: int) -> None:
        """The run resumed from its checkpoint at `step`: the steps an earlier attempt logged
        after it (a worker killed between checkpoints) are trained and logged again, so
        TensorBoard is told to hide those (purge_step) rather than draw each step twice."""
        log_dir = self.writer.log_dir
        self.writer.close()
        self.writer = _summary_writer(log_dir, purge_step=step + 1)

    def close(self) -> None:
        self.writer.close()


WANDB_ID_FILE = "fibctl-run-id"
WANDB_ID_NAME_CHARS = 55  # of the run's name in its W&B id: with "-" and 8 hex digits, 64 characters


def wandb_run_id(run_dir: Path, name: str) -> str:
    """The W&B id of the fibctl run in `run_dir`: its name and a random suffix, kept in
    RUN_DIR/wandb so that a resumed run (and its evaluations) continue the same W&B run. Names
    are unique only within one database, and two databases' runs named alike would otherwise
    share one W&B run, where W&B drops the steps below its last (one run's history lost). A
    run that logged to W&B before the suffix keeps its name as its id."""
    folder = Path(run_dir) / "wandb"
    path = folder / WANDB_ID_FILE
    if os.path.lexists(path):
        return _recorded_id(path)
    earlier = any(folder.glob(f"*run-*-{name}"))  # W&B's run folders end with the id
    run_id = name if earlier else f"{name[:WANDB_ID_NAME_CHARS]}-{secrets.token_hex(4)}"
    folder.mkdir(parents=True, exist_ok=True)
    # made new under a name no one foresees: a link a co-user put at .fibctl-run-id.PID was written through
    part = path.with_name(f".{WANDB_ID_FILE}.{os.getpid()}-{secrets.token_hex(4)}")
    with open(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as f:
        f.write(run_id + "\n")
    os.replace(part, path)  # whole or not there, whenever the process stops
    return run_id


def _plain(path: Path) -> bool:
    """Whether `path` is a plain file itself, not a link, pipe or folder: what the back-ends
    write. A co-user of a shared runs folder could put any of those in a run's: a link to
    /dev/zero was read without end, and a pipe's open waited forever."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _open_plain(path: Path):
    """`path` opened to read, if it is a plain file and not a link (`_plain`, checked on the
    file opened: nothing swapped in between); else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _recorded_id(path: Path) -> str:
    """The W&B id `wandb_run_id` wrote, refused (WorkerError: the run is not at fault) unless it
    is one fibctl writes, a name (`check_name`'s) in a plain file: a link there (a co-user's, in
    a shared runs folder) made another file's content the W&B run's id, and so the name of a
    folder anyone could list (and online, of a W&B run)."""
    f = _open_plain(path)
    text = b""
    if f is not None:
        with f:
            text = f.read(256)
    try:
        run_id = text.decode().strip()
    except UnicodeDecodeError:
        run_id = ""
    if not is_name(run_id):
        raise WorkerError(f"--log-to wandb: {shown_path(path)} does not hold a W&B id fibctl wrote (a run's name, "
                          "in a plain file): remove it, and the run gets a new W&B run")
    return run_id


WANDB_BLOCK = 32768  # LevelDB log's: a chunk never crosses one
WANDB_RECORD_LIMIT = 1 << 26  # bytes of one record: W&B's are rows of metrics, config, a summary


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-ID.wandb`, LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header of crc32, length and type 1 whole, 2 first, 3 middle, 4 last),
    as W&B's own protobuf Records: what `wandb sync` uploads. A tail cut short (its writer
    killed) ends them, as does anything else out of form (a file put there by hand); read a
    block at a time, and only from a plain file (`_open_plain`)."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    f = _open_plain(path)
    if f is None:
        return []
    records, pending, pos = [], bytearray(), 7
    with f:
        block = f.read(WANDB_BLOCK)
        if block[:4] != b":W&B":
            return []
        while block:
            while pos + 7 <= len(block):  # a block's tail too short for a header is padding
                _, length, kind = struct.unpack("<IHB", block[pos:pos + 7])
                end = pos + 7 + length
                if kind not in (1, 2, 3, 4) or end > len(block) or len(pending) + length > WANDB_RECORD_LIMIT:
                    return records
                if kind in (1, 2):
                    pending.clear()
                pending += block[pos + 7:end]
                pos = end
                if kind in (1, 4):
                    record = wandb_internal_pb2.Record()
                    try:
                        record.ParseFromString(bytes(pending))
                    except DecodeError:
                        return records
                    records.append(record)
            block, pos = f.read(WANDB_BLOCK), 0
    return records


def _whole(value_json: str) -> int | None:
    """A history row's step as W&B wrote it (a JSON whole number); None for anything else."""
    try:
        value = json.loads(value_json)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def wandb_steps(path: Path) -> list[int]:
    """The steps of the history rows a W&B run file holds (a row whose step is not a whole
    number, in a file put there by hand, is passed over: it raised ValueError)."""
    steps = (_whole(item.value_json) for r in wandb_records(path) if r.WhichOneof("record_type") == "history"
             for item in r.history.item if (item.key or "/".join(item.nested_key)) == "_step")
    return [step for step in steps if step is not None]


class WandbSink:
    """A W&B run named after the fibctl run, its files under RUN_DIR/wandb; offline by default.
    Its id (`wandb_run_id`) stays with the run's folder, so a resumed run continues the same
    W&B run; runs of one matrix form a group, which W&B's run table and charts compare together."""

    def __init__(self, run_dir: Path, name: str, config: dict, heldout: tuple[str, ...] = ()):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fibctl"), name=name,
                              id=wandb_run_id(run_dir, name),
                              group=config.get("matrix"), resume="allow", dir=str(run_dir), config=config, mode=mode,
                              reinit="finish_previous")  # the boolean is deprecated
        self.folder = Path(run_dir) / "wandb"
        self._held: int | None = None  # the last step this run's earlier offline files hold

    def _first_step(self) -> int:
        """The lowest step W&B's history still takes: the step its run is at (a resumed online
        run's is past its history; W&B drops a lower one, warning once a row), past what this
        run's earlier offline files hold, which `wandb sync` uploads before this one's."""
        if self._held is None:  # read once: an earlier attempt's files do not change
            mine = self._file()
            self._held = max((max(wandb_steps(path), default=-1) for path in self.folder.glob(f"*/{mine.name}")
                              if path != mine), default=-1)
        return max(self.run.step, self._held + 1)

    def missing(self, upto: int) -> Callable[[str, int], bool]:
        """Whether W&B lacks a step: one its history still takes (`_first_step`)."""
        first = self._first_step()
        return lambda key, step: step >= first

    def log(self, step: int, values: dict[str, float]) -> None:
        """`values` into the history at `step`; or, where the history is past it, into the
        run's summary (its columns in W&B's run table), which W&B would otherwise drop with a
        warning: `fibctl eval --log-to wandb` of a run W&B holds to its last step records
        its results at that step."""
        if step < self._first_step():
            self.run.summary.update(values)
        else:
            self.run.log(values, step=step)

    def _file(self) -> Path:
        """The run file this attempt writes (W&B names its folder; a second in the same second gets -1)."""
        return Path(self.run.dir).parent / f"run-{self.run.id}.wandb"

    def close(self) -> None:
        """Finish the run, and wait (10 s at most) until its file is written out: W&B's
        finish returns before that at times, and the same run opened again in this process
        would take the file's steps for missing (`missing`). WANDB_MODE=disabled writes none."""
        path = self._file()
        self.run.finish()
        deadline = time.monotonic() + 10
        while path.is_file() and time.monotonic() < deadline and not any(
                r.WhichOneof("record_type") == "exit" for r in wandb_records(path)):
            time.sleep(0.05)


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


def eval_values(kind: str, dataset: str, eval_length: int, loss: float) -> dict[str, float]:
    """An evaluation's keys (`kind`: eval, or eval_full for one on more tokens) and values."""
    at = f"{kind}/{dataset}@{eval_length}"
    return {f"{at}/loss": loss, f"{at}/ppl": math.exp(min(loss, 700))}


def _finite(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}


class Tee:
    """A Reporter that writes to the database reporter and copies the metrics to back-ends.
    An evaluation on more tokens than the run's light budget (`eval_tokens`: the full ones
    at checkpoints and the last step, and `fibctl eval`'s) goes under `eval_full/`: it scores
    more of each held-out stream, so in the light ones' curve it would be a jump at every
    checkpoint (the curves figure draws the two budgets apart too). The database reporter
    also reads the run's rows back (`history`, fibctl.db.store.RunRecorder's): `catch_up`."""

    def __init__(self, reporter, sinks: list, light_tokens: int | None = None):
        self.reporter, self.sinks, self.light_tokens = reporter, sinks, light_tokens

    def _copy(self, step: int, values: dict) -> None:
        finite = _finite(values)
        for sink in self.sinks:
            sink.log(step, finite)

    def _values(self, kind: str, fields: dict) -> dict:
        """The back-ends' keys and values of a step, evaluation or alphas row: live and replayed alike."""
        if kind == "step":
            return {"train/loss": fields["loss"], "train/lr": fields["lr"], "train/grad_norm": fields["grad_norm"],
                    "train/tokens_per_s": fields["tokens_per_s"], "train/mfu": fields.get("mfu")}
        if kind == "eval":
            tokens = fields["tokens"]  # unknown (NULL) in an imported run: a light one
            full = self.light_tokens is not None and tokens is not None and tokens > self.light_tokens
            return eval_values("eval_full" if full else "eval", fields["dataset"], fields["eval_length"],
                               fields["loss"])
        return {f"alpha/layer{layer}": a for layer, a in enumerate(fields["alphas"])}

    def log_step(self, step, loss, lr, grad_norm, tokens_per_s, elapsed_s, mfu=None) -> None:
        self.reporter.log_step(step, loss, lr, grad_norm, tokens_per_s, elapsed_s, mfu)
        self._copy(step, self._values("step", dict(loss=loss, lr=lr, grad_norm=grad_norm,
                                                   tokens_per_s=tokens_per_s, mfu=mfu)))

    def log_eval(self, step, dataset, eval_length, tokens, loss, positions=None, windows=None) -> None:
        # positions: the database only, in the perplexity's transaction
        self.reporter.log_eval(step, dataset, eval_length, tokens, loss,
                               *((positions, windows) if positions is not None else ()))
        self._copy(step, self._values("eval", dict(dataset=dataset, eval_length=eval_length, tokens=tokens,
                                                   loss=loss)))

    def event(self, kind, message=None, data=None) -> None:
        self.reporter.event(kind, message, data)
        if kind == "resumed":
            for sink in self.sinks:
                if hasattr(sink, "resume"):
                    sink.resume(data["step"])
            self.catch_up(data["step"])

    def catch_up(self, upto: int) -> None:
        """Send each back-end the database's rows up to step `upto` that it lacks (its
        `missing`): the history before it was attached, or an attempt's that it lost (W&B
        writes its file out late: a killed worker's held its header alone). MFU is not
        recorded (the database keeps tokens/s): a replayed step has none."""
        rows: dict[int, dict] = {}
        for step, kind, fields in self.reporter.history(upto):
            rows.setdefault(step, {}).update(_finite(self._values(kind, fields)))
        for sink in self.sinks:
            missing = sink.missing(upto)
            for step in sorted(rows):
                values = {key: value for key, value in rows[step].items() if missing(key, step)}
                if values:
                    sink.log(step, values)

    def log_alphas(self, step, alphas) -> None:
        self.reporter.log_alphas(step, alphas)
        self._copy(step, self._values("alphas", dict(alphas=alphas)))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __getattr__(self, name):  # metrics, heartbeats, run updates: the database only
        return getattr(self.reporter, name)


def _why(e: Exception) -> str:
    """The cause in one line: a pydantic ValidationError (W&B's settings, e.g. WANDB_SILENT=''
    refused) says which setting and why below a first line that says neither."""
    try:
        return "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in e.errors())
    except Exception:  # noqa: BLE001 (not pydantic's: no errors(), or another kind of it)
        return first_line(e)


def check_run_folder(run_dir: Path) -> None:
    """Refuse a run folder that is a link (one made by hand: fibctl makes none): the back-ends'
    files would be written wherever it points. fibctl eval's check before it measures any run
    (the worker refuses such a folder before it trains)."""
    if Path(run_dir).is_symlink():
        raise WorkerError(f"--log-to: run folder {shown_path(run_dir)} is a link; logs are written only into "
                          "a folder of the run's own: remove the link, or leave out --log-to")


def open_sinks(names, run_dir: Path, name: str, config: dict, heldout=()) -> list:
    """Each back-end started, its folder inside the run's; one that cannot start (a bad
    WANDB_MODE, a file where its folder goes) is the worker's setup at fault, not the run's:
    WorkerError, so the run goes back to the queue untouched. `heldout`: the sets the run
    is evaluated on (TensorBoard's HParams metrics)."""
    sinks = []
    if names:
        check_run_folder(run_dir)
    try:
        for n in names:
            folder = Path(run_dir) / n
            if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                raise WorkerError(f"--log-to {n}: {shown_path(folder)} is a "
                                  f"{'link' if folder.is_symlink() else 'file'}; {n}'s files are written only into a "
                                  "folder of the run's own: remove it")
            try:
                sinks.append(SINKS[n](run_dir, name, config, tuple(heldout)))
            except WorkerError:  # said in full already
                raise
            except Exception as e:  # noqa: BLE001 (pydantic's ValidationError, OSError, ...)
                raise WorkerError(f"--log-to {n} could not start for run {name!r}: {type(e).__name__}: "
                                  f"{_why(e)}") from None
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
