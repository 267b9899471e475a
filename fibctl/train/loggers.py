"""Optional metric back-ends beside the database: TensorBoard and Weights & Biases.

The database always gets every metric (it is what the reports read); `--log-to tensorboard`
and `--log-to wandb` also send the training loss, learning rate, gradient norm, throughput,
evaluations and alphas to the tools researchers already watch. `Tee` wraps the run's
database reporter and forwards each call to every back-end. Both back-ends are extras
(`pip install -e '.[tensorboard]'`, `'.[wandb]'`); W&B runs offline unless WANDB_MODE or an
API key says otherwise, so it works without an account.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import secrets
from pathlib import Path

from fibctl.config import flatten
from fibctl.errors import FibctlError, WorkerError, first_line, shown_path

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


class TensorBoardSink:
    """Event files under RUN_DIR/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, run_dir: Path, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(run_dir) / "tensorboard"
        fresh = not any(log_dir.glob("events.out.tfevents.*"))  # a resumed or evaluated run has its config
        self.writer = SummaryWriter(log_dir=str(log_dir))
        if fresh:
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=2, sort_keys=True)}\n```", 0)
            self._add_hparams(config)

    def _add_hparams(self, config: dict) -> None:
        """The run's settings as TensorBoard hyperparameters, in the run's own folder (add_hparams
        would start another run beside it): the HParams tab then filters and sorts runs by
        schedule, W or lr, against their training loss."""
        from torch.utils.tensorboard.summary import hparams

        settings = {key: value for key, value in flatten(config).items()
                    if isinstance(value, (bool, int, float, str))}
        for summary in hparams(settings, {"train/loss": math.nan}):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def resume(self, step: int) -> None:
        """The run resumed from its checkpoint at `step`: the steps an earlier attempt logged
        after it (a worker killed between checkpoints) are trained and logged again, so
        TensorBoard is told to hide those (purge_step) rather than draw each step twice."""
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.writer.log_dir
        self.writer.close()
        self.writer = SummaryWriter(log_dir=log_dir, purge_step=step + 1)

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
    if path.is_file():
        return path.read_text().strip()
    earlier = any(folder.glob(f"*run-*-{name}"))  # W&B's run folders end with the id
    run_id = name if earlier else f"{name[:WANDB_ID_NAME_CHARS]}-{secrets.token_hex(4)}"
    folder.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{WANDB_ID_FILE}.{os.getpid()}")
    part.write_text(run_id + "\n")
    os.replace(part, path)  # whole or not there, whenever the process stops
    return run_id


class WandbSink:
    """A W&B run named after the fibctl run, its files under RUN_DIR/wandb; offline by default.
    Its id (`wandb_run_id`) stays with the run's folder, so a resumed run continues the same
    W&B run; runs of one matrix form a group, which W&B's run table and charts compare together."""

    def __init__(self, run_dir: Path, name: str, config: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "fibctl"), name=name,
                              id=wandb_run_id(run_dir, name),
                              group=config.get("matrix"), resume="allow", dir=str(run_dir), config=config, mode=mode,
                              reinit="finish_previous")  # the boolean is deprecated

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink}


class Tee:
    """A Reporter that writes to the database reporter and copies the metrics to back-ends.
    An evaluation on more tokens than the run's light budget (`eval_tokens`: the full ones
    at checkpoints and the last step, and `fibctl eval`'s) goes under `eval_full/`: it scores
    more of each held-out stream, so in the light ones' curve it would be a jump at every
    checkpoint (the curves figure draws the two budgets apart too)."""

    def __init__(self, reporter, sinks: list, light_tokens: int | None = None):
        self.reporter, self.sinks, self.light_tokens = reporter, sinks, light_tokens

    def _copy(self, step: int, values: dict) -> None:
        finite = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)}
        for sink in self.sinks:
            sink.log(step, finite)

    def log_step(self, step, loss, lr, grad_norm, tokens_per_s, elapsed_s, mfu=None) -> None:
        self.reporter.log_step(step, loss, lr, grad_norm, tokens_per_s, elapsed_s, mfu)
        self._copy(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm,
                          "train/tokens_per_s": tokens_per_s, "train/mfu": mfu})

    def log_eval(self, step, dataset, eval_length, tokens, loss, positions=None, windows=None) -> None:
        # positions: the database only, in the perplexity's transaction
        self.reporter.log_eval(step, dataset, eval_length, tokens, loss,
                               *((positions, windows) if positions is not None else ()))
        kind = "eval_full" if self.light_tokens is not None and tokens > self.light_tokens else "eval"
        self._copy(step, {f"{kind}/{dataset}@{eval_length}/loss": loss,
                          f"{kind}/{dataset}@{eval_length}/ppl": math.exp(min(loss, 700))})

    def event(self, kind, message=None, data=None) -> None:
        self.reporter.event(kind, message, data)
        if kind == "resumed":  # only TensorBoard needs telling: W&B ignores steps below its last
            for sink in self.sinks:
                if hasattr(sink, "resume"):
                    sink.resume(data["step"])

    def log_alphas(self, step, alphas) -> None:
        self.reporter.log_alphas(step, alphas)
        self._copy(step, {f"alpha/layer{layer}": a for layer, a in enumerate(alphas)})

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


def open_sinks(names, run_dir: Path, name: str, config: dict) -> list:
    """Each back-end started, its folder inside the run's; one that cannot start (a bad
    WANDB_MODE, a file where its folder goes) is the worker's setup at fault, not the run's:
    WorkerError, so the run goes back to the queue untouched."""
    sinks = []
    if names:
        check_run_folder(run_dir)
    try:
        for n in names:
            folder = Path(run_dir) / n
            if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
                raise WorkerError(f"--log-to {n}: {folder} is a {'link' if folder.is_symlink() else 'file'}; "
                                  f"{n}'s files are written only into a folder of the run's own: remove it")
            try:
                sinks.append(SINKS[n](run_dir, name, config))
            except Exception as e:  # noqa: BLE001 (pydantic's ValidationError, OSError, ...)
                raise WorkerError(f"--log-to {n} could not start for run {name!r}: {type(e).__name__}: "
                                  f"{_why(e)}") from None
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
