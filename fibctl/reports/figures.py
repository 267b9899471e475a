"""The study's figures, drawn with matplotlib's object API (no pyplot: no display needed).

Each function reads the database by SQL (or, for coverage, the attention schedule itself),
writes a PNG, PDF or SVG chosen by the file's extension, and returns the path. One visual
language runs through all of them: colour is the schedule (Okabe-Ito, safe for colour-blind
readers; learned and coprime, whose greys are near fixed's and stagger's, with hollow markers),
line style the base (fib solid, pow2 dashed), marker the window W; runs alike in all three (a
sweep's) take the palette's other colours, where at most 8 runs are drawn. Figures are drawn
at their print size (a column or the text width of a two-column paper), so their 8-9 pt text
stays 8-9 pt on the page; fonts are embedded as TrueType (venues reject Type 3), and the same
data give the same bytes (no creation date in the PDF).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
from fibctl.lazy import pandas as pd
from sqlalchemy import text
from sqlalchemy.engine import Engine

from fibctl.config import DEFAULT_SEED, PRESETS, SCHEDULES, ModelConfig, check_length
from fibctl.errors import FibctlError, shown_path
from fibctl.reports.output import holding, replace_file
from fibctl.reports.tables import (
    Table, dataset_label, default_dataset, pick_runs, read_sql, sort_runs, table3, table4,
)
from fibctl.schedules import attended_distances, coverage as coverage_counts, layer_alphas

FIGURE_SUFFIXES = (".png", ".pdf", ".svg")
COVERAGE_FIGURE_MAX_LAYERS = 128
COVERAGE_FIGURE_MAX_WINDOW = 4096
COVERAGE_FIGURE_MAX_DOTS = 2**21  # layers x length where a panel is dense (a dot per distance)
STYLE = {
    "pdf.fonttype": 42, "ps.fonttype": 42,  # TrueType, not Type 3: accepted by venues
    "font.size": 9, "figure.titlesize": 10, "axes.titlesize": 9, "axes.labelsize": 9, "figure.labelsize": 9,
    "legend.fontsize": 8, "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.25, "savefig.dpi": 200,
    "svg.hashsalt": "fibctl",  # an SVG's element ids from its content, not at random: the same bytes each time
    # text is drawn as written: a run or set name holding '$' (a database from elsewhere) was
    # parsed as mathtext, and '$\\foo{$' a traceback; fibctl's own text has none
    "text.parse_math": False,
}
# print sizes in inches: a two-column paper's column and full text width (ICML, ACL)
COLUMN_WIDTH, TEXT_WIDTH = 3.25, 6.75
# the tallest figure a page holds: a two-column paper's text height (9 in) less a caption's lines
PAGE_HEIGHT = 8.5
# colour = schedule, from Okabe & Ito's colour-blind-safe palette; dense is black, the baseline
# everything is read against. Printed in grey the palette keeps few levels apart: fixed and
# stagger, the study's comparison, take two far apart (blue L* 46, orange 71); learned and
# coprime (vermillion 54, sky blue 70), each near one of them, have hollow markers
SCHEDULE_COLORS = {"dense": "black", "fixed": "#0072B2", "learned": "#D55E00", "stagger": "#E69F00",
                   "coprime": "#56B4E9"}
HOLLOW_SCHEDULES = {"learned", "coprime"}
# the rest of the palette, for runs that share a schedule, base and W (run_styles)
LOOK_ALIKE_COLORS = ("#009E73", "#CC79A7", "#F0E442", "#999999")
BASE_STYLES = {"fib": "-", "pow2": "--"}
WINDOW_MARKERS = {6: "v", 8: "o", 10: "s", 12: "D"}
# alphas: a row of panels 1.9 in tall, three to a row while they fit a page; past that the rows
# shrink to 1.3 in, with up to 6 panels to a row (about 1 in wide: a run's name on two lines);
# past 6 x 6 panels the first learned runs to fill them are drawn and a note says how many are not
ALPHA_ROW, ALPHA_ROW_MIN, ALPHA_COLUMNS_MAX = 1.9, 1.3, 6
ALPHA_TITLE = 0.5  # the figure's title and margins, in inches
ALPHA_TICKS = (0.5, 0.75, 1.0, 1.25, 1.5)  # alpha lies in [0.5, 1.5]: both ends ticked
# curves: the end of training drawn again in an inset, magnified, on a panel whose lines there
# all lie under it (the study's first evaluations, 210, set a log axis on which its last 4,000
# steps, 42 to 48, where the schedules part, were a band 0.15 in tall): x, y, width and height
# in fractions of the panel, its upper right, which a falling curve leaves empty
ZOOM_BOX = (0.47, 0.5, 0.51, 0.45)
ZOOM_SHARE = 1 / 3  # the last third of training: 4,300 of the study's 13,000 steps
ZOOM_STEPS = 4  # evaluations in that third at the least: fewer show no curve to magnify
ROUND_STEPS = [1, 2, 2.5, 5, 10]  # tick steps a reader counts in, each times a power of ten
ZOOM_CLEAR = 0.12  # of the panel's width and height: the inset's tick labels, left of and under it
# past this many runs a legend keys the encoding (schedule, base, W) instead of naming each run
RUN_LEGEND_MAX = 8
# markers on a line of many points (a run's evaluations, its logged steps): enough to tell W
MARKERS_PER_LINE = 8
# changes with length (in %) all within this are drawn on a linear axis, not a symmetric-log one
CHANGE_LINEAR_MAX = 10
# the symmetric-log change axis' labelled ticks: 1, 2 and 5 of each decade while at most this many
CHANGE_TICKS_MAX = 8
# a point above this multiple of the median run at its length is drawn off the top, labelled
OUTLIER_FACTOR = 1.5


def check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise FibctlError(f"{shown_path(path)}: figures are written as PNG, PDF or SVG; name the file "
                          ".png, .pdf or .svg")
    return path


def _load_matplotlib() -> None:
    """matplotlib loads when a figure is drawn, not whenever the CLI starts. Without MPLBACKEND:
    a name it does not know (a typo) failed its import with a ValueError traceback, and fibctl
    draws on a Figure and saves by the file's suffix, with no backend of the user's."""
    global colormaps, rc_context, ScalarMappable, Normalize, Figure
    global FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, Line2D
    backend = os.environ.pop("MPLBACKEND", None)
    try:
        from matplotlib import colormaps, rc_context
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter
    finally:
        if backend is not None:  # for the processes this one starts
            os.environ["MPLBACKEND"] = backend


def styled(draw):
    """Draw a figure under STYLE: rc parameters are read when axes and text are created, and
    the font type when the file is saved, so the whole function runs inside the context."""
    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        _load_matplotlib()
        with rc_context(STYLE):
            return draw(*args, **kwargs)
    return wrapper


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: str | Path) -> Path:
    """Save at the figure's own size (the constrained layout keeps every label and legend
    inside it; a tight bounding box would change the print size), each panel ticked at or
    beyond its lowest and highest points."""
    path = check_path(path)
    fig.draw_without_rendering()  # the panels at their saved size: how many ticks they take
    for ax in fig.axes + [inset for ax in fig.axes for inset in ax.child_axes]:
        if ax.get_label() != "<colorbar>":
            _tick_ends(ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a PDF or SVG otherwise records when it was written: the same data would give other bytes
    metadata = {".pdf": {"CreationDate": None}, ".svg": {"Date": None}}.get(path.suffix.lower())
    with writing_into(path.parent):  # a folder it made just now too
        return replace_file(path, lambda tmp: fig.savefig(tmp, metadata=metadata))


def writing_into(folder: Path):
    """`folder` held while a figure is written there: a `report all` writing its report there
    could replace the figure, or remove it as stale; refused, one line, while one does."""
    return holding(folder, exclusive=False, busy=(
        f"{shown_path(folder)}: a `fibctl report all` is writing a report there now; wait for it "
        "to finish, or choose another --out"))


# off for `figure --no-title`: a paper's caption says what the title would
_TITLED = contextvars.ContextVar("titled", default=True)


@contextlib.contextmanager
def untitled():
    """Figures drawn inside have no title above their panels (the panels keep theirs)."""
    token = _TITLED.set(False)
    try:
        yield
    finally:
        _TITLED.reset(token)


def _title(fig: Figure, title: str) -> None:
    """A figure title wrapped to the figure's width (at most 6 pt a character at 10 pt), before
    its closing parenthesis where both lines fit: posloss's column-wide title broke inside
    it ('... bin (fib' over 'W8, seed 42)')."""
    if _TITLED.get():
        width = int(fig.get_figwidth() * 72 / 6)
        head, paren, tail = title.rpartition(" (")
        fits = len(title) > width and paren and len(head) <= width and len(tail) + 1 <= width
        fig.suptitle(f"{head}\n({tail}" if fits else textwrap.fill(title, width))


def run_style(schedule: str, base, window) -> dict:
    """Line properties of a run: colour by schedule, line style by base, marker by W."""
    dense = schedule == "dense"
    hollow = {"markerfacecolor": "white"} if schedule in HOLLOW_SCHEDULES else {}
    return hollow | dict(color=SCHEDULE_COLORS.get(schedule, "tab:gray"),
                linestyle="-" if dense else BASE_STYLES.get(base, ":"),
                marker="*" if dense else WINDOW_MARKERS.get(int(window) if pd.notna(window) else -1, "^"),
                linewidth=2.2 if dense else 1.3, markersize=6 if dense else 4.5, zorder=3 if dense else 2)


def run_styles(runs: list[tuple[str, str, object, object]]) -> dict[str, dict]:
    """Each run's line properties (run, schedule, base, W): `run_style`, except where runs of
    one schedule, base and W are drawn together (a sweep's learning rates, say) among at most
    RUN_LEGEND_MAX runs: the first keeps its schedule's colour, the others take the colours no
    schedule has, one each in turn over every such run (counted per schedule, a sweep of fixed
    and stagger alike drew its two second runs the same), hollow markers for the first four
    and filled past them, so that each line reads as its own."""
    styles, seen, alike = {}, set(), 0
    for run, schedule, base, window in sorted(runs, key=lambda r: r[0]):
        key = (schedule, base if pd.notna(base) else None, window if pd.notna(window) else None)
        styles[run] = run_style(schedule, base, window)
        if key in seen and len(runs) <= RUN_LEGEND_MAX:
            colors = len(LOOK_ALIKE_COLORS)
            styles[run] |= {"color": LOOK_ALIKE_COLORS[alike % colors],
                            "markerfacecolor": "white" if alike // colors % 2 == 0 else None}
            alike += 1
        seen.add(key)
    return styles


def markevery(points: int, nth: int, lines: int) -> tuple[int, int]:
    """Every how many points line `nth` of `lines` draws a marker: at most about
    MARKERS_PER_LINE (26 evaluations of 31 runs, each marked, buried the curves), and the runs'
    markers at different steps so that they do not cover each other."""
    every = max(1, math.ceil(points / MARKERS_PER_LINE))
    return nth * every // max(lines, 1), every


def run_label(run: str, schedule: str) -> str:
    if schedule != "dense":
        return run
    return run if "dense" in run else f"{run} (dense)"  # an imported baseline: say what it is


def _plain_log_axis(axis) -> None:
    """A log axis (call after plotting) whose ticks read as plain numbers (20, 50, 100), not
    2x10^1, dense enough to read values off even when the data span less than a decade."""
    lo, hi = axis.get_view_interval()
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), (1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9)):
        # a decade either side of the view: the ticks _tick_ends may widen the axis to
        ticks = [m * 10 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for m in mantissas]
        if sum(lo <= t <= hi for t in ticks) >= 4:
            break
    else:  # a span under a factor of about 1.5: evenly spaced round numbers, in steps of 1, 2,
        # 2.5 or 5 (a linear axis' own; MaxNLocator's default 1.5 ticked 231, 232.5, 234)
        ticks = list(MaxNLocator(5, steps=ROUND_STEPS).tick_values(lo, hi))
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _drawn_span(ax) -> tuple[float, float] | None:
    """The lowest and highest y the axes draw in their view: their lines' points and bars'
    ends (a point outside it, as under a zoom's inset or an outlier off the top, is not drawn
    there)."""
    (left, right), (bottom, top) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    ys = [y for line in ax.get_lines() if line.get_transform() is ax.transData  # not axhline's
          for x, y in line.get_xydata() if left <= x <= right and bottom <= y <= top]
    ys += [y for bar in ax.patches for y in (bar.get_y(), bar.get_y() + bar.get_height())]
    return (min(ys), max(ys)) if ys else None


def _tick_ends(ax) -> None:
    """Widen the y-axis, where its lowest labelled tick is above the lowest point drawn (posloss
    ticked from 3.75 over a loss of 3.71, curves from 40 over the dense run's 34) or its highest
    below the highest point (extrapolation's 48 under the study's pow2 fixed run at 49.5): the
    line's end had no tick beyond it. That end goes to the locator's next tick past the point,
    and the ticks are kept as they are (a layout redone at saving could thin them to others)."""
    span = _drawn_span(ax)
    bottom, top = ax.get_ylim()
    if span is None or bottom > top:  # nothing drawn; an inverted axis (coverage's layers) reads down
        return
    locator = ax.yaxis.get_major_locator()
    ticks = list(locator())
    slack = (top - bottom) * 1e-9
    scale = ax.yaxis.get_transform()
    limits, added = {}, set()
    for end, point, other, sign in (("bottom", span[0], top, -1), ("top", span[1], bottom, 1)):
        if any(bottom - slack <= t <= top + slack and (t - point) * sign >= -slack for t in ticks):
            continue
        # the locator's ticks past the view, else those it gives for a view as far again past the
        # point, in the axis' own scale (a symmetric-log axis' next decade lies past twice 200 %)
        a, b = scale.transform([point, other])
        far = scale.inverted().transform([2 * a - b])[0]
        beyond = [t for t in ticks if (t - point) * sign >= 0] or \
            [t for t in locator.tick_values(*sorted((far, other))) if (t - point) * sign >= 0]
        if not beyond:
            continue
        tick = min(beyond, key=lambda t: abs(t - point))
        added.add(tick)
        # a margin past the tick, as matplotlib leaves past data, in that scale too
        a, b = scale.transform([tick, other])
        limits[end] = scale.inverted().transform([a + (a - b) * 0.02])[0]
    if limits:
        ax.set_ylim(**limits)
        ax.yaxis.set_major_locator(FixedLocator(sorted(set(ticks) | added)))


def _runs_legend(fig: Figure, source, styles: list[dict], note: str | None = None) -> None:
    """The runs drawn on `source`, as a legend below the panels. `styles` holds each run's
    schedule, base and W: past RUN_LEGEND_MAX runs the legend keys them (a row each for
    schedule colours, base line styles and W markers) rather than listing 20 entries, and says
    how many runs are drawn alike (a sweep's, which fewer runs tell apart: run_styles). `note`,
    what else the lines' looks mean, heads the legend."""
    handles, labels = source.get_legend_handles_labels()
    title = note
    if len(labels) > RUN_LEGEND_MAX:
        handles, labels, ncol = _style_key(styles)
        keys = {(s["schedule"], s["base"] or None, s["window"]) for s in styles}
        if len(keys) < len(styles):  # a sweep's runs look alike: said, where 20 names broke the layout
            alike = f"{len(styles)} runs; {len(styles) - len(keys)} drawn as another of their schedule, base and W"
            title = "\n".join(filter(None, (alike, note)))
    else:  # as many columns as fit the width, at about 5 pt a character plus the line sample
        ncol = max(1, min(len(labels), int(fig.get_figwidth() * 72 / (5 * max(map(len, labels)) + 40))))
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False, title=title,
               title_fontsize=8)


def _style_key(styles: list[dict]) -> tuple[list, list[str], int]:
    """Legend entries for the encoding itself: schedules, then bases, then windows, a row each
    (matplotlib fills a legend by columns, so the rows are interleaved)."""
    schedules = sorted({s["schedule"] for s in styles}, key=lambda s: (SCHEDULES + (s,)).index(s))
    bases = sorted({s["base"] for s in styles if s["schedule"] != "dense" and s["base"]})
    windows = sorted({int(s["window"]) for s in styles if s["schedule"] != "dense" and pd.notna(s["window"])})
    rows = [[(Line2D([], [], **{**run_style(s, "fib", None), "marker": "*" if s == "dense" else "o"}),
              "dense" if s == "dense" else f"{s} schedule") for s in schedules],  # "o": hollow or not
            [(Line2D([], [], color="0.3", linestyle=BASE_STYLES.get(b, ":"), linewidth=1.3), f"{b} base")
             for b in bases],
            [(Line2D([], [], color="0.3", linestyle="", marker=WINDOW_MARKERS.get(w, "^"), markersize=4.5),
              f"W={w}") for w in windows]]
    rows = [row for row in rows if row]
    ncol = max(map(len, rows))
    blank = (Line2D([], [], linestyle="", marker=""), "")
    entries = [row[c] if c < len(row) else blank for c in range(ncol) for row in rows]
    return [h for h, _ in entries], [label for _, label in entries], ncol


def _clip_outliers(ax, points: dict[int, list[tuple[float, str]]]) -> None:
    """Fit the y-limits (log) to the runs, not to one outlier: a dense model's blow-up at 4x
    would crush every other line. `points` holds (value, colour) by length; values over
    OUTLIER_FACTOR x the median at their length leave the view and are written, with an
    arrow, just above its top edge in their run's colour. An infinite value (a diverged run's
    perplexity) is always one: no limit holds it."""
    outliers = {x: sorted(v for v, _ in vs if not math.isfinite(v)
                          or v > OUTLIER_FACTOR * float(pd.Series([v for v, _ in vs]).median()))
                for x, vs in points.items()}
    values = [v for vs in points.values() for v, _ in vs if math.isfinite(v)]
    kept = [v for x, vs in points.items() for v, _ in vs if v not in outliers[x]]
    margin = max(max(kept) / min(values), 1.1) ** 0.04  # 4 % of the span (one value: a span all the same)
    ax.set_ylim(min(values) / margin, max(kept) * margin)
    for x, vs in points.items():
        above = sorted((v, c) for v, c in vs if v in outliers[x])
        for i, (v, color) in enumerate(above):  # stacked when several leave at one length
            ax.annotate(f"\u2191 {v:.3g}", xy=(x, 1), xycoords=ax.get_xaxis_transform(), xytext=(0, 2 + 10 * i),
                        textcoords="offset points", ha="center", va="bottom", color=color, fontsize=8)


def _train_lengths(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT name, train_length FROM runs")).all())


def _drawn_from(figure: str, table: str, build: Callable[[], Table]) -> Table:
    """A table's data for a figure; its errors, which start with the table's name, start with
    the figure's (`figure posloss` said "table4: ...")."""
    try:
        return build()
    except FibctlError as e:
        raise type(e)(f"{figure}: {str(e).removeprefix(f'{table}: ')}") from None


@styled
def extrapolation(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int = DEFAULT_SEED,
                  matrix: str | None = None, only: str | None = None) -> Path:
    """Perplexity vs evaluation length (left) and its change from the training length in
    percent (right, symmetric-log so that 1 % and 100 % both read), one line per run."""
    check_path(path)
    dataset = dataset or default_dataset(engine)
    table = _drawn_from("extrapolation", "table3", lambda: table3(engine, dataset=dataset, seed=seed, matrix=matrix,
                                                                  only=only, all_runs=True))
    frame = table.frame.rename(columns={"Run": "run", "Base": "base", "Schedule": "schedule", "W": "window"})
    frame["base"] = frame["base"].replace("-", None)
    lengths = [c for c in frame.columns if c.isdigit()]
    trained = _train_lengths(engine)
    fig = _figure(TEXT_WIDTH, 3.6)
    left, right = fig.subplots(1, 2)
    by_length: dict[int, list[tuple[float, str]]] = {}
    changes = []
    styles = run_styles(list(frame[["run", "schedule", "base", "window"]].itertuples(index=False, name=None)))
    for _, row in frame.iterrows():
        # a perplexity is positive (inf: diverged); 0, below or nan (a row edited by hand) has no
        # place on a log axis, and a run left with no point draws no line
        points = [(int(n), float(row[n])) for n in lengths if float(row[n]) > 0]
        if not points:
            continue
        style = styles[row["run"]]
        x, y = zip(*points)
        left.plot(x, y, label=run_label(row["run"], row["schedule"]), **style)
        ref = dict(points).get(trained.get(row["run"]), y[0])  # the training length, else the shortest
        changes += [(v / ref - 1) * 100 for v in y]
        right.plot(x, changes[-len(y):], **style)
        for n, v in points:
            by_length.setdefault(n, []).append((v, style["color"]))
    if not any(math.isfinite(v) for vs in by_length.values() for v, _ in vs):  # no limits a log axis can take
        raise FibctlError(f"extrapolation: every perplexity on {dataset} is infinite (seed {seed}): "
                          "nothing to draw; `fibctl report table3` lists them")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(n) for n in lengths], labels=lengths)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("evaluation length (tokens)")
    left.set_yscale("log")
    _clip_outliers(left, by_length)
    _plain_log_axis(left.yaxis)
    left.set_ylabel(f"{dataset_label(dataset)} perplexity")
    _change_axis(right, changes)
    right.axhline(0, color="black", linewidth=0.6)
    right.set_ylabel("change vs. training length (%)")
    _title(fig, table.title.replace("Table 3: ", ""))
    _runs_legend(fig, left, frame[["schedule", "base", "window"]].to_dict("records"))
    return _save(fig, path)


def _change_axis(ax, changes: list[float]) -> None:
    """Symmetric-log when the changes span orders of magnitude (a dense run's +150 % beside the
    sparse runs' 1 %: both read); linear when every one is within CHANGE_LINEAR_MAX %, where a
    symmetric-log axis keeps one or two of its decade ticks."""
    finite = [c for c in changes if math.isfinite(c)]
    if max(map(abs, finite), default=0) > CHANGE_LINEAR_MAX:
        ax.set_yscale("symlog", linthresh=2)
        # the margins again, in this scale: the panel's x ticks had set them on a linear one (5 %
        # of +200 % under -1 %, an empty band down to -11 %)
        ax.autoscale_view(scalex=False)
        ax.yaxis.set_major_locator(FixedLocator(symlog_ticks(min(finite), max(finite))))
    ax.yaxis.set_major_formatter(FuncFormatter(percent_tick))


def symlog_ticks(low: float, high: float) -> list[float]:
    """Ticks for changes from `low` to `high` (in %; 0, the training length's, always among
    them) on a symmetric-log axis. Each end gets the nearest whole multiple of a decade at or
    past it, at least 1 (a tick in the linear part nearer 0 ran into 0's label): the study's
    dense +201 % gets +300, where the next decade, +1,000, left a decade of the panel empty.
    Between the ends 0 and 1, 2 and 5 of each decade while at most CHANGE_TICKS_MAX fit, else
    the decades (every other one, and so on, past that); none within a factor of 2 of an end,
    where its label would run into the end's (+20 under +30)."""
    def end(value: float) -> float:
        if not value:
            return 0.0
        size = max(abs(value), 1) * (1 - 1e-9)  # +200.0000001 % is +200's (a float's error)
        exponent = math.floor(math.log10(size))
        multiple = math.ceil(size / 10.0 ** exponent)
        if multiple == 10:  # the next decade, as 1 x 10^(k + 1): 10 x 10^k is off by a float's error
            multiple, exponent = 1, exponent + 1
        return math.copysign(multiple * 10.0 ** exponent, value)

    bottom, top = end(min(low, 0)), end(max(high, 0))
    decades = range(math.floor(math.log10(max(-bottom, top, 1))) + 1)
    for mantissas, every in [((1, 2, 5), 1)] + [((1,), every) for every in range(1, len(decades) + 1)]:
        inner = {s * m * 10.0 ** e for e in decades[::every] for m in mantissas for s in (-1, 1)}
        ticks = sorted({0.0, bottom, top} | {t for t in inner if bottom / 2 <= t <= top / 2})
        if len(ticks) <= CHANGE_TICKS_MAX:
            break
    return ticks


def percent_tick(value: float, _position=None) -> str:
    """A change in percent, signed: whole numbers from 10 on; below, a round tick as it is
    (a linear axis' quarters: -1.25 read -1.2 beside -1, so two labels differed by 0.2 a
    step of 0.25), any other to two significant digits (+0.654804 read so)."""
    if abs(value) < 1e-9:  # 0, or a linear locator's 0 off by a float's error
        return "0"
    if abs(value) >= 10:
        return f"{value:+,.0f}"
    exact = next((d for d in range(4) if abs(round(value, d) - value) < 1e-9), None)
    return f"{value:+.2g}" if exact is None else f"{value:+.{exact}f}"


@styled
def posloss(engine: Engine, path: str | Path, *, dataset: str | None = None, window: int = 8,
            seed: int = DEFAULT_SEED, matrix: str | None = None, only: str | None = None) -> Path:
    """Loss by position bin for fib fixed and stagger at window W, and the gap between them."""
    check_path(path)
    table = _drawn_from("posloss", "table4", lambda: table4(engine, dataset=dataset, window=window, seed=seed,
                                                            matrix=matrix, only=only))
    frame = table.frame.set_index("Row")
    bins = [c for c in frame.columns if c != "Run"]
    fig = _figure(COLUMN_WIDTH, 4.0)  # the gap panel says which way it runs above it
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for row in frame.index[:2]:
        # the schedule and run: the title gives W (the row's 'fixed W8' is the paper's table's)
        schedule = row.split()[0]
        top.plot(bins, frame.loc[row, bins].astype(float), label=f"{schedule} ({frame.loc[row, 'Run']})",
                 **run_style(schedule, "fib", window))
    top.set_ylabel("mean loss (nats)")
    _title(fig, table.title.replace("Table 4: ", ""))
    fig.legend(loc="outside lower center", frameon=False)
    gap = frame.loc["gap", bins].astype(float)
    # a bar in the colour of the schedule with the lower loss
    bottom.bar(bins, gap, color=[SCHEDULE_COLORS["stagger" if g > 0 else "fixed"] for g in gap])
    bottom.axhline(0, color="black", linewidth=0.8)
    # which way the gap runs, above the panel: as its label it stood taller than the panel
    bottom.set_title("fixed \u2212 stagger (> 0: stagger lower)")
    bottom.set_ylabel("gap (nats)")
    fig.align_ylabels([top, bottom])
    bottom.set_xlabel("predicted position (tokens)")
    bottom.tick_params(axis="x", labelrotation=45)
    for label in bottom.get_xticklabels():
        label.set_horizontalalignment("right")
        label.set_rotation_mode("anchor")
    return _save(fig, path)


@styled
def curves(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int | None = None,
           matrix: str | None = None, only: str | None = None) -> Path:
    """Validation perplexity at the training length vs step (left; one line per run and token
    budget, since the light and full evaluations score different documents) and training loss
    (right). Runs of one schedule share its colour and differ by marker, on both panels."""
    check_path(path)
    runs = pick_runs(engine, matrix, only)
    dataset = dataset or default_dataset(engine)
    seed_clause = "\n  AND r.seed = :seed" if seed is not None else ""
    where = f"{seed_clause}{runs.clause()}"
    params = runs.params(dataset=dataset, **({"seed": seed} if seed is not None else {}))
    sql = f"""SELECT r.name AS run, r.schedule, r.base, r."window" AS "window", e.step, e.tokens, e.ppl
FROM evaluations e
JOIN runs r ON r.id = e.run_id
WHERE e.dataset = :dataset AND e.eval_length = r.train_length{where}
ORDER BY r.name, e.step"""
    long, _ = read_sql(engine, sql, **params)
    long = long[long["ppl"] > 0]  # as in extrapolation: no place on a log axis for 0, below or nan
    if long.empty:
        of = f" of seed-{seed} runs" if seed is not None else ""
        raise FibctlError(f"curves: no evaluations{of} on {dataset}{runs.said()}; runs record "
                          "them every eval_interval steps while training (`fibctl train`)")
    params.pop("dataset")
    steps, _ = read_sql(engine, f"""SELECT r.name AS run, t.step, t.loss
FROM train_steps t
JOIN runs r ON r.id = t.run_id
WHERE 1 = 1{where}
ORDER BY r.name, t.step""", **params)
    fig = _figure(TEXT_WIDTH, 3.3)
    # no training steps recorded (an imported study): the validation panel alone, not an empty one
    left, right = fig.subplots(1, 2) if not steps.empty else (fig.subplots(), None)
    long["tokens"] = long["tokens"].fillna(-1)
    light_shown = False
    styles = []
    meta = long[["run", "schedule", "base", "window"]].drop_duplicates("run")
    looks = run_styles(list(meta.itertuples(index=False, name=None)))
    # in the paper's order, as the extrapolation figure and the tables list them (by name, a
    # study's dense run `ref_e0000` came last)
    order = sort_runs(meta.sort_values("run"))["run"].tolist()
    for nth, run in enumerate(order):
        points = long[long["run"] == run]
        first = points.iloc[0]
        styles.append(first[["schedule", "base", "window"]].to_dict())
        style = looks[run]
        budgets = sorted(points["tokens"].unique())
        for tokens in budgets:  # the largest budget is the full evaluation; the light ones unmarked, behind
            line = points[points["tokens"] == tokens]
            full = tokens == budgets[-1]
            left.plot(line["step"], line["ppl"], label=run_label(run, first["schedule"]) if full else None,
                      markevery=markevery(len(line), nth, len(order)),
                      **(style if full else {**style, "linewidth": 0.8, "alpha": 0.5, "marker": None}))
            light_shown |= not full
        mine = steps[steps["run"] == run]
        if right is not None and not mine.empty:  # raw values faint, a centred moving average on top
            right.plot(mine["step"], mine["loss"], color=style["color"], linewidth=0.6, alpha=0.25)
            right.plot(mine["step"], smoothed(mine["loss"]), markevery=markevery(len(mine), nth, len(order)),
                       **{**style, "linewidth": min(style["linewidth"], 1.6)})
    left.set_yscale("log")
    _plain_log_axis(left.yaxis)
    _zoom_late(left)
    left.set_xlabel("training step")
    left.set_ylabel(f"{dataset_label(dataset)} perplexity")
    left.set_title("validation")
    if right is not None:
        right.set_xlabel("training step")
        right.set_ylabel("training loss (nats)")
        right.set_title(f"training (line: centred mean, {SMOOTH_SHARE * 100:.0f} % of a run)")
    _title(fig, f"Training curves ({dataset_label(dataset)})"
           + ("" if right is not None else "; no training steps recorded"))
    # said under the panels, with the runs: "(thin: light budget)" in the panel's title left
    # a reader to guess what a light budget is and which lines were thin
    _runs_legend(fig, left, styles, LIGHT_NOTE if light_shown else None)
    return _save(fig, path)


LIGHT_NOTE = "thin, faint validation lines: the light evaluations, on fewer tokens than the full one"
SMOOTH_SHARE = 0.1  # of a run's logged steps, averaged around each one


def _zoom_late(ax) -> None:
    """The panel's lines over the last ZOOM_SHARE of training, drawn again on a linear y-axis in
    an inset (ZOOM_BOX) and the span they cover marked on the panel, where every point right
    of the inset lies under it and its tick labels (where one does not, the late part fills
    enough of the panel to be read there). Its y-limits fit the lines of several points: a
    baseline evaluated once (the study's dense run, 34 under 42 to 47) stays on the panel."""
    lines = [line for line in ax.get_lines() if line.get_transform() is ax.transData]
    points = np.concatenate([line.get_xydata() for line in lines])
    points = points[np.isfinite(points).all(axis=1)]
    _tick_ends(ax)  # the panel's limits final: where each point sits in it
    inside = ax.transAxes.inverted().transform(ax.transData.transform(points))
    x0, y0, _, _ = ZOOM_BOX
    end = points[:, 0].max()
    start = end * (1 - ZOOM_SHARE) * (1 - 1e-9)  # step 20 of 30 is in the last third
    late = [xy[xy[:, 0] >= start] for xy in (line.get_xydata() for line in lines) if len(xy) > 1]
    late = np.concatenate(late)[:, 1] if late else np.empty(0)
    late = late[np.isfinite(late)]
    steps = np.unique(points[points[:, 0] >= start, 0])
    under = (inside[inside[:, 0] >= x0 - ZOOM_CLEAR, 1] < y0 - ZOOM_CLEAR).all()
    if not len(late) or len(steps) < ZOOM_STEPS or not under:
        return
    inset = ax.inset_axes(ZOOM_BOX)
    inset.spines[["top", "right"]].set_visible(True)  # a box: the panel's lines run behind it
    for line in lines:
        inset.plot(line.get_xdata(), line.get_ydata(), color=line.get_color(), linestyle=line.get_linestyle(),
                   linewidth=line.get_linewidth(), marker=line.get_marker(), markersize=line.get_markersize(),
                   markerfacecolor=line.get_markerfacecolor(), markevery=line.get_markevery(),
                   alpha=line.get_alpha(), zorder=line.get_zorder())
    pad = (late.max() - late.min()) * 0.06 or abs(late.max()) * 0.01
    inset.set_xlim(start - (end - start) * 0.04, end + (end - start) * 0.04)
    inset.set_ylim(late.min() - pad, late.max() + pad)
    # a fixed number of ticks, not by the inset's size: limits final before the zoom is marked;
    # at round steps (MaxNLocator's own also take 1.5, 3, 4, 6, 8: steps 400, 480, 560; 16.5, 18, 19.5)
    for axis in (inset.xaxis, inset.yaxis):
        axis.set_major_locator(MaxNLocator(3, steps=ROUND_STEPS))
    _tick_ends(inset)
    ax.indicate_inset_zoom(inset, edgecolor="0.4")


def smoothed(loss: pd.Series) -> pd.Series:
    """The training loss averaged over a window centred on each logged step, SMOOTH_SHARE of
    the run's steps wide, narrowed at the run's ends to stay centred (a one-sided window there
    lags as a trailing average does: above every raw point of a falling loss, and with a fixed
    number of points a short run is smoothed over most of it). Missing values are left out."""
    values = loss.to_numpy(dtype=float)
    at = np.arange(len(values))
    half = np.minimum(max(1, round(len(values) * SMOOTH_SHARE)) // 2, np.minimum(at, len(values) - 1 - at))
    known = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(known, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(known)])
    n = counts[at + half + 1] - counts[at - half]
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.Series((sums[at + half + 1] - sums[at - half]) / n, index=loss.index)


@styled
def alphas(engine: Engine, path: str | Path, *, run: str | None = None, matrix: str | None = None,
           only: str | None = None) -> Path:
    """Alpha of every layer: learned runs over training, static schedules (recorded once) by layer."""
    check_path(path)
    runs = pick_runs(engine, matrix, only)
    run_clause = "\n  AND r.name = :run" if run else ""
    sql = f"""SELECT r.name AS run, r.schedule, a.step, a.layer, a.alpha
FROM alphas a
JOIN runs r ON r.id = a.run_id
WHERE r.schedule <> 'dense'{run_clause}{runs.clause()}
ORDER BY r.name, a.layer, a.step"""
    long, _ = read_sql(engine, sql, **runs.params(**({"run": run} if run else {})))
    if long.empty:
        with engine.connect() as conn:
            schedule = conn.execute(text("SELECT schedule FROM runs WHERE name = :run"), {"run": run}).scalar() \
                if run else None
        if schedule == "dense":
            raise FibctlError(f"alphas: run {run!r} is dense: it has no alpha (no rungs to scale)")
        what = f"run {run!r}" if run else f"sparse runs{runs.said()}"
        raise FibctlError(f"alphas: no alphas recorded for {what}; runs record them while "
                          "training (`fibctl train`)")
    panels = alpha_panels(long)
    ncols, nrows, row = alpha_grid(len(panels))
    shown_panels = panels[:ncols * nrows]
    fig = _figure(TEXT_WIDTH if ncols > 1 else COLUMN_WIDTH, row * nrows + ALPHA_TITLE)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    small = ncols > 3  # about 1 in a panel: labels once for the figure, not on each panel
    for ax, (title, points) in zip(axes.ravel(), shown_panels):
        _alpha_panel(ax, points, title, small=small)
        # alpha's ends and middle always ticked; quarters where a panel has room
        ax.set_yticks(ALPHA_TICKS if row >= 1.5 else ALPHA_TICKS[::2])
    for ax in axes.ravel()[len(shown_panels):]:
        ax.set_visible(False)
    shown = axes.ravel()[:len(shown_panels)]
    for ax in axes[:, 0]:  # the y-axis is shared: labelled once a row
        ax.set_ylabel("\u03b1 of the layer")
    # a layer's colour (its depth) where a panel draws alpha over training: beside those panels, not
    # the static schedules', coloured by schedule
    over_time = [ax for ax, (_, points) in zip(shown, shown_panels) if points["step"].nunique() > 1]
    if over_time:
        mappable = ScalarMappable(Normalize(0, 1), colormaps["viridis"])
        empty = axes.ravel()[len(shown_panels):]
        # in the empty cell after the last panel: a bar the layout sets beside a panel widens
        # that panel's column alone, the gap after it wider than the others
        if len(empty) and shown[-1] in over_time:
            empty[0].set_visible(True)  # drawn, for the bar inside it, with no axis of its own
            empty[0].axis("off")
            # labelled as a laid-out bar is, which _save leaves unticked
            cax = empty[0].inset_axes([0.04, 0.1, 0.05, 0.8], label="<colorbar>")
            bar = fig.colorbar(mappable, cax=cax, label="layer")
        else:
            bar = fig.colorbar(mappable, ax=over_time, label="layer", shrink=0.8)
        bar.set_ticks([0, 1], labels=["first", "last"])  # in words: a label saying so outran a one-row bar
    _title(fig, f"Per-layer \u03b1{_alphas_shown(panels)} (rung distance = \u03b1 \u00d7 base sequence)")
    learned = sum(points["schedule"].iloc[0] == "learned" for _, points in panels)  # the panels cut, last
    drawn = learned - (len(panels) - len(shown_panels))
    _label_once(fig, axes, shown, small, "" if len(shown_panels) == len(panels) else
                f"the first {drawn} of {learned} learned runs by name; --run, --matrix or --only draws others")
    _fit_titles(fig, shown)
    return _save(fig, path)


def _alphas_shown(panels: list[tuple[str, pd.DataFrame]]) -> str:
    """What the alphas figure's panels draw, for its title: a static schedule's curve once for
    all its runs (not each run's), a learned run's alpha over training. One learned run's is a
    column wide, its name over its panel: 'of each learned run' took the title to three lines."""
    kinds = {points["schedule"].iloc[0] == "learned" for _, points in panels}
    # a learned run recorded at one step only (the study's imported probe: its final alphas) is
    # drawn by layer at that step, not over training
    over = {points["step"].nunique() > 1 for _, points in panels if points["schedule"].iloc[0] == "learned"}
    how = " over training" if over == {True} else " by layer" if over == {False} else ""
    if kinds == {True, False}:
        return f": each static schedule once, each learned run{how}"
    if True in kinds:
        return how if len(panels) == 1 else f" of each learned run{how}"
    return " of each static schedule"


def alpha_panels(long: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The alphas figure's panels, (title, points): first the static schedules' (their alphas
    the schedule's, the same at every step and for every base and W), a panel for each curve by
    layer drawn once for all its runs, titled by the schedule and how many runs it stands for
    (25 of a paper matrix's 30 sparse runs repeated three curves, the 5 learned runs lost among
    them); then a panel for each learned run, by name. A curve of one run is titled by its name."""
    static: dict[tuple, list] = {}  # a curve: the names of its runs and its points
    learned = []
    for name, points in long.groupby("run", sort=True):
        schedule = points["schedule"].iloc[0]
        if schedule == "learned":
            learned.append((name, points))
            continue
        last = points[points["step"] == points["step"].max()].sort_values("layer")
        order = SCHEDULES.index(schedule) if schedule in SCHEDULES else len(SCHEDULES)
        key = (order, schedule, len(last), tuple(last["alpha"].round(6)))
        static.setdefault(key, [[], last])[0].append(name)
    depths: dict[str, set] = {}  # a schedule's curves at several depths: their titles say how many layers
    for _, schedule, layers, _ in static:
        depths.setdefault(schedule, set()).add(layers)
    panels = []
    for (_, schedule, layers, _), (names, points) in sorted(static.items()):
        # no-break spaces: a title broken to fit its panel keeps '16 layers' and '(10 runs)' whole
        what = f"{schedule}, {layers}\u00a0layers" if len(depths[schedule]) > 1 else schedule
        panels.append((names[0] if len(names) == 1 else f"{what} ({len(names)}\u00a0runs)", points))
    return panels + learned


def _label_once(fig: Figure, axes, shown, small: bool, note: str) -> None:
    """The alphas panels' axis labels once for the figure, where one is wider than its panel (it
    would run into the next panel's label: a panel of three a row beside the colour bar is about
    1.5 in) or the panels are `small`; `note` on a line below them (kept by --no-title)."""
    fig.draw_without_rendering()  # lays the panels out: their widths as saved
    wide = any(ax.xaxis.label.get_window_extent().width > ax.get_window_extent().width for ax in shown)
    if small or wide:
        xlabel = " or ".join(dict.fromkeys(ax.get_xlabel() for ax in shown))
        for ax in axes.ravel():
            ax.set_xlabel("")
            ax.set_ylabel("")
        fig.supylabel("\u03b1 of the layer")
        note = f"{xlabel}\n{note}" if note else xlabel
    if note:
        fig.supxlabel(note)


def alpha_grid(panels: int) -> tuple[int, int, float]:
    """Columns, rows and row height (in) of the alphas figure's panels: the fewest columns (3 or
    more) whose rows fit a page at ALPHA_ROW_MIN or taller (1.9 in a row, a panel each, made
    figures of 13 runs taller than a page), at most ALPHA_COLUMNS_MAX; as many rows as fit then."""
    fit = int((PAGE_HEIGHT - ALPHA_TITLE) // ALPHA_ROW_MIN)
    ncols = next((c for c in range(min(panels, 3), ALPHA_COLUMNS_MAX) if math.ceil(panels / c) <= fit),
                 ALPHA_COLUMNS_MAX)
    nrows = min(math.ceil(panels / ncols), fit)
    return ncols, nrows, min(ALPHA_ROW, (PAGE_HEIGHT - ALPHA_TITLE) / nrows)


TITLE_LEAST_PT = 8  # a panel title is made no smaller to fit; past that it breaks over lines


def _fit_titles(fig: Figure, axes) -> None:
    """Each panel's title (a run's name, or a static curve's 'stagger, 16 layers (10 runs)')
    fitted to its panel: a probe run's name (probe_d2_staggered_s0_300steps) ran into its
    neighbour's. Where every title fits whole at one size no smaller than TITLE_LEAST_PT, all
    take it ('probe_marked_d2_uniform_' over 's0' read as two names, beside whole ones); else
    one too wide breaks after its underscores and spaces. Each line of a title of
    several is fitted alone (coverage's '133 distinct distances' ran into the next panel's)."""
    fig.draw_without_rendering()  # lays the panels out: their widths as saved
    widths = [(ax.title, ax.title.get_window_extent().width, ax.get_window_extent().width) for ax in axes]
    sizes = [title.get_fontsize() * room / wide for title, wide, room in widths if title.get_text() and wide > room]
    size = math.floor(min(sizes) * 10) / 10 if sizes else 0  # down to a tenth: widths are not quite linear
    if size >= TITLE_LEAST_PT:  # else each kept at its size and broken (smaller and broken reads worse)
        for ax in axes:
            ax.title.set_fontsize(min(size, ax.title.get_fontsize()))
    for ax in axes:
        title, room = ax.title, ax.get_window_extent().width
        if title.get_window_extent().width <= room:
            continue
        lines = []
        for given in title.get_text().split("\n"):
            line = ""
            for part in re.findall(r"[^_ ]+[_ ]?|[_ ]", given):  # pieces, each keeping its underscore or space
                title.set_text((line + part).rstrip())
                if line and title.get_window_extent().width > room:
                    lines.append(line.rstrip())
                    line = part
                else:
                    line += part
            lines.append(line.rstrip())
        title.set_text("\n".join(lines))


def _alpha_panel(ax, points: pd.DataFrame, name: str, *, small: bool = False) -> None:
    """One run's alphas; a `small` panel (about 1 in) has 8 pt text, smaller dots and 3 x ticks."""
    ax.set_title(name, fontsize=8 if small else None)
    ax.set_ylim(0.45, 1.55)  # alpha lies in [0.5, 1.5]
    n_layers = int(points["layer"].max()) + 1
    if points["step"].nunique() == 1:
        ax.plot(points["layer"], points["alpha"], marker="o", markersize=3 if small else None,
                color=SCHEDULE_COLORS.get(points["schedule"].iloc[0], "tab:gray"))
        # a static schedule's alphas are the same at every step (short: 'layer (set by the schedule)'
        # was wider than a panel of three beside the colour bar, and the labels went under the figure)
        static = points["schedule"].iloc[0] != "learned"
        ax.set_xlabel("layer (at every step)" if static else f"layer (step {points['step'].iloc[0]})")
        ax.xaxis.set_major_locator(MaxNLocator(3 if small else "auto", integer=True, steps=ROUND_STEPS))
    else:
        cmap = colormaps["viridis"]
        for layer, line in points.groupby("layer"):
            ax.plot(line["step"], line["alpha"], color=cmap(layer / max(n_layers - 1, 1)))
        ax.set_xlabel("training step")
        if small:  # 0, 5000 and 10000 ran into each other in a 1 in panel
            ax.xaxis.set_major_locator(MaxNLocator(3, steps=ROUND_STEPS))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v else "0"))


@styled
def coverage(path: str | Path, *, base: str = "fib", schedules: tuple[str, ...] = ("fixed", "stagger"),
             window: int = 8, n_layers: int = 16, seq_len: int = 1024, n_rungs: int = 15) -> Path:
    """The distances each layer attends to, one panel per schedule: the picture of staggering.
    Grey: the local window; rungs coloured by the layer's alpha."""
    check_path(path)
    # the lengths and windows `fibctl coverage` takes: a model of that length could train so
    check_length(seq_len)
    for schedule in schedules:
        ModelConfig(schedule=schedule, base=base, window=window, n_layers=n_layers, n_rungs=n_rungs,
                    seq_len=seq_len).validate().check_window()
    # a row per layer and a dot per distance: past these the figure is unreadable (and slow to draw)
    if n_layers > COVERAGE_FIGURE_MAX_LAYERS or window > COVERAGE_FIGURE_MAX_WINDOW:
        raise FibctlError(f"the coverage figure draws at most {COVERAGE_FIGURE_MAX_LAYERS} layers and a window of "
                          f"{COVERAGE_FIGURE_MAX_WINDOW:,} (got {n_layers} and {window}); `fibctl coverage` counts them")
    # a sparse layer draws its window and rungs; a dense one a dot per distance up to T
    reach = seq_len if "dense" in schedules else min(window + 1, seq_len) + n_rungs
    if n_layers * reach > COVERAGE_FIGURE_MAX_DOTS:
        raise FibctlError(f"the coverage figure draws at most {COVERAGE_FIGURE_MAX_DOTS:,} dots a panel "
                          f"(got {n_layers} layers x {reach:,} distances); `fibctl coverage` counts them")
    fig = _figure(TEXT_WIDTH if len(schedules) > 1 else COLUMN_WIDTH + 1, 0.2 * n_layers + 1.6)
    axes = fig.subplots(1, len(schedules), sharey=True, squeeze=False).ravel()
    cmap = colormaps["viridis"]
    decades = [10 ** k for k in range(len(str(seq_len - 1)))]
    ticks = [0] + decades
    for ax, schedule in zip(axes, schedules):
        per_layer = attended_distances(base, schedule, window, n_layers, seq_len, n_rungs)
        alpha_of = layer_alphas(schedule, n_layers)
        _, union = coverage_counts(per_layer)
        for layer, distances in enumerate(per_layer):
            near = [d for d in distances if d <= window]
            far = [d for d in distances if d > window]
            ax.scatter(near, [layer] * len(near), s=7, color="0.6", linewidths=0)
            ax.scatter(far, [layer] * len(far), s=9, linewidths=0,
                       color=cmap((alpha_of[layer] - 0.5) / 1.0), marker="|" if len(far) > 200 else "o")
        ax.set_xscale("symlog", linthresh=1)  # linear below 1 so that distance 0 shows
        ax.set_xticks(ticks, labels=[f"{t:,}" for t in ticks])
        ax.set_xlim(-0.3, seq_len * 1.25)  # room for the farthest dot
        ax.set_title(f"{base} {schedule}\n{union} distinct distances")  # two lines: three panels fit
        ax.grid(axis="y", visible=False)
    # one label under every panel: a label per panel runs into its neighbours' from four panels on
    (fig.supxlabel if len(axes) > 1 else axes[0].set_xlabel)("attended distance (tokens)")
    axes[0].set_ylabel("layer")
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylim(n_layers - 0.5, -0.5)  # layer 0 on top
    bar = fig.colorbar(ScalarMappable(Normalize(0.5, 1.5), cmap), ax=axes.tolist(), label="\u03b1 of the rungs",
                       shrink=0.8)
    bar.set_ticks(ALPHA_TICKS)  # its ends ticked (0.6 to 1.4 left stagger's first and last layers without)
    _title(fig, f"Distances each layer attends to (W={window}, T={seq_len}; grey: the local window)")
    _fit_titles(fig, axes)
    # a title broken onto more lines than its two takes its room from the figure, not from the
    # panels (the colour bar beside four 4-layer panels grew shorter than its label)
    extra = max(ax.get_title().count("\n") for ax in axes) - 1
    fig.set_figheight(fig.get_figheight() + extra * 1.2 * STYLE["axes.titlesize"] / 72)
    _label_decades(fig, axes, decades)
    return _save(fig, path)


def _label_decades(fig: Figure, axes, decades: list[int]) -> None:
    """Coverage's distance axes ticked at 0 and each decade, labelled at 0 and every decade
    while the labels stand apart, else at every other one (every third, ...) down from the
    largest, the others ticked unlabelled: four panels at T=1024 ran 100 and 1000 together
    ('1001000')."""
    gap = 2 * fig.dpi / 72  # 2 pt between neighbouring labels
    for every in range(1, len(decades) + 1):
        labelled = [0] + sorted(decades[::-every])
        for ax in axes:
            ax.set_xticks(labelled, labels=[f"{t:,}" for t in labelled])
            ax.set_xticks([d for d in decades if d not in labelled], minor=True)
        fig.draw_without_rendering()  # the labels where the saved figure has them
        boxes = [label.get_window_extent() for label in axes[0].get_xticklabels()]
        if all(a.x1 + gap <= b.x0 for a, b in zip(boxes, boxes[1:])):
            return


def preset_in_use(engine: Engine) -> str:
    """The preset most runs use (whose shape `report all` draws coverage for); else 'paper'."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT preset, COUNT(*) AS n FROM runs GROUP BY preset ORDER BY n DESC")).all()
    return next((preset for preset, _ in rows if preset in PRESETS), "paper")


FIGURES = {"extrapolation": extrapolation, "posloss": posloss, "curves": curves, "alphas": alphas,
           "coverage": coverage}
