"""`fibctl db`, `fibctl matrix` and `fibctl queue`: the database, run matrices, the queue."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from fibctl import queue
from fibctl.cli import app
from fibctl.config import PRESETS
from fibctl.cli.common import (DEFAULT_DB, DbOption, confirmed, console, err_console, fitted_table, fitted_view,
                               goes_with, hold_interrupts, interactive, interrupted, model_line, plain,
                               runs_dir_value, say_queued, split_label, step_of, stop_if_interrupted, unbroken)
from fibctl.db import engine as db_engine, schema
from fibctl.db.store import utcnow
from fibctl.units import duration
from fibctl.errors import FibctlError, shown_path
from fibctl.reports.tables import loss as loss_label
from fibctl.matrix import load_matrix, parse_settings, shipped_matrices
from fibctl.names import check_name

db_app = typer.Typer(help="The results database: schema revision, upgrades, copies.", no_args_is_help=True)
matrix_app = typer.Typer(help="Run matrices: the shipped ones (paper, demo) or your own TOML file.",
                         no_args_is_help=True)
queue_app = typer.Typer(help="The run queue: add a matrix; list runs or show one; cancel, retry and remove runs.",
                        no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(matrix_app, name="matrix")
app.add_typer(queue_app, name="queue")

MatrixArg = Annotated[str, typer.Argument(help="A shipped matrix name (see `fibctl matrix list`) or a .toml path.")]
JsonOption = Annotated[bool, typer.Option(
    "--json", help="Print one JSON object instead of the table (times in UTC, ISO 8601), for scripts.")]


def print_json(value) -> None:
    """`value` as JSON on stdout, as it is (names and errors unescaped: JSON escapes what a
    terminal would obey), its times ISO 8601 and non-finite numbers null."""
    import json
    import math
    from datetime import datetime

    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, datetime):  # the database's times are UTC
            return v.isoformat() + ("Z" if v.tzinfo is None else "")
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v

    print(json.dumps(plain(value), indent=2, default=str))


PresetOption = Annotated[str | None, typer.Option(
    "--preset", help=f"Model/recipe preset for every run ({', '.join(PRESETS)}); default: the matrix's.")]
NameArg = Annotated[str, typer.Argument(help="Run name, as shown by `fibctl queue ls`.")]
SeedOption = Annotated[list[int] | None, typer.Option(
    "--seed", metavar="N",
    help="Each run at data seed N instead of its own, as a matrix file's `seed = N` (repeatable: one "
         "replicate per seed); its init seed stays the run's or the matrix's `init_seed` where set, "
         "else it is N. Named NAME_sN where N is not the run's own seed, e.g. dense_s43.")]


@db_app.command("upgrade")
def db_upgrade(db: DbOption = DEFAULT_DB) -> None:
    """Create the database if needed and bring its schema to the latest revision.

    Example: fibctl db upgrade --db results.db"""
    from fibctl.db.whole import upgraded_or_created

    # a new SQLite file appears only whole: a failed upgrade leaves none; one already at the
    # latest revision is left as it is, its journal mode included
    before, after = upgraded_or_created(db, wal_if_current=False)
    if before == after:
        console.print(f"{db_engine.shown(db)}: already at revision {after}", markup=False)
    else:
        console.print(f"{db_engine.shown(db)}: upgraded from revision {before or '(empty)'} to {after}", markup=False)


@db_app.command("copy")
def db_copy(
    source: Annotated[str, typer.Option("--from", help="The database to copy: a SQLAlchemy URL or a SQLite path.",
                                        show_default=False)],
    target: Annotated[str, typer.Option("--to", help="Where to copy it (created and migrated if needed).",
                                        show_default=False)],
) -> None:
    """Copy a whole results database into another (e.g. SQLite to PostgreSQL); again changes nothing.

    Runs are matched by name, metrics by their keys. A run never goes backwards: where the
    target has it as far along or further (done over running over failed or cancelled over
    queued), or with results the source lacks, the target's run stays as it is and only
    metrics it lacks are added; nothing in the target is deleted. The summary says how
    many runs were kept so, and why.

    Example: fibctl db copy --from results.db --to postgresql://me@host/fib"""
    from fibctl.db.copy import check_copy, copy_database, counts
    from fibctl.db.whole import created_whole

    for db, option in ((source, "--from"), (target, "--to")):  # a refusal names the option given
        db_engine.resolve_url(db, option)
    if db_engine.same_database(source, target):
        raise FibctlError(f"--from and --to are the same database ({db_engine.shown(source)}); nothing to copy")
    src = db_engine.connect_readonly(source, option="--from")
    schema.check_tables(src, db_engine.shown(source))  # read whole: a view in a table's place never ended
    with created_whole(target, option="--to") as into:  # a new SQLite file appears only whole
        dst = db_engine.connect(into, option="--to", check=check_copy(src))
        try:
            summary = copy_database(src, dst)
            theirs = counts(dst)
        finally:
            dst.dispose()
    mine = counts(src)
    written = ", ".join(f"{n:,} {t}" for t, n in summary.rows.items() if n) \
        or ("nothing" if summary.kept else "nothing (already copied)")
    console.print(f"{db_engine.shown(source)} -> {db_engine.shown(target)}: wrote {written}", markup=False)
    if summary.kept:
        why = Counter(summary.kept.values())
        console.print(f"kept {len(summary.kept):,} run(s) as the target has them: "
                      + ", ".join(f"{n:,} {reason}" for reason, n in why.items()), markup=False)
    mine["events"] -= summary.events_left  # by design: a run's events come only where it had none
    short = [t for t in mine if theirs[t] < mine[t]]
    if short:
        raise FibctlError(f"the copy holds fewer rows than the source in {', '.join(short)}")


@db_app.command("current")
def db_current(db: DbOption = DEFAULT_DB) -> None:
    """Show the database's schema revision and the latest one this fibctl knows.

    Example: fibctl db current --db results.db"""
    engine = db_engine.connect_readonly(db, current=False)
    rev, head = db_engine.current_revision(engine), db_engine.head_revision()
    engine.dispose()
    note = "up to date" if rev == head else "run `fibctl db upgrade`"
    console.print(f"{db_engine.shown(db)}: revision {rev or '(none)'}; latest {head} ({note})", markup=False)


@matrix_app.command("list")
def matrix_list() -> None:
    """List the matrices shipped with fibctl.

    Example: fibctl matrix list"""
    rows = []
    for name in shipped_matrices():
        m = load_matrix(name)
        rows.append([name, str(len(m.entries)), m.preset, m.description])
    table, _ = fitted_table(["matrix", "runs", "preset", "description"], rows, width=console.width,
                            names=("matrix",), fold=("description",), right=("runs",))
    console.print(table)


# `matrix show` previews what `queue add` with the same options would queue
SetOption = Annotated[list[str] | None, typer.Option(
    "--set", metavar="train.KEY=VALUE",
    help="Override a training setting of every run, e.g. --set train.lr=1e-3 --set "
         "train.steps=2000 (the keys of the matrix file's `train` table).")]
SuffixOption = Annotated[str, typer.Option(
    help="End every run's name with this, e.g. _lr1e-3: a sweep's runs are new runs beside "
         "the matrix's own.")]


@matrix_app.command("show")
def matrix_show(matrix: MatrixArg, preset: PresetOption = None,
                only: Annotated[str | None, typer.Option(help="Only runs whose name matches this glob.")] = None,
                set_: SetOption = None, suffix: SuffixOption = "", seed: SeedOption = None,
                ) -> None:
    """Show each run of a matrix with its resolved settings and config hash.

    With --set, --suffix and --seed it shows what `fibctl queue add` with the same
    options would queue, without a database.

    Example: fibctl matrix show demo --preset micro --set train.lr=1e-3 --suffix _lr1e-3"""
    m = load_matrix(matrix)
    configs = m.resolve(preset, only, parse_settings(set_ or []), suffix, seed or ())
    headers = ["name", "base", "schedule", "W", "seed", "preset", "layers", "T", "steps", "batch", "lr",
               "config hash"]
    rows = []
    for c in configs:
        dense = c.model.schedule == "dense"
        rows.append([c.name, "-" if dense else c.model.base, c.model.schedule, "-" if dense else str(c.model.window),
                     str(c.seed), c.preset, str(c.model.n_layers), str(c.model.seq_len), f"{c.train.steps:,}",
                     split_label(c.train.batch_size, c.train.grad_accum), f"{c.train.lr:g}", c.config_hash])
    # at a narrow terminal, settings every run shares go under the table instead of a column each
    console.print(fitted_view(headers, rows, title=f"{m.name}: {m.description}", names=("name",),
                               optional=("preset", "layers", "T", "steps", "config hash", "lr", "batch", "seed"),
                               right=("W", "seed", "layers", "T", "steps", "lr")))


@queue_app.command("add")
def queue_add(matrix: MatrixArg, db: DbOption = DEFAULT_DB, preset: PresetOption = None,
              only: Annotated[str | None, typer.Option(help="Only runs whose name matches this glob, e.g. 'f1*'.")] = None,
              set_: SetOption = None, suffix: SuffixOption = "", seed: SeedOption = None,
              ) -> None:
    """Queue a matrix's runs. Idempotent: runs already queued with the same config are skipped.

    A sweep from the command line: the example queues the demo's runs again at another
    learning rate, as dense_lr1e-3 and so on, beside the matrix's own. Replicates:
    `--seed 43 --seed 44` queues each run at those seeds too (dense_s43, dense_s44; with
    --suffix _lr1e-3, dense_s43_lr1e-3), for `fibctl report table5`.

    Example: fibctl queue add demo --set train.lr=1e-3 --suffix _lr1e-3"""
    configs = load_matrix(matrix).resolve(preset, only, parse_settings(set_ or []), suffix, seed or ())
    engine = db_engine.connect(db, check=queue.check_add(configs, seeded=bool(seed)))  # a conflict leaves it as it was
    committing: list = []
    try:
        # a Ctrl-C or SIGTERM from just before the commit is held (noted, not raised) to the
        # command's end: raised inside the commit, or just after it, it said only "interrupted"
        # (SIGTERM: nothing) of runs that were all queued
        added, present = queue.add_runs(engine, configs, seeded=bool(seed),
                                        before_commit=lambda: committing.append(hold_interrupts(terminate=True)))
    except (KeyboardInterrupt, SystemExit) as e:  # before the commit, rolled back (unless none could be held)
        terminated = isinstance(e, SystemExit)
        if terminated and not (interrupted.is_set() and interrupted.signal == signal.SIGTERM):
            raise
        err_console.print(("terminated; " if terminated else "interrupted; ")
                          + ("`fibctl queue ls` shows whether the runs were queued" if committing
                             else "nothing was queued"), markup=False, highlight=False)
        raise typer.Exit(128 + (signal.SIGTERM if terminated else signal.SIGINT)) from None
    line = queue.added_line(added, present)
    if interrupted.is_set():  # held during the commit, which was made
        stopped = "interrupted" if interrupted.signal == signal.SIGINT else "terminated"
        err_console.print(f"{stopped} after the commit: {line}", markup=False, highlight=False)
        raise typer.Exit(128 + interrupted.signal)
    if added:  # what to run next, as `fibctl probe` says it: a new user was left at the count
        say_queued(line, db)
    else:
        console.print(line)


@queue_app.command("ls")
def queue_ls(db: DbOption = DEFAULT_DB,
             status: Annotated[str | None, typer.Option(help="Only runs with this status: queued, running, done, failed, cancelled.")] = None,
             json_out: JsonOption = False,
             ) -> None:
    """List runs in queue order with their status, attempts and worker.

    Example: fibctl queue ls --status failed"""
    engine = db_engine.connect_readonly(db)  # a listing never creates, upgrades or locks the database
    runs = queue.list_runs(engine, status)
    if json_out:
        return print_json({"runs": runs, "counts": queue.status_counts(engine)})
    headers = ["id", "name", "matrix", "preset", "status", "attempts", "worker", "heartbeat", "error"]
    rows = [[str(r["id"]), r["name"], r["matrix"], r["preset"], str(r["status"]), str(r["attempts"]), r["worker"] or "",
             r["heartbeat_at"].strftime("%Y-%m-%d %H:%M:%S") if r["heartbeat_at"] else "",
             (r["error"] or "").partition("\n")[0]] for r in runs]
    console.print(fitted_view(headers, rows, fold=("error", "worker"), names=("name", "matrix"),
                               optional=("preset", "heartbeat", "worker", "matrix", "attempts"),
                               right=("id", "attempts")))
    counts = queue.status_counts(engine)
    console.print(f"{len(runs)} run(s) listed; in the database: "
                  + (", ".join(f"{n} {s}" for s, n in counts.items()) or "none"), highlight=False)
    if hint := _next_step(counts):
        console.print(plain(hint))


def _next_step(counts: dict[str, int]) -> str | None:
    """The command a user at a standstill runs next: one with no runs queues some, one whose
    runs wait with none running starts a worker (a listing of empty tables told neither)."""
    if not counts:
        return "no runs yet: queue some with `fibctl queue add MATRIX` (`fibctl matrix list`)"
    if counts.get("queued") and not counts.get("running"):
        return "nothing is running: `fibctl worker` trains the queued runs"
    return None


@app.command("status")
def status_cmd(
    ctx: typer.Context,
    db: DbOption = DEFAULT_DB,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Redraw every --every seconds until Ctrl-C (output that is not a terminal, a log "
        "file say: a new view each time, under the time it was read).")] = False,
    every: Annotated[float, typer.Option("--every", help="Seconds between redraws with --watch.")] = 5.0,
    json_out: JsonOption = False,
) -> None:
    """What is running where: each running run's host, device, step, last training loss,
    tokens/s, ETA and last heartbeat, then the queue's counts.

    Example: fibctl status --watch --every 10"""
    import time

    from rich.console import Group
    from rich.live import Live

    goes_with(ctx, "every", "--every", "--watch", watch)
    if not 0 < every <= 86_400:  # nan and inf too: time.sleep takes neither
        raise FibctlError(f"--every must be above 0 and at most a day (86400), got {every:g}")
    if json_out and watch:
        raise FibctlError("--json prints one view; leave out --watch (or run it again to read again)")
    engine = db_engine.connect_readonly(db, pooled=not watch)  # a watch holds no connection between views
    if json_out:
        return print_json({"running": queue.progress(engine), "counts": queue.status_counts(engine)})

    def view():
        now = utcnow()
        rows = [[r["name"], r["host"] or "", r["device"] or "", step_of(r["step"], r["steps"]),
                 loss_label(r["loss"]) if r["loss"] is not None else "-",
                 f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-",
                 duration(r["eta_s"]) if r["eta_s"] is not None else "-",
                 f"{duration((now - r['heartbeat_at']).total_seconds())} ago" if r["heartbeat_at"] else "-"]
                for r in queue.progress(engine)]
        headers = ["run", "host", "device", "step", "loss", "tok/s", "ETA", "heartbeat"]
        parts = []
        if rows:
            parts.append(fitted_view(headers, rows, fold=("device", "host"), names=("run",),
                                 optional=("device", "host"), right=("step", "loss", "tok/s", "ETA")))
        counts = queue.status_counts(engine)
        parts.append(plain(f"{len(rows)} running; " + ", ".join(
            f"{counts.get(s, 0)} {s}" for s in ("queued", "done", "failed", "cancelled"))))
        if hint := _next_step(counts):
            parts.append(plain(hint))
        return Group(*parts)

    if not watch:
        console.print(view())
        return
    down: list = []  # [when the database stopped answering], while it does not

    def watched():
        # a server restarting (or a file moved) mid-watch: said in the view, and waited out
        # (it ended the watch, exit code 2); at the start it is one line, exit 2, as anywhere
        try:
            shown = view()
        except Exception as e:
            if (refused := db_engine.refusal(e)) is None:
                raise
            down[:] = down or [utcnow()]
            # a Group, as a view is: printed under its time, not on the time's line
            return Group(plain(f"{refused}; since {down[0]:%H:%M:%S} UTC, trying again every {every:g} s"))
        down.clear()
        return shown

    def pause() -> None:
        # a Ctrl-C lost where it landed (a weakref's callback: Python ignores its KeyboardInterrupt)
        # is noted (fibctl.cli.common): a watch, which never ends by itself, looks before each wait
        stop_if_interrupted()
        time.sleep(every)

    # Ctrl-C, the way out of --watch, ends it as it ends every command (fibctl.cli): one line, 130
    if not console.is_terminal:  # Live would print its first view alone: a log gets each view, dated
        while True:
            console.print(plain(f"{utcnow():%Y-%m-%d %H:%M:%S} UTC"), watched(), "")
            pause()
    with Live(watched(), console=console, auto_refresh=False) as live:
        while True:
            pause()
            live.update(watched(), refresh=True)


@queue_app.command("cancel")
def queue_cancel(name: NameArg, db: DbOption = DEFAULT_DB) -> None:
    """Cancel a queued or running run (a running worker stops at its next heartbeat).

    Example: fibctl queue cancel fib_fixed_w8"""
    queue.cancel(db_engine.connect(db, must_exist=True, check=queue.check_cancel(name)), name)
    console.print(plain(f"cancelled {name}"))


@queue_app.command("retry")
def queue_retry(ctx: typer.Context,
                name: Annotated[Optional[str], typer.Argument(help="Run name, as shown by `fibctl queue ls`.")] = None,
                all_failed: Annotated[bool, typer.Option("--all-failed", help="Every failed run.")] = False,
                from_start: Annotated[bool, typer.Option(
                    "--from-start", help="Train it from step 0, deleting its rows past step 0, its auxiliary "
                                         "metrics and its tensorboard and wandb folders: a run none of whose "
                                         "checkpoints loads.")] = False,
                runs_dir: Annotated[Optional[Path], typer.Option(
                    "--runs-dir", envvar="FIBCTL_RUNS_DIR", parser=runs_dir_value, metavar="<path>",
                    help="With --from-start: the runs folder (default: the one the run last trained in, "
                         "else runs).")] = None,
                db: DbOption = DEFAULT_DB) -> None:
    """Queue a failed or cancelled run (or, with --all-failed, every failed one) again, attempts reset;
    it resumes from its newest checkpoint that loads, or with --from-start trains from step 0.

    Example: fibctl queue retry --all-failed"""
    if (name is None) == (not all_failed):
        raise FibctlError("name a run, or pass --all-failed (not both)")
    if from_start and all_failed:
        raise FibctlError("--from-start takes one run by name, not --all-failed")
    goes_with(ctx, "runs_dir", "--runs-dir", "--from-start", from_start)
    if from_start and runs_dir is not None and not runs_dir.is_dir():
        # a mistyped folder would find no checkpoint there: the rows would go, and a worker
        # given the real folder would resume from its checkpoint without them
        raise FibctlError(f"--runs-dir {shown_path(runs_dir)} is not a folder; nothing was changed")
    if from_start:
        check_name("run", name)
        # torch, only for this option: seconds to import, so not while holding the write lock
        from fibctl.flows.removal import discard_logs, settle_or_refuse
        from fibctl.train import checkpoint as ckpt

        def folders(recorded_dir: str | None) -> list[Path]:
            # --runs-dir's folder, and the one it last trained in whatever --runs-dir says: a
            # worker given that one would find the checkpoint after the rows were deleted
            return [where / name for where in dict.fromkeys([runs_dir or Path(recorded_dir or "runs"),
                                                             *([Path(recorded_dir)] if recorded_dir else [])])]

        def check(recorded_dir: str | None, checkpoint: str | None) -> None:
            for folder in folders(recorded_dir):  # the only folders a worker resumes in (checkpoint.resolve_path)
                # a killed `queue rm` hid them: back, and seen; one it cannot settle is refused,
                # else the retry would find no checkpoint and delete the rows
                settle_or_refuse(folder.parent, name, True, "nothing was changed", checkpoint)
                left = ckpt.latest_checkpoint(folder)
                if left is not None:
                    raise FibctlError(f"{shown_path(left)} is still there: `fibctl queue retry {name}` resumes from "
                                      "it (or from the newest that loads); to train from step 0 anyway, move "
                                      f"{shown_path(folder)} away first. Nothing was changed")

        logs: list[Path] = []

        def restart(recorded_dir: str | None, checkpoint: str | None) -> None:
            # in the retry's transaction: no worker claims the run while its logs go
            check(recorded_dir, checkpoint)
            for folder in folders(recorded_dir):
                logs.extend(discard_logs(folder))

    # on the database as it is, before any upgrade: a refusal leaves it as it was
    checks = None if all_failed else queue.check_retry(name, check if from_start else None)
    engine = db_engine.connect(db, must_exist=True, check=checks)
    if from_start:
        done = queue.retry_from_start(engine, name, restart)  # checked again: a worker may have moved on
        gone = ", ".join(f"{n} {t.replace('_', ' ')}" for t, n in done.discarded.items() if n)
        also = f"; also deleted its metric logs {', '.join(map(str, logs))}" if logs else ""
        console.print(plain(f"queued {name} again from step 0; deleted what it recorded past step 0: "
                            f"{gone or 'none'}{also}"), highlight=False)
    elif all_failed:
        names = queue.retry_failed(engine)
        console.print(plain(f"queued {len(names)} failed run(s) again" + (f": {', '.join(names)}" if names else "")),
                      highlight=False)
    else:
        queue.retry(engine, name)
        console.print(plain(f"queued {name} again"), highlight=False)


@queue_app.command("rm")
def queue_rm(ctx: typer.Context, name: NameArg, db: DbOption = DEFAULT_DB,
             checkpoints: Annotated[bool, typer.Option(
                 "--checkpoints", help="Also delete the run's checkpoint folder (RUNS_DIR/NAME).")] = False,
             runs_dir: Annotated[Optional[Path], typer.Option(
                 "--runs-dir", envvar="FIBCTL_RUNS_DIR", parser=runs_dir_value, metavar="<path>",
                 help="With --checkpoints: the runs folder (default: the one the run last trained in, else runs).")]
             = None,
             yes: Annotated[bool, typer.Option(
                 "--yes", "-y", help="Do not ask first (asked only where stdin is a terminal).")] = False) -> None:
    """Remove a run that is not running: its row, metrics and events (and with --checkpoints,
    its checkpoint folder inside the runs folder). A running run is refused.

    At a terminal it first says what it will delete and asks (y/N; no: nothing is removed
    nor upgraded, exit code 1); --yes does not ask, nor does a script, whose stdin is no
    terminal.

    Example: fibctl queue rm dense_lr1e-3 --checkpoints"""
    from fibctl.flows.removal import remove_run

    goes_with(ctx, "runs_dir", "--runs-dir", "--checkpoints", checkpoints)
    if checkpoints and runs_dir is not None and not runs_dir.is_dir():
        # a mistyped folder would find no checkpoints there, and leave them behind the rows
        raise FibctlError(f"--runs-dir {shown_path(runs_dir)} is not a folder; nothing was removed")

    def ask(question: str) -> None:
        if not yes and interactive():  # a person at a terminal: results are deleted for good
            if not confirmed(question):
                err_console.print(plain("nothing was removed"))
                raise typer.Exit(1)

    console.print(plain(remove_run(db, name, checkpoints, runs_dir, ask)), highlight=False)


@queue_app.command("show")
def queue_show(name: NameArg, db: DbOption = DEFAULT_DB,
               events: Annotated[int, typer.Option("--events", min=0, max=10_000,
                                                   help="How many of its newest events to list.")] = 10,
               json_out: JsonOption = False) -> None:
    """One run at a glance: its status, config, where and how long it trained, its last logged
    step, the perplexities of its last evaluation and its newest events.

    Example: fibctl queue show fib_fixed_w8 --events 20"""
    from fibctl.reports.overview import overview
    from fibctl.reports.tables import length_label

    engine = db_engine.connect_readonly(db)
    o = overview(engine, name, events=events)
    r, c = o.run, o.config
    if json_out:  # the row as stored (its config parsed), and the rest of the overview
        row = {k: v for k, v in r.items() if k != "config_json"}
        return print_json({"run": row, "config": c.to_dict() if c is not None else None,
                           "config_error": o.config_error, "last_step": o.last_step, "eval_step": o.eval_step,
                           "perplexity": {d: {str(n): p for n, p in by.items()} for d, by in o.perplexity.items()},
                           "events": o.events, "event_count": o.event_count})
    # names, paths and errors from data, never markup; a long word (a path) is never split
    say = lambda text: console.print(unbroken(text), soft_wrap=True)  # noqa: E731
    say(f"{r['name']}: {r['status']} (matrix {r['matrix']}, id {r['id']}, preset {r['preset']})")
    if c is None:
        say(o.config_error)
    else:
        m, t = c.model, c.train
        say(f"model: {model_line(m)}")
        # as docs/method.md says the recipe: tokens a step, then how a step splits them
        say(f"recipe: {t.steps:,} steps of {c.tokens_per_step:,} tokens ({split_label(t.batch_size, t.grad_accum)} "
            f"sequences of {length_label(m.seq_len)}), lr {t.lr:g}, seed {r['seed']}")
    # a run not done records its tokens at each checkpoint, not its step: they give it
    step = r["final_step"] if r["final_step"] is not None else (
        r["tokens_trained"] // c.tokens_per_step if r["tokens_trained"] is not None and c is not None else None)
    done = [None if step is None else f"step {step:,}" + (f" of {c.train.steps:,}" if c is not None else ""),
            f"{r['tokens_trained']:,} tokens" if r["tokens_trained"] else None,
            duration(r["wall_seconds"]) if r["wall_seconds"] else None,
            f"{r['attempts']} attempt(s)"]
    say("trained: " + ", ".join(d for d in done if d))
    where = [r["worker"], r["device"], r["torch_version"] and f"torch {r['torch_version']}",
             r["fibctl_version"] and f"fibctl {r['fibctl_version']}", r["git_commit"] and f"git {_short_commit(r['git_commit'])}"]
    if any(where):
        say("on: " + ", ".join(w for w in where if w))
    if r["status"] == "running" and r["heartbeat_at"]:
        say(f"heartbeat: {duration((utcnow() - r['heartbeat_at']).total_seconds())} ago")
    if r["checkpoint_path"]:
        # one path, the file eval loads (one recorded absolute stays so), to be copied whole
        say(f"checkpoint: {os.path.join(r['runs_dir'] or '', r['checkpoint_path'])}")
    if r["error"]:
        say(f"error: {r['error']}")
    if o.last_step:
        s = o.last_step
        parts = [f"loss {loss_label(s['loss'])}", f"lr {s['lr']:.2e}"]
        parts += [f"grad norm {s['grad_norm']:.3f}"] if s["grad_norm"] is not None else []
        parts += [f"{s['tokens_per_s']:,.0f} tok/s"] if s["tokens_per_s"] else []
        say(f"last logged step {s['step']:,}: " + ", ".join(parts))
    if o.perplexity:
        lengths = sorted({n for by_length in o.perplexity.values() for n in by_length})
        rows = [[dataset, *(f"{by_length[n]:.2f}" if n in by_length else "-" for n in lengths)]
                for dataset, by_length in o.perplexity.items()]
        headers = ["dataset", *map(length_label, lengths)]
        console.print(fitted_view(headers, rows, names=("dataset",), right=headers[1:],
                                  title=f"perplexity at step {o.eval_step:,}, by evaluation length:"))
    if o.events:
        rows = [[f"{e['time']:%Y-%m-%d %H:%M:%S}", e["kind"], e["message"] or ""] for e in o.events]
        say(f"events, the newest {len(o.events)} of {o.event_count}:" if o.event_count > len(o.events) else "events:")
        # a message's checkpoint path, split across a cell's lines, could not be copied: where
        # one does not fit its column, an event a few lines, the path whole (crop=False: past
        # the width, if it is wider than the terminal)
        console.print(fitted_view(["time (UTC)", "event", "message"], rows, whole=("message",)), crop=False)


def _short_commit(commit: str) -> str:
    """A commit as git shows it short: 12 hex digits, and "+dirty" if the tree had changes."""
    sha, plus, rest = commit.partition("+")
    return sha[:12] + plus + rest
