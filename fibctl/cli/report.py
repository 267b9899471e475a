"""`fibctl report`, `fibctl figure`, `fibctl sql`, `fibctl import-study`: results out of the database."""

from __future__ import annotations

import inspect
import numbers
import signal
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from itertools import chain
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.cells import cell_len
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable
from rich.text import Text

from fibctl.cli import app
from fibctl.cli.common import (DEFAULT_DB, DbOption, console, err_console, hold_interrupts, interrupted, plain,
                               raised_as_the_signal, seed_value, sqlite_int, stop_if_interrupted, typed)
from fibctl.config import DEFAULT_SEED, get_preset
from fibctl.db.engine import connect, shown
from fibctl.errors import DamagedDatabase, FibctlError, printable, shown_path, unknown
from fibctl.paths import expanded
from fibctl.reports import export, figures, render, tables  # matplotlib loads when a figure is drawn
from fibctl.db.importer import check_inputs, import_study as run_import
from fibctl.db.whole import created_whole
from fibctl.reports.sql import (MAX_ROWS, NAMED, TABLE_MAX_CHARACTERS, TABLE_MAX_VALUES, TIMEOUT_S,
                                 open_for_reports, query_rows)
from fibctl.reports.sql import cell as sql_cell

report_app = typer.Typer(
    help="The study's tables (docs/method.md), computed by SQL from the results database.",
    no_args_is_help=True)
app.add_typer(report_app, name="report")

FormatOption = Annotated[str, typer.Option(
    "--format", "-f", help="rich (terminal table), md, latex (booktabs), csv or json.")]
ShowSqlOption = Annotated[bool, typer.Option(
    "--show-sql", help="Print the SQL behind the table first (runnable with `fibctl sql`).")]
MatrixOption = Annotated[str | None, typer.Option(
    "--matrix", help="Only runs of this matrix (e.g. paper, demo); default: every run.")]
OnlyOption = Annotated[str | None, typer.Option(
    "--only", help="Only runs whose name matches this glob (e.g. '*_lr1e-3': a sweep's runs).")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of the runs to report.", callback=seed_value)]
DatasetOption = Annotated[str | None, typer.Option(
    "--dataset", help="Held-out set; default fineweb_edu_val when present, else the first one.")]


def _output(value: str, *, folder: bool) -> Path:
    """--out checked before anything is drawn: '' would write into the current folder, and a
    file where a folder should be ("afile/x.png") failed as "File exists"."""
    if not value.strip():
        raise FibctlError("--out is empty; name the " + ("folder to write into" if folder else "image file"))
    path = Path(expanded(value))  # `--out '~/report'`, quoted: the home folder's, as --data's
    start = path if folder else path.parent
    for above in (start, *start.parents):  # the nearest that exists must be a folder
        if above.exists():
            if not above.is_dir():
                raise FibctlError(f"cannot write {'the report into ' if folder else ''}{shown_path(path)}: "
                                  f"{shown_path(above)} is not a folder")
            break
    return path


@contextmanager
def _reading() -> Iterator[None]:
    """A database that fails a read midway (a damaged page, which the engine names in one
    line): that line, also where pandas wrapped it in an OSError that read as the output
    folder's fault."""
    try:
        yield
    except Exception as e:
        for x in (e, e.__cause__, e.__context__):
            if isinstance(x, DamagedDatabase):
                raise x from None
        raise


def _show(table: tables.Table, fmt: str, show_sql: bool) -> None:
    text = render.render(table, fmt)  # checks the format before anything is printed
    if show_sql:
        typer.echo(table.sql + "\n")
    if fmt == "rich":  # no cell cut at the terminal's width: columns that do not fit continue below
        console.print(render.fitted(table, console.width), highlight=False)
    else:
        typer.echo(text, nl=False)


# Options a table function may take (by its keyword names); each `fibctl report tableN` is built
# from the table registry with the options its function accepts, defaults from its signature.
TABLE_OPTIONS = {
    "seed": SeedOption,
    "matrix": MatrixOption,
    "only": OnlyOption,
    "dataset": DatasetOption,
    "window": Annotated[int, typer.Option("--window", "-w", callback=sqlite_int, help="Window W of the runs shown.")],
    "dense": Annotated[bool, typer.Option("--dense", help="Include the dense baseline (first row).")],
    "all_runs": Annotated[bool, typer.Option(
        "--all-runs", help="Every run evaluated at several lengths, not only the paper's rows.")],
    "compare": Annotated[str | None, typer.Option(
        "--compare", help="A second database (e.g. the imported study): its values beside these, "
        "with the difference; runs matched by base, schedule, window and seed.")],
}


# Each table's line of help that shows it at work (`fibctl report tableN --help`)
TABLE_EXAMPLES = {
    "table1": "fibctl report table1 --dense --format md",
    "table2": "fibctl report table2 --db probe.db",
    "table3": "fibctl report table3 --all-runs --show-sql",
    "table4": "fibctl report table4 --window 8 --matrix demo",
    "table5": "fibctl report table5 --window 12 --format csv",
}


def _table_command(name: str, build):
    """`fibctl report NAME`: the table function's options, its docstring's first line as help."""
    accepted = [p for p in inspect.signature(build).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name in TABLE_OPTIONS]

    def command(db: str, fmt: str, show_sql: bool, **options) -> None:
        engine = open_for_reports(db, **{k: options[k] for k in NAMED if k in options})
        path = options.get("compare")
        if path is not None:
            options.update(compare=open_for_reports(path, "--compare"), compare_label=Path(path).stem)
        with _reading():
            table = build(engine, **options)
        _show(table, fmt, show_sql)

    fixed = [("db", DbOption, DEFAULT_DB), ("fmt", FormatOption, "rich"), ("show_sql", ShowSqlOption, False)]
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d, annotation=a) for n, a, d in fixed]
    params += [inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=p.default,
                                 annotation=TABLE_OPTIONS[p.name]) for p in accepted]
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__name__ = f"report_{name}"
    summary = " ".join((build.__doc__ or name).strip().split("\n\n")[0].split())
    example = f"\n\nExample: {TABLE_EXAMPLES[name]}"  # a table without one fails here, on import
    report_app.command(name, help=f"{name[:5].title()} {name[5:]}: {summary}{example}")(command)


for _name, _build in tables.TABLES.items():
    _table_command(_name, _build)


@report_app.command("all")
def report_all(
    out: Annotated[str, typer.Option("--out", "-o", metavar="<path>",
                                     help="Folder to write the tables and figures into.")],
    db: DbOption = DEFAULT_DB, seed: SeedOption = DEFAULT_SEED, matrix: MatrixOption = None,
    only: OnlyOption = None, dataset: DatasetOption = None,
    window: Annotated[Optional[int], typer.Option(
        "--window", "-w", callback=sqlite_int, help="Window W of Tables 4 and 5 and the position and coverage "
        "figures (default: the paper's, 8 for Table 4 and the figures, 12 for Table 5).")] = None,
    all_runs: TABLE_OPTIONS["all_runs"] = False,
) -> None:
    """Write every table in every format (.txt .md .tex .csv .json, and its .sql) plus every
    figure. A table or figure of an earlier report that lacks its data now is removed, so the
    folder holds one report.

    Example: fibctl report all --out report/ --all-runs"""
    from fibctl.reports import export

    out = _output(out, folder=True)
    engine = open_for_reports(db, matrix=matrix, only=only, dataset=dataset)
    chosen = {**({"window": window} if window is not None else {}), **({"all_runs": True} if all_runs else {})}
    try:
        with _reading(), ExitStack() as held:
            written, skipped = export.write_all(
                engine, out, seed=seed, matrix=matrix, only=only, dataset=dataset, **chosen, source=export.made_from(db),
                track=lambda jobs: _with_progress(_stopping_at_a_ctrl_c(jobs, held), len(jobs)))
    except KeyboardInterrupt as e:
        kept = getattr(e, "written", [])  # write_all's: the files in place when it stopped
        err_console.print(f"interrupted; the {len(kept)} files written before it are in {shown_path(out)}/ (no index.html): "
                          "run the same command again for the whole report" if kept else
                          "interrupted; nothing was written", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    except OSError as e:  # a read-only folder, a file where the folder should be, a full disk
        raise FibctlError(f"cannot write the report into {shown_path(out)}: {e.strerror or e}") from None
    if interrupted.is_set():  # held while the last files were written
        if interrupted.signal == signal.SIGINT:
            err_console.print(f"interrupted; the report was complete: its {len(written)} files are in {shown_path(out)}/",
                              markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(128 + interrupted.signal)
    for name, why in skipped:
        why = why.removeprefix(f"{name}: ")  # a table's own errors start with its name
        err_console.print(plain(f"skipped {name}:", "yellow"), plain(why), highlight=False, soft_wrap=True)
    if not written:
        raise FibctlError(f"nothing to report from {shown(db)}: every table and figure lacks its data")
    page = out / "index.html"
    console.print(f"wrote {len(written)} files to {shown_path(out)}/"
                  + (f"; all of them on one page: {shown_path(page)}" if page in written else ""),
                  highlight=False, markup=False, soft_wrap=True)


def _with_progress(jobs: Iterable[export.Job], total: int) -> Iterator[export.Job]:
    """`report all`'s jobs under a bar on stderr naming the one being written, with how many of
    `total` are done and the time so far (a pulsing bar without a count had said neither); none
    where stderr is not a terminal (piped, a log), and gone when it ends: an error stands alone."""
    progress = Progress(TextColumn("writing {task.fields[job]:<13}", markup=False), BarColumn(bar_width=20),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=err_console, transient=True,
                        disable=not err_console.is_terminal)
    with progress:
        task = progress.add_task("", total=total, job="")
        for name, job in jobs:
            progress.update(task, job=name)
            yield name, job
            progress.advance(task)


def _stopping_at_a_ctrl_c(jobs: Iterable[export.Job], held: ExitStack) -> Iterator[export.Job]:
    """`report all`'s jobs, stopped by a Ctrl-C however it landed: before the next job where its
    KeyboardInterrupt was lost (raised in a callback of the garbage collector); as a job's
    error where it made that job fail otherwise (matplotlib's PDF writer, stopped mid-write,
    fails its clean-up with AttributeError). After the last job a Ctrl-C is held (in `held`)
    until the report has written its index.html and list of files, a moment."""
    for name, job in jobs:
        stop_if_interrupted()
        yield name, _failed_as_interrupted(job)
    stop_if_interrupted()
    held.callback(hold_interrupts())


def _failed_as_interrupted(job):
    def run():
        with raised_as_the_signal():
            return job()
    return run


@app.command("figure")
def figure(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help=f"One of {', '.join(figures.FIGURES)}.", show_default=False)],
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar="<path>", help="Image file, PNG, PDF or SVG by extension; default NAME.png.")] = None,
    db: DbOption = DEFAULT_DB, dataset: DatasetOption = None, seed: SeedOption = DEFAULT_SEED,
    matrix: MatrixOption = None, only: OnlyOption = None,
    window: Annotated[int, typer.Option("--window", "-w", callback=sqlite_int, help="posloss, coverage: window W.")] = 8,
    run: Annotated[str | None, typer.Option("--run", help="alphas: only this run.")] = None,
    schedule: Annotated[list[str] | None, typer.Option(
        "--schedule", help="coverage: schedules to draw side by side (repeat); default fixed and stagger.")] = None,
    base: Annotated[str, typer.Option("--base", help="coverage: base sequence, fib or pow2.")] = "fib",
    preset: Annotated[str, typer.Option(
        "--preset", help="coverage: take layers and length from this preset.")] = "paper",
    layers: Annotated[int | None, typer.Option("--layers", help="coverage: number of layers (overrides the preset).")] = None,
    length: Annotated[int | None, typer.Option("--length", help="coverage: sequence length T (overrides the preset).")] = None,
    no_title: Annotated[bool, typer.Option(
        "--no-title", help="No title above the panels, for a paper whose caption says it.")] = False,
) -> None:
    """Draw one of the study's figures from the database.

    Every figure reads the results database but coverage, which is drawn from the schedule itself.

    Example: fibctl figure extrapolation --out extrap.pdf"""
    if name not in figures.FIGURES:
        raise FibctlError(unknown("figure", name, figures.FIGURES))
    _check_figure_options(ctx, name)
    path = figures.check_path(Path(f"{name}.png") if out is None else _output(out, folder=False))
    try:
        # before anything is drawn: refused at once while a report all writes the folder
        with figures.writing_into(path.parent) if path.parent.is_dir() else nullcontext(), \
                figures.untitled() if no_title else nullcontext():
            if name == "coverage":
                model = get_preset(preset).model
                bad = [f"--{option} >= {least} (got {value})" for option, value, least in
                       (("layers", layers, 1), ("length", length, 2), ("window", window, 0))
                       if value is not None and value < least]  # only what was given: unset is the preset's
                if bad:
                    raise FibctlError(f"coverage needs {' and '.join(bad)}")
                figures.coverage(path, base=base, schedules=tuple(schedule or ("fixed", "stagger")), window=window,
                                 n_layers=layers or model.n_layers, seq_len=length or model.seq_len)
            else:
                draw = figures.FIGURES[name]
                engine = open_for_reports(db, matrix=matrix, only=only, dataset=dataset, run=run)
                with _reading():
                    draw(engine, path, **export.options_for(draw, dataset=dataset, seed=seed, matrix=matrix, only=only,
                                                            window=window, run=run))
    except OSError as e:  # a read-only folder, a folder where the file should be, a full disk
        raise FibctlError(f"cannot write {shown_path(path)}: {e.strerror or e}") from None
    console.print(f"wrote {shown_path(path)}", highlight=False, markup=False)


@app.command("compare")
def compare_cmd(
    names: Annotated[list[str], typer.Argument(help="Two or more run names, as `fibctl queue ls` shows them.",
                                               show_default=False)],
    db: DbOption = DEFAULT_DB,
    every: Annotated[bool, typer.Option("--all", help="Every setting, not only those that differ.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the tables, "
                                           "for scripts.")] = False,
) -> None:
    """Runs side by side: settings, training and perplexities.

    The settings that differ (--all: every one), then how each run trained (status, step,
    tokens, time, the last logged loss and tokens/s) and its perplexity by held-out set and
    length at its final evaluation (the newest, if it has not finished).

    Example: fibctl compare fib_fixed_w8 fib_stagger_w8 dense"""
    from fibctl.cli.db import print_json
    from fibctl.db.engine import connect_readonly
    from fibctl.reports.compare import compare
    from fibctl.units import duration

    c = compare(connect_readonly(db), names, every=every)
    if json_out:
        return print_json({"runs": c.runs, "settings": c.settings, "trained": c.trained, "notes": c.notes,
                           "perplexity": [{"dataset": d, "length": n, "values": values}
                                          for (d, n), values in c.perplexity.items()]})
    import pandas as pd

    if c.settings:  # a row a setting: a long list reads down, the runs across (continued past the width)
        frame = pd.DataFrame([[k, *map(_setting, values)] for k, values in c.settings.items()],
                             columns=["setting", *c.runs])
        console.print(render.fitted(tables.Table("settings", "Settings" + ("" if every else " that differ"),
                                                 frame, ""), console.width))
    else:
        console.print("no setting differs between these runs", markup=False, highlight=False)
    # the last logged step's loss and tokens/s: columns of '-' where no run logged a step (the
    # study's imported runs), which pushed a column of them into a continued table at 80 columns
    logged = [k for k in ("loss", "tokens/s") if any(v is not None for v in c.trained[k])]
    # eval step: said below; sampler: in a note where it differs (a column would not fit 80 columns)
    shown = {k: v for k, v in c.trained.items()
             if k not in ("eval step", "sampler") and (k in logged or k not in ("loss", "tokens/s"))}
    trained = pd.DataFrame({"run": c.runs, **shown}).rename(columns={"seconds": "time"})
    console.print(render.fitted(tables.Table("training", "Training", trained, "", formats={
        "step": _count, "tokens": _count, "time": duration, "loss": tables.loss, "tokens/s": _count},
        notes=[f"{' and '.join(logged)}: the last logged step's" if logged else
               "no training step logged: no loss or tokens/s", *c.notes]), console.width))
    earlier = [f"{run}'s perplexities are of step {at:,}, before its final step {final:,}" if final is not None else
               f"{run}'s perplexities are of step {at:,} (it has not finished)"
               for run, at, final in zip(c.runs, c.trained["eval step"], c.trained["step"])
               if at is not None and at != final]
    if c.perplexity:
        # one held-out set (the demo's, a sweep's) is said once, in the title: repeated in every
        # header it wrapped some of them and pushed lengths into a continued table at 80 columns
        sets = {d for d, _ in c.perplexity}
        one = tables.dataset_label(next(iter(sets))) if len(sets) == 1 else None
        label = tables.length_label
        ppl = pd.DataFrame({"run": c.runs, **{(label(n) if one else f"{tables.dataset_label(d)} {label(n)}"): values
                                              for (d, n), values in c.perplexity.items()}})
        columns = [col for col in ppl.columns if col != "run"]
        title = (f"Perplexity on {one} by evaluation length" if one else
                 "Perplexity by held-out set and evaluation length") + " (the lowest in bold)"
        console.print(render.fitted(tables.Table(
            "perplexity", title, ppl, "", formats={col: tables.ppl for col in columns},
            best={col: "min" for col in columns}, notes=earlier), console.width))


def _setting(value) -> str:
    import json

    return "-" if value is None else value if isinstance(value, str) else json.dumps(value)


def _count(value) -> str:
    return f"{value:,.0f}"


COVERAGE_OPTIONS = ("window", "schedule", "base", "preset", "layers", "length")  # the schedule's, no database


def _check_figure_options(ctx: typer.Context, name: str) -> None:
    """Refuse an option typed for a figure that does not take it: it would be ignored. --db,
    which every command takes, is let through (a script may pass it to every figure)."""
    if name == "coverage":
        taken = COVERAGE_OPTIONS
    else:
        taken = tuple(inspect.signature(figures.FIGURES[name]).parameters)
    for param in ctx.command.params:
        if param.name not in ("name", "out", "db", "no_title") and param.name not in taken and typed(ctx, param.name):
            flag = max(param.opts, key=len)
            raise FibctlError(f"{flag} does not apply to the {name} figure")


SQL_FORMATS = ("table", "csv", "json")


@app.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help="One SQL statement, e.g. \"SELECT name, status FROM runs\".",
                                         show_default=False)],
    db: DbOption = DEFAULT_DB,
    fmt: Annotated[str | None, typer.Option(
        "--format", "-f", help="table (default; control characters shown escaped, e.g. \\x1b), csv (NULL as an "
        "empty field) or json (NULL as null): these two keep numbers and text exact (a blob is written as "
        "x'HEX', a float json cannot hold as its name, e.g. \"inf\").", show_default=False)] = None,
    csv: Annotated[bool, typer.Option("--csv", help="The same as --format csv.")] = False,
    json: Annotated[bool, typer.Option("--json", help="The same as --format json.")] = False,
    max_rows: Annotated[int, typer.Option("--max-rows", help="Print at most this many rows.")] = MAX_ROWS,
    timeout: Annotated[float, typer.Option("--timeout", help="Stop the statement, and any wait for another "
                                           "process's lock, after this many seconds.")] = TIMEOUT_S,
) -> None:
    """Run a read-only SQL query on the results database.

    Writes, ATTACH, VACUUM and PRAGMA settings are refused; rows and time are bounded. Values
    are printed as the database returns them: NULL as NULL, integers as integers.

    Example: fibctl sql "SELECT name, status FROM runs" --format csv"""
    from fibctl.reports.sql import csv_lines, json_lines

    if fmt is not None and fmt not in SQL_FORMATS:
        raise FibctlError(f"--format {fmt!r}: allowed: {', '.join(SQL_FORMATS)}")
    if csv + json + (fmt is not None) > 1:  # even --format table --csv: which one was meant?
        raise FibctlError("give one output format: --format table|csv|json (--csv and --json are its older names)")
    fmt = "csv" if csv else "json" if json else fmt or "table"
    try:
        result = query_rows(db, query, max_rows=max_rows, timeout_s=timeout)
    except KeyboardInterrupt:
        err_console.print("interrupted: the statement was stopped; nothing was written", markup=False, highlight=False)
        raise typer.Exit(130) from None
    if fmt == "csv":
        _write(csv_lines(result))
    elif fmt == "json":
        _write(chain(json_lines(result), ["\n"]))
    elif result.empty:
        console.print("(no rows)")
    else:
        # rich narrows columns that do not fit to nothing (`SELECT * FROM runs` at 80 columns drew
        # empty cells), or folds a value mid-word (`docs_va` over `l`): side by side only where
        # each column holds its longest word (header or value) whole, else a field a line
        headers = [Text(printable(column, lines=True)) for column in result.columns]
        cells = _table_cells(result)
        least = [max([1, *(cell_len(w) for t in (h, *(row[i] for row in cells)) for w in t.plain.split())])
                 for i, h in enumerate(headers)]
        if sum(least) + 3 * len(least) + 1 <= console.width:
            table = RichTable()
            for header, width, numeric in zip(headers, least, _numeric_columns(result.rows, len(headers))):
                table.add_column(header, overflow="fold", min_width=width, justify="right" if numeric else "left")
            for row in cells:
                table.add_row(*row)
        else:
            table = RichTable("column", "value")
            for i, row in enumerate(cells):
                if i:
                    table.add_section()  # a rule between rows
                for column, value in zip(result.columns, row):
                    table.add_row(Text(printable(column, lines=True)), value)
            table.columns[1].overflow = "fold"
        console.print(table)
    if result.truncated:
        first = f"the first {max_rows:,} rows" if max_rows > 1 else "the first row"
        err_console.print(f"note: only {first}; raise --max-rows for more",
                          markup=False, highlight=False)


def _numeric_columns(rows: list[tuple], width: int) -> list[bool]:
    """Which columns hold numbers and NULLs alone (at least one number): right-aligned, as in
    every other table fibctl prints, so that their digits line up."""
    def number(v) -> bool:
        return isinstance(v, numbers.Number) and not isinstance(v, bool)

    return [any(number(row[i]) for row in rows) and all(v is None or number(v) for v in (row[i] for row in rows))
            for i in range(width)]


def _table_cells(result) -> list[list[Text]]:
    """The table's cells, as Text: a value from the database is never read as markup, nor
    obeyed as a control code. Refused, before anything is printed, past TABLE_MAX_VALUES
    values or TABLE_MAX_CHARACTERS characters: rich draws a table whole, some 10,000 values
    or 300,000 characters a second, in memory that grows with them (30,000 rows of 8 columns
    took 30 s and 645 MB, 100,000 of 80 minutes and 4.7 GB); csv and json write any size."""
    cells: list[list[Text]] = []
    characters = 0
    for row in result.rows:
        texts = [Text("NULL" if v is None else printable(str(sql_cell(v)), lines=True)) for v in row]
        characters += sum(len(t.plain) for t in texts)
        if (len(cells) + 1) * len(texts) > TABLE_MAX_VALUES or characters > TABLE_MAX_CHARACTERS:
            fewer = f"--max-rows {len(cells)}" if cells else "select part of each value (substr)"
            raise FibctlError(f"the result ({len(result.rows):,} rows of {len(texts)} columns) is more than the "
                              f"table format draws ({TABLE_MAX_VALUES:,} values or {TABLE_MAX_CHARACTERS:,} "
                              f"characters); use --format csv or --format json, or {fewer}")
        cells.append(texts)
    return cells


def _write(parts: Iterable[str]) -> None:
    """`parts` on stdout as they are made, some 64 KiB at a time (click.echo flushes each)."""
    pending: list[str] = []
    size = 0
    for part in parts:
        pending.append(part)
        size += len(part)
        if size >= 1 << 16:
            # color=True: click would strip what looks like a colour code from a value in a pipe
            typer.echo("".join(pending), nl=False, color=True)
            pending, size = [], 0
    typer.echo("".join(pending), nl=False, color=True)


@app.command("import-study")
def import_study(
    fib_db: Annotated[str, typer.Argument(help="The study's SQLite database (fib.db).", show_default=False)],
    lenextrap: Annotated[str | None, typer.Option(
        "--lenextrap", metavar="<path>", help="The study's lenextrap.json: perplexity at 1024/2048/4096.")] = None,
    posloss: Annotated[str | None, typer.Option(
        "--posloss", metavar="<path>", help="The study's posloss.json: loss at each position of a 1024 window.")]
    = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Load the published study into the database (matrix 'paper'); importing twice changes nothing.

    Example: fibctl import-study fib.db --posloss posloss.json --db study.db"""
    fib_db, lenextrap, posloss = (None if p is None else expanded(p) for p in (fib_db, lenextrap, posloss))
    check_inputs(fib_db, lenextrap, posloss)  # as typed ('' is not the current folder), before `connect`
    fib_db, lenextrap, posloss = (None if p is None else Path(p) for p in (fib_db, lenextrap, posloss))
    with created_whole(db) as into:  # a new SQLite file appears only whole
        engine = connect(into)
        try:
            with console.status(escape(f"Importing {fib_db} into {shown(db)}")):
                s = run_import(engine, fib_db, lenextrap=lenextrap, posloss=posloss)
        finally:
            engine.dispose()
    # what this import wrote or changed: importing the same files again counts nothing
    counts = (s.runs, s.probe_runs, s.evaluations, s.aux_metrics, s.position_losses)
    if any(counts):
        console.print(f"imported {s.runs:,} runs, {s.probe_runs:,} probe models, {s.evaluations:,} evaluations, "
                      f"{s.aux_metrics:,} auxiliary metrics, {s.position_losses:,} per-position losses into "
                      f"{shown(db)} (new or changed rows)", highlight=False, markup=False)
    else:
        console.print(f"nothing to import: {shown(db)} already holds every row of these files unchanged",
                      highlight=False, markup=False)
    if s.skipped:  # names as fib.db has them: free text, whose control codes are shown, not obeyed
        console.print(plain(f"not part of the study's matrix, skipped: {', '.join(s.skipped)}"))
    if s.unmeasured:  # Table 1 reads fib.db's final perplexities: these runs have no row there
        console.print(plain(f"no perplexity in {fib_db.name} (every metrics row empty): {', '.join(s.unmeasured)}"),
                      highlight=False)
    if s.unfinished:  # its evaluations in the JSON dumps, if any, are still imported
        console.print(plain(f"no 'done' attempt in {fib_db.name}, its metrics skipped: {', '.join(s.unfinished)}"),
                      highlight=False)
