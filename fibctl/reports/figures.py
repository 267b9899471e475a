"""The study's figures, drawn with matplotlib's object API (no pyplot: no display needed).

Each function reads the database by SQL (or, for coverage, the attention schedule itself),
writes a PNG or PDF chosen by the file's extension, and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from sqlalchemy import text
from sqlalchemy.engine import Engine

from fibctl.schedules import attended_distances, coverage as coverage_counts
from fibctl.config import PRESETS
from fibctl.errors import FibctlError
from fibctl.reports.tables import (
    dataset_label, default_dataset, in_matrix, matrix_clause, matrix_params, read_sql, table3, table4,
)

FIGURE_SUFFIXES = (".png", ".pdf")


def check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FIGURE_SUFFIXES:
        raise FibctlError(f"{path}: figures are written as PNG or PDF; name the file .png or .pdf")
    return path


def _save(fig: Figure, path: str | Path) -> Path:
    path = check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return path


def extrapolation(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int = 42,
                  matrix: str | None = None) -> Path:
    """Perplexity vs evaluation length, one line per run, the dense baseline highlighted."""
    check_path(path)
    table = table3(engine, dataset=dataset, seed=seed, matrix=matrix, all_runs=True)
    frame = table.frame
    lengths = [c for c in frame.columns if c.isdigit()]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for _, row in frame.iterrows():
        points = [(int(n), row[n]) for n in lengths if pd.notna(row[n])]
        dense = row["Schedule"] == "dense"
        ax.plot(*zip(*points), marker="o", label=f"{row['Run']}" + (" (dense)" if dense else ""),
                color="black" if dense else None, linewidth=3 if dense else 1.2, zorder=3 if dense else 2)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(n) for n in lengths], labels=lengths)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(table.title.replace("Table 3: ", ""))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, path)


def posloss(engine: Engine, path: str | Path, *, dataset: str | None = None, window: int = 8,
            seed: int = 42, matrix: str | None = None) -> Path:
    """Loss by position bin for fib fixed and stagger at window W, and the gap between them."""
    check_path(path)
    table = table4(engine, dataset=dataset, window=window, seed=seed, matrix=matrix)
    frame = table.frame.set_index("Row")
    bins = [c for c in frame.columns if c != "Run"]
    fig = Figure(figsize=(7, 5))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for row in frame.index[:2]:
        top.plot(bins, frame.loc[row, bins].astype(float), marker="o", label=f"{row} ({frame.loc[row, 'Run']})")
    top.set_ylabel("mean loss (nats)")
    top.set_title(table.title.replace("Table 4: ", ""))
    top.legend(fontsize=8)
    bottom.bar(bins, frame.loc["gap", bins].astype(float), color="tab:gray")
    bottom.axhline(0, color="black", linewidth=0.8)
    bottom.set_ylabel("gap (fixed - stagger)")
    bottom.set_xlabel("predicted position")
    bottom.tick_params(axis="x", labelrotation=30)
    return _save(fig, path)


def curves(engine: Engine, path: str | Path, *, dataset: str | None = None, seed: int | None = None,
           matrix: str | None = None) -> Path:
    """Validation perplexity at the training length vs step, one line per run."""
    check_path(path)
    dataset = dataset or default_dataset(engine)
    seed_clause = "\n  AND r.seed = :seed" if seed is not None else ""
    sql = f"""SELECT r.name AS run, r.schedule, e.step, e.ppl
FROM evaluations e
JOIN runs r ON r.id = e.run_id
WHERE e.dataset = :dataset AND e.eval_length = r.train_length{seed_clause}{matrix_clause(matrix)}
ORDER BY r.name, e.step"""
    params = matrix_params(matrix, dataset=dataset, **({"seed": seed} if seed is not None else {}))
    long, _ = read_sql(engine, sql, **params)
    if long.empty:
        raise FibctlError(f"curves: no evaluations on {dataset}{in_matrix(matrix)}; runs record "
                          "them every eval_interval steps while training (`fibctl train`)")
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for run, points in long.groupby("run", sort=True):
        dense = points["schedule"].iloc[0] == "dense"
        ax.plot(points["step"], points["ppl"], label=run, color="black" if dense else None,
                linewidth=2.5 if dense else 1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{dataset_label(dataset)} perplexity")
    ax.set_title(f"Validation perplexity during training ({dataset_label(dataset)})")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), ncol=1 + len(long["run"].unique()) // 25)
    return _save(fig, path)


def alphas(engine: Engine, path: str | Path, *, run: str | None = None, matrix: str | None = None) -> Path:
    """Alpha of every layer: learned runs over training, static schedules (recorded once) by layer."""
    check_path(path)
    run_clause = "\n  AND r.name = :run" if run else ""
    sql = f"""SELECT r.name AS run, a.step, a.layer, a.alpha
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
    fig = Figure(figsize=(3.6 * ncols, 2.8 * math.ceil(len(runs) / ncols)))
    axes = fig.subplots(math.ceil(len(runs) / ncols), ncols, squeeze=False).ravel()
    for ax, name in zip(axes, runs):
        _alpha_panel(ax, long[long["run"] == name], name)
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    fig.tight_layout()
    return _save(fig, path)


def _alpha_panel(ax, points: pd.DataFrame, name: str) -> None:
    ax.set_title(name, fontsize=8)
    ax.set_ylim(0.45, 1.55)  # alpha lies in [0.5, 1.5]
    if points["step"].nunique() == 1:
        ax.plot(points["layer"], points["alpha"], marker="o")
        ax.set_xlabel(f"layer (step {points['step'].iloc[0]})")
    else:
        cmap = colormaps["viridis"]
        n_layers = points["layer"].max() + 1
        for layer, line in points.groupby("layer"):
            ax.plot(line["step"], line["alpha"], color=cmap(layer / max(n_layers - 1, 1)),
                    label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.legend(fontsize=5, ncol=2)
    ax.set_ylabel("alpha")


def coverage(path: str | Path, *, base: str = "fib", schedules: tuple[str, ...] = ("fixed", "stagger"),
             window: int = 8, n_layers: int = 16, seq_len: int = 1024, n_rungs: int = 15) -> Path:
    """The distances each layer attends to, one panel per schedule: the picture of staggering."""
    check_path(path)
    fig = Figure(figsize=(4.5 * len(schedules), 0.25 * n_layers + 2))
    axes = fig.subplots(1, len(schedules), sharey=True, squeeze=False).ravel()
    for ax, schedule in zip(axes, schedules):
        per_layer = attended_distances(base, schedule, window, n_layers, seq_len, n_rungs)
        _, union = coverage_counts(per_layer)
        for layer, distances in enumerate(per_layer):
            ax.scatter(distances, [layer] * len(distances), s=6, marker="|" if len(distances) > 200 else "o")
        ax.set_xscale("symlog", linthresh=1)  # linear below 1 so that distance 0 shows
        ticks = [0] + [10 ** k for k in range(len(str(seq_len - 1)))]
        ax.set_xticks(ticks, labels=[str(t) for t in ticks])
        ax.set_xlim(-0.3, seq_len)
        ax.set_xlabel("attended distance")
        ax.set_title(f"{base} {schedule} W{window}, T={seq_len}: {union} distinct", fontsize=9)
    axes[0].set_ylabel("layer")
    axes[0].invert_yaxis()
    return _save(fig, path)


def preset_in_use(engine: Engine) -> str:
    """The preset most runs use (whose shape `report all` draws coverage for); else 'paper'."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT preset, COUNT(*) AS n FROM runs GROUP BY preset ORDER BY n DESC")).all()
    return next((preset for preset, _ in rows if preset in PRESETS), "paper")


FIGURES = {"extrapolation": extrapolation, "posloss": posloss, "curves": curves, "alphas": alphas,
           "coverage": coverage}
