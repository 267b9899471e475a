"""The study's figures, drawn with matplotlib's object API (no pyplot: no display needed).

Each function reads the database by SQL (or, for coverage, the attention schedule itself),
writes a PNG or PDF chosen by the file's extension, and returns the path. One visual
language runs through all of them: colour is the schedule, line style the base (fib solid,
pow2 dashed), marker the window W; fonts are embedded as TrueType (venues reject Type 3) and
no text is smaller than 8 pt.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from fibctl.lazy import pandas as pd
from sqlalchemy import text
from sqlalchemy.engine import Engine

from fibctl.config import DEFAULT_SEED, PRESETS, SCHEDULES
from fibctl.errors import FibctlError
from fibctl.reports.tables import (
    dataset_label, default_dataset, in_matrix, matrix_clause, matrix_params, read_sql, table3, table4,
)
from fibctl.schedules import attended_distances, coverage as coverage_counts, layer_alphas

FIGURE_SUFFIXES = (".png", ".pdf")
COVERAGE_FIGURE_MAX_LAYERS = 128
COVERAGE_FIGURE_MAX_WINDOW = 4096
COVERAGE_FIGURE_MAX_DOTS = 2**21  # layers x length where a panel is dense (a dot per distance)
STYLE = {
    "pdf.fonttype": 42, "ps.fonttype": 42,  # TrueType, not Type 3: accepted by venues
    "font.size": 9, "axes.titlesize": 9, "axes.labelsize": 9, "legend.fontsize": 8,
    "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.alpha": 0.25, "savefig.dpi": 200,
}
# colour = schedule, in the config's order; dense is black, the baseline everything is read against
_PALETTE = ("black", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")
SCHEDULE_COLORS = dict(zip(SCHEDULES, _PALETTE))
BASE_STYLES = {"fib": "-", "pow2": "--"}
WINDOW_MARKERS = {6: "v", 8: "o", 10: "s", 12: "D"}


def check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise FibctlError(f"{path}: figures are written as PNG or PDF; name the file .png or .pdf")
    return path


def _load_matplotlib() -> None:
    """matplotlib loads when a figure is drawn, not whenever the CLI starts."""
    global colormaps, rc_context, ScalarMappable, Normalize, Figure
    global FixedLocator, FuncFormatter, MaxNLocator, NullFormatter
    from matplotlib import colormaps, rc_context
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter


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
    path = check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    return path


def run_style(schedule: str, base, window) -> dict:
    """Line properties of a run: colour by schedule, line style by base, marker by W."""
    dense = schedule == "dense"
    return dict(color=SCHEDULE_COLORS.get(schedule, "tab:gray"),
                linestyle="-" if dense else BASE_STYLES.get(base, ":"),
                marker="*" if dense else WINDOW_MARKERS.get(int(window) if pd.notna(window) else -1, "^"),
                linewidth=2.2 if dense else 1.3, markersize=6 if dense else 4.5, zorder=3 if dense else 2)


def run_label(run: str, schedule: str) -> str:
    return "dense" if schedule == "dense" and "dense" in run else run


def _plain_log_axis(axis) -> None:
    """A log axis (call after plotting) whose ticks read as plain numbers (20, 50, 100), not
    2x10^1, dense enough to read values off even when the data span less than a decade."""
    lo, hi = axis.get_view_interval()
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 8), (1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in mantissas if lo <= m * 10 ** e <= hi]
        if len(ticks) >= 4:
            break
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _runs_legend(source, target) -> None:
    """The runs labelled on `source`, as a legend outside `target` on the right (in columns
    when there are many runs)."""
    handles, labels = source.get_legend_handles_labels()
    target.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1), ncol=1 + len(labels) // 14,
                  frameon=False)


def _train_lengths(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT name, train_length FROM runs")).all())


@styled
def extrapolation(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int = DEFAULT_SEED,
                  matrix: str | None = None) -> Path:
    """Perplexity vs evaluation length (left) and its change from the training length in
    percent (right, symmetric-log so that 1 % and 100 % both read), one line per run."""
    check_path(path)
    dataset = dataset or default_dataset(engine)
    table = table3(engine, dataset=dataset, seed=seed, matrix=matrix, all_runs=True)
    frame = table.frame.rename(columns={"Run": "run", "Base": "base", "Schedule": "schedule", "W": "window"})
    frame["base"] = frame["base"].replace("-", None)
    lengths = [c for c in frame.columns if c.isdigit()]
    trained = _train_lengths(engine)
    fig = _figure(9.5, 4)
    left, right = fig.subplots(1, 2)
    for _, row in frame.iterrows():
        points = [(int(n), float(row[n])) for n in lengths if pd.notna(row[n])]
        style = run_style(row["schedule"], row["base"], row["window"])
        x, y = zip(*points)
        left.plot(x, y, label=run_label(row["run"], row["schedule"]), **style)
        ref = dict(points).get(trained.get(row["run"]), y[0])  # the training length, else the shortest
        right.plot(x, [(v / ref - 1) * 100 for v in y], **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(n) for n in lengths], labels=lengths)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("evaluation length (tokens)")
    left.set_yscale("log")
    _plain_log_axis(left.yaxis)
    left.set_ylabel(f"{dataset_label(dataset)} perplexity")
    right.set_yscale("symlog", linthresh=2)
    right.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:+g} %" if v else "0"))
    right.axhline(0, color="black", linewidth=0.6)
    right.set_ylabel("change from the training length")
    fig.suptitle(table.title.replace("Table 3: ", ""))
    _runs_legend(left, right)
    return _save(fig, path)


@styled
def posloss(engine: Engine, path: str | Path, *, dataset: str | None = None, window: int = 8,
            seed: int = DEFAULT_SEED, matrix: str | None = None) -> Path:
    """Loss by position bin for fib fixed and stagger at window W, and the gap between them."""
    check_path(path)
    table = table4(engine, dataset=dataset, window=window, seed=seed, matrix=matrix)
    frame = table.frame.set_index("Row")
    bins = [c for c in frame.columns if c != "Run"]
    fig = _figure(7, 5)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for row in frame.index[:2]:
        top.plot(bins, frame.loc[row, bins].astype(float), label=f"{row} ({frame.loc[row, 'Run']})",
                 **run_style(row.split()[0], "fib", window))
    top.set_ylabel("mean loss (nats)")
    top.set_title(table.title.replace("Table 4: ", ""))
    top.legend(frameon=False)
    gap = frame.loc["gap", bins].astype(float)
    bottom.bar(bins, gap, color=["tab:green" if g > 0 else "tab:red" for g in gap])
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel("fixed - stagger\n(green: stagger lower)")
    bottom.set_xlabel("predicted position")
    bottom.tick_params(axis="x", labelrotation=30)
    return _save(fig, path)


@styled
def curves(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int | None = None,
           matrix: str | None = None) -> Path:
    """Validation perplexity at the training length vs step (left; one line per run and token
    budget, since the light and full evaluations score different documents) and training loss
    (right)."""
    check_path(path)
    dataset = dataset or default_dataset(engine)
    seed_clause = "\n  AND r.seed = :seed" if seed is not None else ""
    where = f"{seed_clause}{matrix_clause(matrix)}"
    params = matrix_params(matrix, dataset=dataset, **({"seed": seed} if seed is not None else {}))
    sql = f"""SELECT r.name AS run, r.schedule, r.base, r."window" AS "window", e.step, e.tokens, e.ppl
FROM evaluations e
JOIN runs r ON r.id = e.run_id
WHERE e.dataset = :dataset AND e.eval_length = r.train_length{where}
ORDER BY r.name, e.step"""
    long, _ = read_sql(engine, sql, **params)
    if long.empty:
        raise FibctlError(f"curves: no evaluations on {dataset}{in_matrix(matrix)}; runs record "
                          "them every eval_interval steps while training (`fibctl train`)")
    params.pop("dataset")
    steps, _ = read_sql(engine, f"""SELECT r.name AS run, t.step, t.loss
FROM train_steps t
JOIN runs r ON r.id = t.run_id
WHERE 1 = 1{where}
ORDER BY r.name, t.step""", **params)
    fig = _figure(10, 4)
    left, right = fig.subplots(1, 2)
    long["tokens"] = long["tokens"].fillna(-1)
    light_shown = False
    for run, points in long.groupby("run", sort=True):
        first = points.iloc[0]
        style = run_style(first["schedule"], first["base"], first["window"])
        budgets = sorted(points["tokens"].unique())
        for tokens in budgets:  # the largest budget is the full evaluation
            line = points[points["tokens"] == tokens]
            full = tokens == budgets[-1]
            left.plot(line["step"], line["ppl"], label=run_label(run, first["schedule"]) if full else None,
                      **(style if full else {**style, "linewidth": 0.8, "alpha": 0.5, "markersize": 2.5}))
            light_shown |= not full
        mine = steps[steps["run"] == run]
        if not mine.empty:  # raw values faint, an exponential moving average on top
            right.plot(mine["step"], mine["loss"], color=style["color"], linewidth=0.6, alpha=0.25)
            right.plot(mine["step"], mine["loss"].ewm(alpha=0.1).mean(), color=style["color"],
                       linestyle=style["linestyle"], linewidth=1.2)
    left.set_yscale("log")
    _plain_log_axis(left.yaxis)
    left.set_xlabel("step")
    left.set_ylabel(f"{dataset_label(dataset)} perplexity")
    left.set_title("validation" + (" (thin: light budget)" if light_shown else ""))
    right.set_xlabel("step")
    right.set_ylabel("training loss (nats)")
    right.set_title("training (line: moving average)")
    if steps.empty:
        right.text(0.5, 0.5, "no training steps recorded", ha="center", va="center", transform=right.transAxes)
    fig.suptitle(f"Training curves ({dataset_label(dataset)})")
    _runs_legend(left, right)
    return _save(fig, path)


@styled
def alphas(engine: Engine, path: str | Path, *, run: str | None = None, matrix: str | None = None) -> Path:
    """Alpha of every layer: learned runs over training, static schedules (recorded once) by layer."""
    check_path(path)
    run_clause = "\n  AND r.name = :run" if run else ""
    sql = f"""SELECT r.name AS run, r.schedule, a.step, a.layer, a.alpha
FROM alphas a
JOIN runs r ON r.id = a.run_id
WHERE r.schedule <> 'dense'{run_clause}{matrix_clause(matrix)}
ORDER BY r.name, a.layer, a.step"""
    long, _ = read_sql(engine, sql, **matrix_params(matrix, **({"run": run} if run else {})))
    if long.empty:
        what = f"run {run!r}" if run else f"sparse runs{in_matrix(matrix)}"
        raise FibctlError(f"alphas: no alphas recorded for {what}; runs record them while "
                          "training (`fibctl train`)")
    runs = sorted(long["run"].unique())
    ncols = min(4, len(runs))
    fig = _figure(3.2 * ncols, 2.6 * math.ceil(len(runs) / ncols))
    axes = fig.subplots(math.ceil(len(runs) / ncols), ncols, squeeze=False).ravel()
    for ax, name in zip(axes, runs):
        _alpha_panel(ax, long[long["run"] == name], name)
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    return _save(fig, path)


def _alpha_panel(ax, points: pd.DataFrame, name: str) -> None:
    ax.set_title(name)
    ax.set_ylim(0.45, 1.55)  # alpha lies in [0.5, 1.5]
    n_layers = int(points["layer"].max()) + 1
    if points["step"].nunique() == 1:
        ax.plot(points["layer"], points["alpha"], marker="o",
                color=SCHEDULE_COLORS.get(points["schedule"].iloc[0], "tab:gray"))
        ax.set_xlabel(f"layer (step {points['step'].iloc[0]})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        cmap = colormaps["viridis"]
        for layer, line in points.groupby("layer"):
            ax.plot(line["step"], line["alpha"], color=cmap(layer / max(n_layers - 1, 1)), label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.legend(ncol=2 if n_layers > 4 else 1, frameon=False)
    ax.set_ylabel("alpha")


@styled
def coverage(path: str | Path, *, base: str = "fib", schedules: tuple[str, ...] = ("fixed", "stagger"),
             window: int = 8, n_layers: int = 16, seq_len: int = 1024, n_rungs: int = 15) -> Path:
    """The distances each layer attends to, one panel per schedule: the picture of staggering.
    Grey: the local window; rungs coloured by the layer's alpha."""
    check_path(path)
    # a row per layer and a dot per distance: past these the figure is unreadable (and slow to draw)
    if n_layers > COVERAGE_FIGURE_MAX_LAYERS or window > COVERAGE_FIGURE_MAX_WINDOW:
        raise FibctlError(f"the coverage figure draws at most {COVERAGE_FIGURE_MAX_LAYERS} layers and a window of "
                          f"{COVERAGE_FIGURE_MAX_WINDOW:,} (got {n_layers} and {window}); `fibctl coverage` counts them")
    # a sparse layer draws its window and rungs; a dense one a dot per distance up to T
    reach = seq_len if "dense" in schedules else min(window + 1, seq_len) + n_rungs
    if n_layers * reach > COVERAGE_FIGURE_MAX_DOTS:
        raise FibctlError(f"the coverage figure draws at most {COVERAGE_FIGURE_MAX_DOTS:,} dots a panel "
                          f"(got {n_layers} layers x {reach:,} distances); `fibctl coverage` counts them")
    fig = _figure(4.2 * len(schedules) + 0.8, 0.22 * n_layers + 1.8)
    axes = fig.subplots(1, len(schedules), sharey=True, squeeze=False).ravel()
    cmap = colormaps["viridis"]
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
        ticks = [0] + [10 ** k for k in range(len(str(seq_len - 1)))]
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.set_xlim(-0.3, seq_len * 1.25)  # room for the farthest dot
        ax.set_xlabel("attended distance")
        ax.set_title(f"{base} {schedule} W{window}, T={seq_len}: {union} distinct")
        ax.grid(axis="y", visible=False)
    axes[0].set_ylabel("layer")
    axes[0].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylim(n_layers - 0.5, -0.5)  # layer 0 on top
    fig.colorbar(ScalarMappable(Normalize(0.5, 1.5), cmap), ax=axes.tolist(), label="alpha of the layer (rungs)",
                 shrink=0.8)
    return _save(fig, path)


def preset_in_use(engine: Engine) -> str:
    """The preset most runs use (whose shape `report all` draws coverage for); else 'paper'."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT preset, COUNT(*) AS n FROM runs GROUP BY preset ORDER BY n DESC")).all()
    return next((preset for preset, _ in rows if preset in PRESETS), "paper")


FIGURES = {"extrapolation": extrapolation, "posloss": posloss, "curves": curves, "alphas": alphas,
           "coverage": coverage}
