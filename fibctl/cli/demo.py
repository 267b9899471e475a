"""`fibctl demo`: the whole study in miniature, offline, on a CPU. The pipeline is
`fibctl.flows.demo.run_demo`; this module draws it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fibctl.cli import OUTPUT_CLOSED, app, stopped_by_closed_output
from fibctl.cli.common import console, err_console, folder_value, raised_as_the_signal, stop_if_interrupted
from fibctl.cli.data import token_progress
from fibctl.cli.train import EvalProgress, RunDisplay


class RichView:
    """The demo on a terminal (or, with --plain, as log lines)."""

    def __init__(self, plain: bool):
        self.plain = plain

    def section(self, title: str) -> None:
        console.rule(title)

    def line(self, text: str) -> None:  # folded at a terminal; one line in a log file (no trailing spaces)
        console.print(text, highlight=False, markup=False, soft_wrap=not console.is_terminal)

    def warn(self, text: str) -> None:  # one line, also in a log file
        err_console.print(text, highlight=False, markup=False, soft_wrap=True)

    def table(self, table) -> None:
        from fibctl.reports import render

        # as wide as the terminal (COLUMNS, else 80 in a log file), no number cut: columns
        # that do not fit go to a second table below
        console.print(render.fitted(table, console.width), highlight=False)

    def data_progress(self):
        return token_progress(self.plain)

    def run_display(self, stop):
        return RunDisplay(self.plain, stop=stop)

    def eval_progress(self):
        return EvalProgress(self.plain)


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option("--out", metavar="<path>", parser=folder_value("--out", "the folder for the demo"),
                                      help="Folder for the data, checkpoints, database and figures.")]
    = Path("fibctl-demo"),
    quick: Annotated[bool, typer.Option(
        "--quick", help="A tiny budget: every step of the pipeline in seconds rather than minutes, with too "
        "little training to show the length effect (what the tests run).")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Log lines instead of progress bars.")] = False,
) -> None:
    """Prepare offline data, train dense and sparse models, evaluate them far past their training
    length, and print the study's tables: the paper's headline, reproduced in miniature.

    Runs one after the other in one worker, with 1 thread or every core, whichever a short
    measurement finds faster. Running it again resumes: finished runs are skipped and an
    interrupted one continues from its checkpoint.

    Example: fibctl demo --quick --out demo-quick"""
    from fibctl.flows.demo import run_demo  # torch, pandas and matplotlib load here

    try:
        # Ctrl-C and SIGTERM as every command takes them (fibctl.cli): noted, so that one lost
        # where it landed still stops the demo at its next step, with this line
        with raised_as_the_signal():
            code = run_demo(out, quick, RichView(plain), stop_if_interrupted)
    except KeyboardInterrupt:
        err_console.print("interrupted; run the same command again to resume", markup=False, highlight=False)
        raise typer.Exit(130) from None
    except OUTPUT_CLOSED:  # `fibctl demo | head`, outside training (there the run display stops it)
        raise stopped_by_closed_output("the output's reader has gone: stopped; run the same command again "
                                       "to resume") from None
    if code:
        raise typer.Exit(code)
