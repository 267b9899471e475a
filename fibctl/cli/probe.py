"""`fibctl probe`: queue the mechanism probe's runs (Table 2) for `fibctl worker` to train."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from fibctl.cli import app
from fibctl.cli.common import DEFAULT_DB, DbOption, say_queued
from fibctl.db import engine as db_engine


@app.command("probe")
def probe_cmd(
    db: DbOption = DEFAULT_DB,
    depth: Annotated[Optional[list[int]], typer.Option(
        "--depth", help="Layers of a probe model (repeatable; default 2, 4 and 8).")] = None,
    init: Annotated[Optional[list[str]], typer.Option(
        "--init", help="Starting alphas: uniform (1 in every layer) or staggered (the ramp, clamped to "
        "[0.55, 1.45]); repeatable, default both.")] = None,
    seed: Annotated[Optional[list[int]], typer.Option(
        "--seed", help="Seeds (repeatable; default 0 and 1): each seeds the weights and the batches.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Training steps (default 2,500).")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Depth 2, both inits, seed 0, 200 steps: a short check of the whole pipeline "
        "(its timing: docs/benchmarks.md), not the study's numbers.")] = False,
    distance: Annotated[Optional[list[int]], typer.Option(
        "--distance", help="Distances the markers choose between (repeatable; default 200 and 350).")] = None,
    length: Annotated[Optional[int], typer.Option("--length", help="Sequence length (default 512; at most 65,536).")] = None,
    vocab: Annotated[Optional[int], typer.Option(
        "--vocab", help="Vocabulary (default 512; at most 65,536); each distance's marker takes an equal share.")] = None,
    eval_sequences: Annotated[Optional[int], typer.Option(
        "--eval-sequences", help="Held-out sequences scored at the end (default 16; the study scored 2).")] = None,
) -> None:
    """Queue the mechanism probe (Table 2): does gradient descent move a layer's learned alpha
    when the task rewards particular distances?

    Each depth x init x seed is one run in matrix
    `probe`; `fibctl worker` trains them (no --data needed: the task makes its own), and
    `fibctl report table2` and `fibctl figure alphas` read the results. Idempotent: runs
    already queued with the same config are skipped.

    Example: fibctl probe --quick --db probe.db"""
    from fibctl import queue
    from fibctl.probe.cells import DEPTHS, QUICK_STEPS, SEEDS, probe_runs

    if quick:
        # a given --steps stands, 0 included (refused below, not replaced by the default)
        depth, seed, steps = depth or [2], seed or [0], QUICK_STEPS if steps is None else steps
    configs = probe_runs(tuple(depth or DEPTHS), tuple(init or ("uniform", "staggered")), tuple(seed or SEEDS),
                         steps, tuple(distance) if distance else None, length, vocab, eval_sequences)
    added, present = queue.add_runs(db_engine.connect(db), configs)
    say_queued(queue.added_line(added, present, 'probe run'), db)
