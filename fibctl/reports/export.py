"""Write every table (in every format, with its SQL) and every figure into a folder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from sqlalchemy.engine import Engine

from fibctl.config import get_preset
from fibctl.errors import FibctlError
from fibctl.reports import figures, render, tables

Job = tuple[str, Callable[[], list[Path]]]


def jobs(engine: Engine, out: Path, *, seed: int = 42, matrix: str | None = None,
         dataset: str | None = None) -> list[Job]:
    """One job per table and figure; each returns the files it wrote."""

    def table_job(name: str, **kwargs):
        def job() -> list[Path]:
            table = tables.TABLES[name](engine, **kwargs)
            paths = [out / f"{name}.sql"]
            paths[0].write_text(table.sql + "\n")
            for fmt, ext in render.EXTENSIONS.items():
                paths.append(out / f"{name}.{ext}")
                paths[-1].write_text(render.render(table, fmt))
            return paths
        return job

    def figure_job(name: str, **kwargs):
        return lambda: [figures.FIGURES[name](engine, out / f"{name}.png", **kwargs)]

    preset = get_preset(figures.preset_in_use(engine)).model
    shown = dict(seed=seed, matrix=matrix)
    return [
        ("table1", table_job("table1", **shown)),
        ("table2", table_job("table2")),
        ("table3", table_job("table3", dataset=dataset, **shown)),
        ("table4", table_job("table4", dataset=dataset, **shown)),
        ("table5", table_job("table5", dataset=dataset, matrix=matrix)),
        ("extrapolation", figure_job("extrapolation", dataset=dataset, **shown)),
        ("posloss", figure_job("posloss", dataset=dataset, **shown)),
        ("curves", figure_job("curves", dataset=dataset, **shown)),
        ("alphas", figure_job("alphas", matrix=matrix)),
        ("coverage", lambda: [figures.coverage(out / "coverage.png", n_layers=preset.n_layers,
                                               seq_len=preset.seq_len)]),
    ]


def write_all(engine: Engine, out: Path, *, track: Callable[[list[Job]], Iterable[Job]] = iter,
              **kwargs) -> tuple[list[Path], list[tuple[str, str]]]:
    """Run every job; a table or figure whose data is missing is skipped with the reason."""
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for name, job in track(jobs(engine, out, **kwargs)):
        try:
            written += job()
        except FibctlError as e:
            skipped.append((name, str(e)))
    return written, skipped
