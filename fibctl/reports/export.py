"""Write every table (in every format, with its SQL), every figure (PNG and PDF) and one
self-contained `index.html` into a folder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from sqlalchemy.engine import Engine

from fibctl.config import get_preset
from fibctl.errors import FibctlError
from fibctl.reports import figures, html, render, tables

Job = tuple[str, Callable[[], list[Path]]]
FIGURE_FORMATS = (".png", ".pdf")


class Built:
    """What the jobs produced, for the HTML page: Table objects and PNG paths by name."""

    def __init__(self):
        self.tables: list[tables.Table] = []
        self.figures: dict[str, Path] = {}


def jobs(engine: Engine, out: Path, *, seed: int = 42, matrix: str | None = None,
         dataset: str | None = None, built: Built | None = None) -> list[Job]:
    """One job per table and figure; each returns the files it wrote."""
    built = built or Built()

    def table_job(name: str, **kwargs):
        def job() -> list[Path]:
            table = tables.TABLES[name](engine, **kwargs)
            built.tables.append(table)
            paths = [out / f"{name}.sql"]
            paths[0].write_text(table.sql + "\n")
            for fmt, ext in render.EXTENSIONS.items():
                paths.append(out / f"{name}.{ext}")
                paths[-1].write_text(render.render(table, fmt))
            return paths
        return job

    def figure_job(name: str, draw: Callable[[Path], Path]):
        def job() -> list[Path]:
            paths = [draw(out / f"{name}{suffix}") for suffix in FIGURE_FORMATS]
            built.figures[name] = paths[0]
            return paths
        return job

    def drawn(name: str, **kwargs) -> Callable[[Path], Path]:
        return lambda path: figures.FIGURES[name](engine, path, **kwargs)

    preset = get_preset(figures.preset_in_use(engine)).model
    shown = dict(seed=seed, matrix=matrix)
    return [
        ("table1", table_job("table1", **shown)),
        ("table2", table_job("table2")),
        ("table3", table_job("table3", dataset=dataset, **shown)),
        ("table4", table_job("table4", dataset=dataset, **shown)),
        ("table5", table_job("table5", dataset=dataset, matrix=matrix)),
        ("extrapolation", figure_job("extrapolation", drawn("extrapolation", dataset=dataset, **shown))),
        ("posloss", figure_job("posloss", drawn("posloss", dataset=dataset, **shown))),
        ("curves", figure_job("curves", drawn("curves", dataset=dataset, **shown))),
        ("alphas", figure_job("alphas", drawn("alphas", matrix=matrix))),
        ("coverage", figure_job("coverage", lambda path: figures.coverage(
            path, n_layers=preset.n_layers, seq_len=preset.seq_len))),
    ]


def write_all(engine: Engine, out: Path, *, track: Callable[[list[Job]], Iterable[Job]] = iter,
              title: str = "fibctl report", **kwargs) -> tuple[list[Path], list[tuple[str, str]]]:
    """Run every job, then write index.html; a table or figure whose data is missing is
    skipped with the reason (listed on the page too)."""
    out.mkdir(parents=True, exist_ok=True)
    built = Built()
    written, skipped = [], []
    for name, job in track(jobs(engine, out, built=built, **kwargs)):
        try:
            written += job()
        except FibctlError as e:
            skipped.append((name, str(e)))
    if written:
        index = out / "index.html"
        index.write_text(html.page(title, built.tables, built.figures, html.runs_html(engine), skipped))
        written.append(index)
    return written, skipped
