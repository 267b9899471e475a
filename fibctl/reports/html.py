"""`index.html`: every table, figure and run in one self-contained page (no network).

Figures are embedded as base64 PNG; each table carries the SQL that produced it in a
collapsible block; the run list shows status, settings and where each run trained, with its
full config one click away. Every value from the database is HTML-escaped.
"""

from __future__ import annotations

import base64
import inspect
import json
from html import escape
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Engine

from fibctl.reports import figures, render
from fibctl.reports.tables import Runs, Table

RUN_COLUMNS = ("name", "status", "schedule", "base", "window", "seed", "init_seed", "data_seed", "optimizer",
               "final_step", "tokens_trained", "wall_seconds", "host", "device", "torch_version", "cuda_version",
               "git_commit", "data_hash", "source")

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; } td.best { font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; }
figure { margin: .5em 0; } figure img { height: auto; }
figcaption { color: #444; max-width: 960px; margin-top: .3em; } figcaption a { margin-left: .5em; }
pre { background: #f7f7f7; padding: .6em; overflow-x: auto; font-size: 12px; }
.note { color: #555; font-style: italic; } .skipped { color: #a33; }
nav a { margin-right: 1em; }
"""


def table_html(table: Table) -> str:
    """The table with its best values in bold, its notes, and its SQL in a <details>."""
    best = render.best_rows(table)
    numeric = {c: render._numeric(table, c) for c in table.frame.columns}
    head = "".join(f"<th>{escape(str(c))}</th>" for c in table.frame.columns)
    rows = []
    for i, row in enumerate(table.frame.itertuples(index=False)):
        cells = []
        for column, value in zip(table.frame.columns, row):
            classes = " ".join(c for c, on in (("num", numeric[column]), ("best", i in best.get(column, ())))
                               if on)
            cells.append(f'<td class="{classes}">{escape(render.cell(table, column, value))}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in table.notes)
    return (f'<section id="{escape(table.name)}"><h2>{escape(table.title)}</h2>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{notes}"
            f"<details><summary>SQL</summary><pre>{escape(table.sql)}</pre></details></section>")


def figure_html(name: str, png: Path) -> str:
    """The figure, captioned with what it shows (its function's summary), and links to its
    files beside the page (relative: the folder can be moved or served as it is)."""
    raw = png.read_bytes()
    # one scale for every figure, 140 px to the printed inch: a column-wide figure shows at half
    # the width of a page-wide one, as on paper (the PNG's IHDR holds its width in pixels)
    width = int.from_bytes(raw[16:20], "big") * 140 // figures.STYLE["savefig.dpi"]
    data = base64.b64encode(raw).decode("ascii")
    caption = " ".join(inspect.getdoc(figures.FIGURES[name]).split("\n\n")[0].split())
    files = " ".join(f'<a href="{escape(f.name)}">{f.suffix[1:].upper()}</a>'
                     for f in sorted(png.parent.glob(f"{png.stem}.*")) if f.suffix in figures.FIGURE_SUFFIXES)
    return (f'<section id="figure-{escape(name)}"><h2>Figure: {escape(name)}</h2><figure>'
            f'<img alt="{escape(caption)}" width="{width}" src="data:image/png;base64,{data}">'
            f"<figcaption>{escape(caption)} {files}</figcaption></figure></section>")


def runs_html(engine: Engine, runs: Runs = Runs()) -> str:
    """The page's list of `runs` (those of --matrix and --only: the report's), with each config."""
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT {', '.join(_quoted(c) for c in RUN_COLUMNS)}, config_json "
                                 f"FROM runs r WHERE 1 = 1{runs.clause()} ORDER BY id")
                            .bindparams(*runs.bound())).all()
    head = "".join(f"<th>{escape(c)}</th>" for c in (*RUN_COLUMNS, "config"))
    body = []
    for row in rows:
        values = ["" if v is None else (f"{v:,.0f}" if isinstance(v, float) else str(v)) for v in row[:-1]]
        config = _pretty_json(row[-1])
        body.append("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in values)
                    + f"<td><details><summary>config</summary><pre>{escape(config)}</pre></details></td></tr>")
    return (f'<section id="runs"><h2>Runs ({len(rows)})</h2>'
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></section>")


def _quoted(column: str) -> str:
    return f'"{column}"' if column == "window" else column  # an SQL keyword


def _pretty_json(raw: str | None) -> str:
    try:
        return json.dumps(json.loads(raw), indent=2, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return raw or ""


def page(title: str, tables: list[Table], figures: dict[str, Path], runs: str,
         skipped: list[tuple[str, str]], source: str = "") -> str:
    """The whole document; `source` says what it was made from (the database, fibctl's
    version), under the title."""
    links = [(t.name, t.name) for t in tables] + [(f"figure-{n}", n) for n in figures] + [("runs", "runs")]
    nav = "".join(f'<a href="#{escape(anchor)}">{escape(label)}</a>' for anchor, label in links)
    missing = "".join(f'<li class="skipped">{escape(why if why.startswith(name) else f"{name}: {why}")}</li>'
                      for name, why in skipped)
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>",
             f'<p class="note">{escape(source)}</p>' if source else "", f"<nav>{nav}</nav>",
             f"<ul>{missing}</ul>" if missing else "",
             *(table_html(t) for t in tables), *(figure_html(n, p) for n, p in figures.items()), runs,
             "</body></html>"]
    return "\n".join(parts) + "\n"
