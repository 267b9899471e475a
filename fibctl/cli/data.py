"""`fibctl data`: prepare a data recipe into a tokenizer and token streams, and inspect the result."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.markup import escape
from rich.text import Text

from fibctl.cli import app
from fibctl.cli.common import console, data_dir_value, err_console, fitted_table, fitted_view, folder_value, plain
from fibctl.data.recipe import load_recipe, shipped
from fibctl.data.streams import DataManifest, load_manifest
from fibctl.errors import printable, shown_path
from fibctl.units import duration

data_app = typer.Typer(help="Data recipes -> byte-level BPE tokenizer -> uint16 token streams.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")


def _rate(task: Task) -> str:
    """Tokens (or chars, or packages) per second, in at most 5 characters before the unit; ''
    before the first measure."""
    speed = task.finished_speed or task.speed
    if not speed:
        return ""
    scaled = next(((speed / 10**p, s) for p, s in ((9, "G"), (6, "M"), (3, "k")) if speed >= 10**p), (speed, ""))
    return f"{scaled[0]:.3g}{scaled[1]} {task.fields.get('unit', '')}/s"


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(_rate(task), style="progress.data.speed")


LOG_EVERY_S = 60.0  # in a log, a line for each unfinished task at most this often


class _LoggedProgress(Progress):
    """No bars, for a log (stderr not a terminal), but a line for each unfinished task every
    LOG_EVERY_S: `data prepare paper` (hours) said nothing there until it ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._logged_at = time.monotonic()

    def update(self, task_id, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._log()

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log()

    def _log(self) -> None:
        if time.monotonic() - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = time.monotonic()
        for task in self.tasks:
            if task.finished or not task.completed:
                continue
            share = f" ({task.percentage:.0f} %)" if task.total else ""
            rate = _rate(task)
            self.console.print(f"{task.description}: {task.completed:,.0f} of {task.total or 0:,.0f} "
                               f"{task.fields.get('unit', '')}{share}" + (f", {rate}" if rate else "")
                               + f", {duration(task.elapsed or 0)}", highlight=False, markup=False, soft_wrap=True)


# the columns beside the bar: the description (22), the count and its unit (21: "packages"),
# the rate (16), the time (7) and the spaces between: the bar takes what is left, up to 20
BESIDE_THE_BAR = 70


def token_progress(plain: bool = False) -> Progress:
    """Progress bars with counts and rates, for `prepare(..., progress=...)`; none when plain,
    nor when stderr is not a terminal (a log: stopped there, the bars left a blank line before
    the error or summary), where a line now and then says how far each task is. The bar is
    as wide as the terminal leaves (none below 5), so that a line fits 80 columns."""
    room = min(20, err_console.width - BESIDE_THE_BAR)
    logged = not plain and not err_console.is_terminal
    return (_LoggedProgress if logged else Progress)(
        TextColumn("{task.description:<22}"), *([BarColumn(bar_width=room)] if room >= 5 else []),
        TextColumn("{task.completed:>12,.0f} {task.fields[unit]}"), _RateColumn(), TimeElapsedColumn(),
        console=err_console, disable=plain or logged, transient=True,  # an error is one line
    )


@data_app.command("prepare")
def prepare_cmd(
    recipe: Annotated[str, typer.Argument(help=f"A shipped recipe ({', '.join(shipped())}) or a .toml path.")],
    out: Annotated[Path | None, typer.Option(
        "--data", "--out", envvar="FIBCTL_DATA", parser=data_dir_value, metavar="<path>",
        help="Data folder to write (where `fibctl worker --data` reads); --out is an older name. Default: data.")]
    = None,
    plain: Annotated[bool, typer.Option(
        "--plain", "--quiet", "-q", help="No progress bars: the summary only (--quiet, -q: older names).")] = False,
) -> None:
    """Train the recipe's tokenizer and write its token streams and manifest (reused when up to date).

    Example: fibctl data prepare demo --data data/demo"""
    from fibctl.data.prepare import data_folder, prepare  # tokenizers and datasets load when a recipe is prepared

    r = load_recipe(recipe)
    r.check_heldout()  # before the build, not by `train` after it
    out = data_folder(out or Path("data"))
    start = time.perf_counter()
    made = _missing_parents(out)
    try:
        with token_progress(plain) as progress:
            # why a folder of this recipe is built again, said before the build (hours, for paper)
            result = prepare(r, out, progress, note=lambda line: progress.console.print(
                f"[yellow]note:[/] {escape(printable(line, lines=True))}", highlight=False, soft_wrap=True))
    except KeyboardInterrupt:  # the build is in a folder beside `out`, swapped in only when complete
        _remove_empty(made)
        err_console.print(f"interrupted; run the same command again to prepare {shown_path(out)}", markup=False,
                          highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except BaseException:
        _remove_empty(made)
        raise
    _warn_short(result.manifest)
    if result.finished:  # killed while putting its build in place: that build, checked, is in place now
        console.print(f"{shown_path(out)}: finished the interrupted prepare of recipe {r.name!r} ({r.recipe_hash}): "
                      "its complete build is in place", markup=False, highlight=False, soft_wrap=True)
    elif result.reused:
        console.print(f"{shown_path(out)}: up to date with recipe {r.name!r} ({r.recipe_hash}); reused", markup=False,
                      highlight=False, soft_wrap=True)
    else:  # one line, also in a log file (soft_wrap): a terminal folds it at its own width
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        console.print(f"{shown_path(out)}: prepared recipe {r.name!r} in {time.perf_counter() - start:.1f} s ({phases})",
                      markup=False, highlight=False, soft_wrap=True)
    _print_manifest(result.manifest)


def _missing_parents(out: Path) -> list[Path]:
    """The folders above `out` that do not exist yet (prepare creates them), deepest first."""
    missing = []
    for parent in out.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders this prepare created above `out`, deepest first, while they are empty:
    one stopped before anything was in place left `a/b/c/` behind for nothing."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # something is in it (not ours to remove), or it is gone already
            return


@data_app.command("show")
def show_cmd(
    data_dir: Annotated[Path, typer.Argument(envvar="FIBCTL_DATA", show_envvar=True,
                                             parser=folder_value("DATA_DIR", "a prepared data folder"),
                                             help="A folder written by `fibctl data prepare`.")],
) -> None:
    """Summarise a prepared data folder: vocab, hashes, tokens per split and per source; its
    tokenizer missing, or a split file missing, cut short, holding ids past the vocabulary or
    changed since it was prepared (its hash), is an error (exit 2).

    Example: fibctl data show data/demo"""
    manifest = load_manifest(data_dir)
    manifest.check_tokenizer()
    for split in manifest.splits:  # as a worker checks them before it trains on them
        manifest.stream(split)
    _print_manifest(manifest)


@data_app.command("recipes")
def recipes_cmd() -> None:
    """List the recipes shipped with fibctl.

    Example: fibctl data recipes"""
    rows = [[name, f"{r.vocab_size:,}", f"{r.train_tokens:,}", "\n".join(r.heldout), r.description]
            for name, r in ((name, load_recipe(name)) for name in shipped())]
    # held-out set names are what --dataset takes: whole at any width (a plain table cut them
    # to 'fineweb_e…' at 60 columns), as are the numbers; the description folds
    table, _ = fitted_table(["recipe", "vocab", "train tokens", "held-out sets", "description"], rows,
                            width=console.width, names=("recipe", "held-out sets"), fold=("description",),
                            right=("vocab", "train tokens"))
    console.print(table)


def _print_manifest(m: DataManifest) -> None:
    # the recipe's name is free text: a control code in it is shown, not obeyed
    # the data hash, as runs record it (`runs.data_hash`): which runs this folder evaluates
    console.print(plain(f"recipe {m.recipe} ({m.recipe_hash}); data {m.data_hash}"))
    console.print(plain(f"vocab {m.vocab_size:,} (tokenizer {m.tokenizer_vocab:,}, {m.tokenizer_hash}); "
                        f"eos id {m.eos_id}"))
    # every cell whole at any width: names fold within their column; a path is never split
    # (to be copied), so a terminal too narrow for it gets a field a line, the path whole
    console.print(fitted_view(["split", "tokens", "file"],
                              [[split, f"{m.tokens[split]:,}", str(m.split_path(split))] for split in m.splits],
                              names=("split",), whole=("file",), right=("tokens",)), crop=False)
    rows = []
    for name, s in m.sources.items():
        share = s["train_tokens"] / m.tokens["train"] if m.tokens["train"] else 0.0
        rows.append([name, s["kind"], f"{s['train_tokens']:,}", f"{share:.1%}", f"{s['train_documents']:,}",
                     s["heldout"] or "-", f"{s['heldout_documents']:,}"])
    # the document counts go first; narrower, a field a line (at 60 columns every cell folded)
    console.print(fitted_view(["source", "kind", "train tokens", "share", "train docs", "held-out set",
                               "held-out docs"], rows, names=("source", "kind", "held-out set"),
                              optional=("train docs", "held-out docs"),
                              right=("train tokens", "share", "train docs", "held-out docs")))


def _warn_short(m: DataManifest) -> None:
    targets = sum(s["target_tokens"] for s in m.sources.values())
    for name, s in m.sources.items():
        if s["exhausted"]:
            # the other sources keep their targets: the mixture is not the recipe's (said only
            # where the shares, as shown, differ: sources that all ran out in proportion keep it)
            actual = f"{s['train_tokens'] / m.tokens['train']:.1%}" if m.tokens["train"] else ""
            target = f"{s['target_tokens'] / targets:.1%}"
            share = "" if len(m.sources) == 1 or not actual or actual == target else (
                f"; its share of the training stream is {actual}, not {target}")
            err_console.print(f"[yellow]note:[/] source {escape(repr(name))} ran out at {s['train_tokens']:,} of its "
                              f"{s['target_tokens']:,} training tokens{share}", highlight=False, soft_wrap=True)
