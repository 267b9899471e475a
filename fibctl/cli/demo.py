"""`fibctl demo`: the whole study in miniature, offline, on a CPU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fibctl.cli import app
from fibctl.cli.common import console
from fibctl.cli.data import token_progress
from fibctl.cli.train import RunDisplay


@app.command("demo")
def demo_cmd(
    out: Annotated[Path, typer.Option("--out", help="Folder for the data, checkpoints, database and figures.")]
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
    """
    # torch, pandas and matplotlib load here, not when the command line starts
    from fibctl.data.prepare import prepare
    from fibctl.data.recipe import load_recipe
    from fibctl.db.engine import connect
    from fibctl.flows import demo
    from fibctl.flows.evaluation import evaluate
    from fibctl.flows.worker import WorkerOptions, work
    from fibctl.reports import export, render, tables

    started = time.perf_counter()
    p = demo.plan(quick)
    demo.check_out_dir(out)
    data_dir, db = out / "data", str(out / "results.db")

    console.rule(f"1/5 data: recipe {p.recipe!r} (documentation installed on this machine)")
    with token_progress(plain) as progress:
        prepared = prepare(load_recipe(p.recipe), data_dir, progress)
    console.print(f"data ready in {data_dir} ({'reused' if prepared.reused else 'built'})", highlight=False)

    console.rule(f"2/5 queue: matrix 'demo' at preset {p.preset!r}")
    engine = connect(db)
    added, present = demo.queue_demo(engine, p)
    console.print(f"queued {len(added)} new run(s); {len(present)} already in {db}", highlight=False)

    console.rule("3/5 train: one worker, runs one after the other")
    threads, timings = demo.fastest_threads(p.preset)
    console.print("measured ms per training step: " + ", ".join(f"{n} thread(s) {ms:.0f}" for n, ms in timings.items())
                  + f"; training with {threads}", highlight=False)
    opts = WorkerOptions(data_dir=data_dir, runs_dir=out / "runs", threads=threads,
                         heartbeat_timeout_s=demo.HEARTBEAT_TIMEOUT_S)
    outcomes = work(engine, opts, RunDisplay(plain))
    if any(o.status != "done" for o in outcomes):
        console.print("[yellow]training stopped before every run finished; run the same command again to "
                      "resume from the checkpoints[/]")
        raise typer.Exit(1)

    console.rule(f"4/5 evaluate at lengths {', '.join(map(str, p.lengths))} (x1, x2, x4, x8), by position")
    names = demo.runs_to_evaluate(engine, p)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=plain) as progress:
        task = progress.add_task("evaluating", total=None)

        def advance(row: dict, total: int) -> None:
            progress.update(task, advance=1, total=total,
                            description=f"{row['run']} @ {row['eval_length']}: ppl {row['ppl']:.2f}")
        if names:
            evaluate(engine, names, p.lengths, data_dir=data_dir, positions=True, on_result=advance)
    console.print(f"evaluated {len(names)} run(s); the others were already evaluated", highlight=False)

    console.rule("5/5 report")
    for table in (tables.table1(engine, matrix="demo", dense=True), tables.table3(engine, matrix="demo", all_runs=True),
                  tables.table4(engine, matrix="demo")):
        # as wide as the terminal (COLUMNS, else 80 in a log file), no number cut: columns
        # that do not fit go to a second table below
        console.print(render.fitted(table, console.width), highlight=False)
    written, skipped = export.write_all(engine, out / "report", matrix="demo")
    console.print(f"wrote {len(written)} tables and figures to {out / 'report'}/ "
                  f"(skipped: {', '.join(n for n, _ in skipped) or 'none'}); database: {db}", highlight=False)

    if quick:
        console.print("--quick: too little training for the length effect; run `fibctl demo` for the real thing.")
    else:
        dataset = tables.default_dataset(engine)
        for line in demo.describe(demo.headline(engine, dataset, p.train_length)):
            console.print(line, highlight=False)
    console.print(f"[bold]total time: {demo.fmt_seconds(time.perf_counter() - started)}[/]")
