"""Write every table (in every format, with its SQL), every figure (PNG and PDF) and one
self-contained `index.html` into a folder."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from sqlalchemy.engine import Engine

from fibctl.config import DEFAULT_SEED, get_preset
from fibctl.errors import DamagedDatabase, FibctlError, shown_path
from fibctl.reports import figures, html, render, tables
from fibctl.reports.output import holding, remove_leftovers, write_text

Job = tuple[str, Callable[[], list[Path]]]
FIGURE_FORMATS = (".png", ".pdf")
MANIFEST = ".fibctl-report"  # the names of the files the last report wrote into its folder


class Built:
    """What the jobs produced, for the HTML page: Table objects and PNG paths by name."""

    def __init__(self):
        self.tables: list[tables.Table] = []
        self.figures: dict[str, Path] = {}


def options_for(function, **options) -> dict:
    """The options `function` takes as keywords (the registries' functions differ in which)."""
    accepted = inspect.signature(function).parameters
    return {k: v for k, v in options.items() if k in accepted}


def jobs(engine: Engine, out: Path, *, seed: int = DEFAULT_SEED, matrix: str | None = None,
         only: str | None = None, dataset: str | None = None, built: Built | None = None, **chosen) -> list[Job]:
    """One job per registered table and figure; each returns the files it wrote. `chosen`:
    options given for those that take them (window, all_runs); the others keep their defaults."""
    built = built or Built()
    preset = get_preset(figures.preset_in_use(engine)).model
    # coverage draws the shape of the preset most runs use; the other figures read the database
    shared = dict(seed=seed, matrix=matrix, only=only, dataset=dataset, n_layers=preset.n_layers, seq_len=preset.seq_len,
                  **chosen)

    def table_job(name: str, build):
        def job() -> list[Path]:
            table = build(engine, **options_for(build, **shared))
            built.tables.append(table)
            out.mkdir(parents=True, exist_ok=True)  # here, not before: a report with no data creates nothing
            paths = [out / f"{name}.sql"]
            write_text(paths[0], table.sql + "\n")
            for fmt, ext in render.EXTENSIONS.items():
                paths.append(out / f"{name}.{ext}")
                write_text(paths[-1], render.render(table, fmt))
            return paths
        return job

    def figure_job(name: str, draw):
        def job() -> list[Path]:
            if name == "coverage":  # drawn from the schedule, not the database
                paths = [draw(out / f"{name}{s}", **options_for(draw, **shared)) for s in FIGURE_FORMATS]
            else:
                paths = [draw(engine, out / f"{name}{s}", **options_for(draw, **shared)) for s in FIGURE_FORMATS]
            built.figures[name] = paths[0]
            return paths
        return job

    # coverage last: write_all leaves it out when no job before it found data
    return ([(name, table_job(name, build)) for name, build in tables.TABLES.items()]
            + sorted([(name, figure_job(name, draw)) for name, draw in figures.FIGURES.items()],
                     key=lambda named: named[0] == "coverage"))


def made_from(db: str) -> str:
    """What a report was made from: its database as given (a password masked) and the fibctl
    that read it. No date: the same database and code give the same bytes."""
    import fibctl
    from fibctl.db.engine import shown
    from fibctl.provenance import git_commit

    commit = git_commit()
    return f"from {shown(db)} by fibctl {fibctl.__version__}" + (f" (git {commit})" if commit else "")


def write_all(engine: Engine, out: Path, *, track: Callable[[list[Job]], Iterable[Job]] = iter,
              title: str = "fibctl report", source: str = "",
              **kwargs) -> tuple[list[Path], list[tuple[str, str]]]:
    """Run every job, then write index.html (`source` under its title: `made_from`); a table
    or figure whose data is missing is skipped with the reason (listed on the page too).
    Coverage, drawn from the schedule alone, comes last and is left out too when nothing else
    had data: no report is written then."""
    made = _first_missing(out)
    with _only_writer(out, made):
        return _write_all(engine, out, made, track=track, title=title, source=source, **kwargs)


def _write_all(engine: Engine, out: Path, made: Path | None, *, track: Callable[[list[Job]], Iterable[Job]],
               title: str, source: str, **kwargs) -> tuple[list[Path], list[tuple[str, str]]]:
    """write_all's work, in `out` (made, from `made`, its first missing folder), held locked."""
    listed = _listed(out)
    # before anything is drawn: a file of the user's named like one the report writes would be
    # replaced by it (report files are renamed onto their paths), and it is not the report's to replace
    theirs = [p.name for p in outputs(out) if (p.is_symlink() or p.exists()) and p.name not in listed]
    if theirs:
        why = f"its {MANIFEST} does not list them" if (out / MANIFEST).is_file() else f"it has no {MANIFEST}"
        raise FibctlError(f"{shown_path(out)} holds {', '.join(theirs[:3])}{' ...' if len(theirs) > 3 else ''}, not "
                          f"written by a fibctl report ({why}), which the report would replace: "
                          "move them or choose another --out; nothing was written")
    built, before = Built(), listed
    written, skipped = [], []
    remove_leftovers([*outputs(out), out / MANIFEST])  # of an earlier report killed mid-write
    try:
        for name, job in track(jobs(engine, out, built=built, **kwargs)):
            if name == "coverage" and not written:  # the last job; alone it reports nothing
                break
            # listed before they are written: a report killed midway leaves its files claimed, and
            # the next one replaces them rather than refusing them as the user's
            listed = _claim(out, listed, [p.name for p in outputs(out) if p.stem == name])
            try:
                written += job()
            except DamagedDatabase:  # no table can be read: the whole report stops
                raise
            except FibctlError as e:
                skipped.append((name, str(e)))
        # the page's run list is read here, among the jobs: a read failing there is one of theirs
        runs = html.runs_html(engine, tables.pick_runs(engine, kwargs.get("matrix"), kwargs.get("only"))) \
            if written else ""
    except KeyboardInterrupt as e:  # what is written stays (listed: the next report replaces it)
        if not written:
            _unclaim(out, before, made)
        e.written = list(written)  # for the caller's line on what is kept
        raise
    except BaseException:
        # a database failing midway (a damaged page): a folder this call made would hold part of a
        # report, which nobody asked for; one that was there keeps its claimed files for the next
        if made is not None:
            for path in outputs(out):
                if path.name in listed:
                    path.unlink(missing_ok=True)
            _unclaim(out, [], made)
        elif not written:
            _unclaim(out, before, made)
        raise
    if written:
        index = out / "index.html"
        listed = _claim(out, listed, [index.name])
        write_text(index, html.page(title, built.tables, built.figures, runs, skipped, source=source))
        written.append(index)
        # an earlier report's files, beside this one: only those it listed, never a user's file
        # of the same name (--out ~ holding its own table1.csv)
        for stale in set(outputs(out)) - set(written):
            if stale.name in listed and (stale.is_symlink() or stale.is_file()):
                stale.unlink()
        write_text(out / MANIFEST, "".join(f"{p.name}\n" for p in written))
    else:
        _unclaim(out, before, made)
    return written, skipped


@contextmanager
def _only_writer(out: Path, made: Path | None) -> Iterator[None]:
    """`out` made (from `made`, its first missing folder) and held locked while one report is
    written into it. A second report into it is refused at once: it had removed the first
    one's files as stale (its posloss.png, say), and that one then failed and, cleaning up,
    removed both reports'. So is a report into a folder where `fibctl figure` is writing."""
    with ExitStack() as held:
        try:
            out.mkdir(parents=True, exist_ok=True)
            held.enter_context(holding(out, exclusive=True, busy=(
                f"{shown_path(out)}: another `fibctl report all`, or a `fibctl figure`, is writing there "
                "now; wait for it to finish, or choose another --out")))
        except OSError:
            _remove_made(out, made)
            raise
        yield


def _claim(out: Path, listed: list[str], names: list[str]) -> list[str]:
    """`listed` with `names` added, written to the folder's manifest if that adds any."""
    new = [n for n in names if n not in listed]
    if new:
        listed = [n for n in listed if n] + new
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / MANIFEST, "".join(f"{n}\n" for n in listed))
    return listed


def _unclaim(out: Path, before: list[str], made: Path | None) -> None:
    """Put the manifest back as it was (no report was written), and remove the folders `_claim`
    made (`made`: the first of them), which then hold nothing."""
    if before:
        write_text(out / MANIFEST, "\n".join(before))
        return
    (out / MANIFEST).unlink(missing_ok=True)
    _remove_made(out, made)


def _remove_made(out: Path, made: Path | None) -> None:
    """Remove the folders from `out` up to `made` (the first one this report made), while empty."""
    if made is not None:
        for folder in [out, *out.parents]:
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
            if folder == made:
                break


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None: it exists)."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _listed(out: Path) -> list[str]:
    """The names of the files the folder's last report wrote (none in a folder of no report)."""
    return (out / MANIFEST).read_text(errors="replace").split("\n") if (out / MANIFEST).is_file() else []


def outputs(out: Path) -> list[Path]:
    """Every file a report may write into `out`, by name."""
    tabled = [out / f"{name}.{ext}" for name in tables.TABLES for ext in ("sql", *render.EXTENSIONS.values())]
    return tabled + [out / f"{name}{s}" for name in figures.FIGURES for s in FIGURE_FORMATS] + [out / "index.html"]
