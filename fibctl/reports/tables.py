"""The study's tables (docs/method.md, "The five tables"), each computed by SQL from the results database.

A table function takes an engine and returns a `Table`: the DataFrame, the SQL that
produced its numbers (with the values bound, so it can be pasted into `fibctl sql`), and
how to format and which cells to bold. Runs are chosen by what they are (base, schedule,
window, seed), never by name (a user narrows them by name with --only); each run is read at
its final step.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fibctl.lazy import pandas as pd
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine

from fibctl.config import DEFAULT_SEED, BASES, SAMPLERS, SCHEDULES, differing, flatten
from fibctl.db.schema import NUMBERS
from fibctl.errors import FibctlError
from fibctl.schedules import deviations

DATASET_LABELS = {
    "tinystories_val": "TinyStories", "math_val": "Math",
    "fineweb_edu_val": "FineWeb-Edu", "wikipedia_val": "Wikipedia",
}
SCHEDULE_ORDER = SCHEDULES  # the paper's order: dense, fixed, learned, stagger, coprime
BASE_ORDER = BASES
# Table 3's rows in the paper: (base, schedule, window)
TABLE3_ROWS = (
    (None, "dense", None), ("fib", "stagger", 12), ("fib", "stagger", 8), ("fib", "coprime", 12),
    ("fib", "fixed", 8), ("fib", "learned", 8), ("pow2", "fixed", 8),
)
N_BINS = 8  # Table 4: edges linspace(0, n_positions, 9) as integers

FINAL_STEP = """final AS (
    -- each run's final step: runs.final_step, else its last evaluation at the training length
    SELECT r.id AS run_id,
           COALESCE(r.final_step, (SELECT MAX(e.step) FROM evaluations e
                                   WHERE e.run_id = r.id AND e.eval_length = r.train_length)) AS step
    FROM runs r
)"""

# beside a value read at the final step: the most tokens this run was measured on at that set
# and length, at any step (a final step measured only lightly reads fewer: said in a note)
MOST_TOKENS = """(SELECT MAX(e2.tokens) FROM evaluations e2
        WHERE e2.run_id = e.run_id AND e2.dataset = e.dataset AND e2.eval_length = e.eval_length) AS most_tokens"""

Formatter = Callable[[float], str]


def ppl(x: float) -> str:
    return f"{x:.2f}"


def loss(x: float) -> str:
    """A loss as every command shows it, a training step's included (`status`, `queue show`,
    `compare`, the progress line): 3 decimals, as nanoGPT's log line. One step's loss is one
    batch's and moves in its second decimal from step to step, so a fourth would be noise."""
    return f"{x:.3f}"


def length_label(n: int) -> str:
    """A sequence length as a header or label: 1024, as papers write lengths (no thousands
    separator), in every table, `compare` and `queue show` alike."""
    return str(int(n))


def percent(x: float) -> str:
    return f"{x:+.0f} %" if abs(x) >= 100 else f"{x:+.1f} %"


@dataclass
class Table:
    name: str
    title: str
    frame: pd.DataFrame
    sql: str
    formats: dict[str, Formatter] = field(default_factory=dict)  # column -> formatter
    best: dict[str, str] = field(default_factory=dict)  # column -> "min" | "max": bolded
    notes: list[str] = field(default_factory=list)  # printed under the table, e.g. deviations
    key: int = 1  # the leading columns that name a row (Table 5's base, schedule and W), in every part


def dataset_label(name: str) -> str:
    return DATASET_LABELS.get(name, name)


def datasets(engine: Engine) -> list[str]:
    """Held-out sets with evaluations, in report order."""
    with engine.connect() as conn:
        present = {row[0] for row in conn.execute(text("SELECT DISTINCT dataset FROM evaluations"))}
    return ordered_datasets(present)


def ordered_datasets(names) -> list[str]:
    """The paper's four first, in its order, then any others alphabetically."""
    present = set(names)
    return [d for d in DATASET_LABELS if d in present] + sorted(present - DATASET_LABELS.keys())


def default_dataset(engine: Engine) -> str:
    found = datasets(engine)
    if not found:
        raise FibctlError("the database has no evaluations; evaluate runs (`fibctl eval NAME`) "
                          "or import the study (`fibctl import-study fib.db`)")
    return "fineweb_edu_val" if "fineweb_edu_val" in found else found[0]


def _bound(params: dict) -> list:
    """Bound parameters of `params`; a tuple is a list of values (`IN :names`)."""
    return [bindparam(k, list(v), expanding=True) if isinstance(v, tuple) else bindparam(k, v)
            for k, v in params.items()]


def read_sql(engine: Engine, sql: str, **params) -> tuple[pd.DataFrame, str]:
    """The rows of `sql` and its text with the values bound (what --show-sql prints). A column
    named after a number column of the schema (ppl, loss, ...) is read as that column is: a
    perplexity stored as the text 'inf' is inf, not a string (fibctl/db/stored.py). A tuple is
    a list of values (`IN :names`)."""
    query = text(sql).bindparams(*_bound(params)).columns(**NUMBERS)
    with engine.connect() as conn:
        frame = pd.read_sql(query, conn)
    literal = query.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True})
    return frame, str(literal).strip() + ";"


@dataclass(frozen=True)
class Runs:
    """The runs a table or figure reads: those of `matrix` whose names match the glob `only`
    (either None: no restriction). The glob is matched here, case-sensitively as `queue add
    --only`, and the names bound into the SQL, which then reads the same on SQLite and
    PostgreSQL (their LIKE differ in case) and runs as printed by --show-sql."""

    matrix: str | None = None
    only: str | None = None
    names: tuple[str, ...] | None = None

    def clause(self) -> str:
        return (("\n  AND r.matrix = :matrix" if self.matrix else "")
                + ("\n  AND r.name IN :only_names" if self.names is not None else ""))

    def params(self, **params) -> dict:
        return {**params, **({"matrix": self.matrix} if self.matrix else {}),
                **({"only_names": self.names} if self.names is not None else {})}

    def bound(self) -> list:
        """`params()` bound, for a statement read_sql does not run."""
        return _bound(self.params())

    def said(self) -> str:
        return ((f" in matrix {self.matrix!r}" if self.matrix else "")
                + (f" named {self.only!r}" if self.only is not None else ""))


def pick_runs(engine: Engine, matrix: str | None = None, only: str | None = None) -> Runs:
    """`Runs` with the glob matched against the database's run names; a glob that matches no
    run is an error (a typo would otherwise read as "no data")."""
    if only is None:
        return Runs(matrix)
    with engine.connect() as conn:
        names = tuple(n for n in conn.execute(text("SELECT name FROM runs ORDER BY name")).scalars()
                      if fnmatch.fnmatchcase(n, only))
    if not names:
        raise FibctlError(f"--only {only!r} matches no run in the database (`fibctl queue ls` lists them)")
    return Runs(matrix, only, names)


def deviation_notes(engine: Engine, runs) -> list[str]:
    """A note per deliberate deviation from the study among these runs: an optimizer that ran
    in place of the configured one (an `adamw8bit` run on a machine without CUDA or
    bitsandbytes trains with `adamw`), and a schedule the study's code does not define at
    that depth (coprime at L = 3, 4, 6)."""
    names = set(runs)
    if not names:
        return []
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, optimizer, config_json FROM runs")).all()
    swapped: dict[tuple[str, str], list[str]] = {}
    defined: dict[str, list[str]] = {}
    for name, used, config_json in rows:
        if name not in names:
            continue
        try:
            config = json.loads(config_json)
            asked = config["train"].get("optimizer", "adamw")
            model = config["model"]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue
        if used is not None and asked != used:
            swapped.setdefault((asked, used), []).append(name)
        for note in deviations(model.get("schedule", ""), model.get("n_layers", 0)):
            defined.setdefault(note, []).append(name)
    return ([f"Deviation: {', '.join(sorted(who))} trained with {used}, not {asked} as configured."
             for (asked, used), who in sorted(swapped.items())]
            + [f"Deviation: {', '.join(sorted(who))}: {note}." for note, who in sorted(defined.items())])


# a run whose sampler is not recorded: a fibctl run trained before revision 0009
UNRECORDED_SAMPLER = "not recorded, trained before fibctl kept it"


def sampler_notes(engine: Engine, runs) -> list[str]:
    """A note where these runs' windows were drawn by different samplers (runs.sampler: a run
    resumed from a checkpoint of torch's generator keeps it, fibctl.config.SAMPLERS): runs of
    one seed then read other windows, which no setting shows. A probe run draws no windows; a
    run never claimed has drawn none yet."""
    names = set(runs)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, preset, sampler, started_at FROM runs")).all()
    drawn = {name: {"sampler": _sampler_said(sampler)} for name, preset, sampler, started_at in rows
             if name in names and preset != "probe" and (sampler is not None or started_at is not None)}
    if len({d["sampler"] for d in drawn.values()}) < 2:
        return []
    return [f"Windows drawn by different samplers, so that runs of one seed read other windows: "
            f"{_by_value(drawn, 'sampler')}."]


def _sampler_said(sampler) -> str:
    """runs.sampler as a note says it; a value edited by hand as it is, a str (a BLOB was a
    TypeError traceback where the note's join took it for JSON)."""
    if sampler is None:
        return UNRECORDED_SAMPLER
    return SAMPLERS.get(sampler, sampler) if isinstance(sampler, str) else str(sampler)


def unfinished_notes(engine: Engine, runs) -> list[str]:
    """A note naming the runs read before they finished: with no final step recorded (queued
    again after a stop, running, failed), a run's numbers are its latest evaluation's at the
    training length (FINAL_STEP), which a sweep in progress should not pass off as final."""
    names = set(runs)
    if not names:
        return []
    frame, _ = read_sql(engine, """SELECT r.name, r.status, MAX(e.step) AS step FROM runs r
JOIN evaluations e ON e.run_id = r.id AND e.eval_length = r.train_length
WHERE r.final_step IS NULL AND r.status <> 'done' GROUP BY r.name, r.status""")
    read = [f"{row.name} ({row.status}, step {int(row.step):,})" for row in frame.itertuples() if row.name in names]
    return [f"Not finished: {', '.join(sorted(read))}: read at the latest evaluation, not a final one."] if read else []


# settings a table's identity columns show, or that change no number it holds
NOT_SETTINGS = {"name", "matrix", "seed", "data_seed", "init_seed", "model.schedule", "model.base",
                "model.window", "train.log_interval", "train.checkpoint_interval", "train.keep_checkpoints"}
MAX_SETTINGS_SAID = 4


def settings_notes(engine: Engine, runs) -> list[str]:
    """A note per setting that differs between a table's runs beyond what its columns show (a
    sweep's lr, another preset): otherwise two rows read as the same recipe. Micro-batches are
    a memory choice: batch_size and grad_accum are said only when their product differs."""
    names = set(runs)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, config_json FROM runs")).all()
    settings: dict[str, dict] = {}
    for name, config_json in rows:
        if name in names:
            try:
                config = json.loads(config_json)
                flat = flatten(config) if isinstance(config, dict) else {}
            except (ValueError, TypeError, RecursionError):
                continue
            # the probe's settings: None on every other run, and the probe's runs are Table 2's
            settings[name] = {k: v for k, v in flat.items() if k != "probe" and not k.startswith("probe.")}
    if len(settings) < 2:
        return []
    varied = sorted(differing(list(settings.values())) - NOT_SETTINGS, key=lambda k: (k != "preset", k))
    per_step = {(s.get("train.batch_size") or 0) * (s.get("train.grad_accum") or 0) for s in settings.values()}
    if len(per_step) == 1:
        varied = [k for k in varied if k not in ("train.batch_size", "train.grad_accum")]
    notes = [f"Differs between these runs: {k}: {_by_value(settings, k)}." for k in varied[:MAX_SETTINGS_SAID]]
    if len(varied) > MAX_SETTINGS_SAID:
        rest = varied[MAX_SETTINGS_SAID:]
        notes.append(f"Differs between these runs: {len(rest)} more setting(s) ({', '.join(rest[:6])}"
                     f"{', ...' if len(rest) > 6 else ''}); `fibctl queue show NAME` shows a run's.")
    return notes


def _by_value(settings: dict[str, dict], key: str) -> str:
    """Each value of `key` with the runs that have it, the value most runs share last."""
    groups: dict[str, list[str]] = {}
    for name, flat in sorted(settings.items()):
        value = flat.get(key)
        shown = "(unset)" if value is None else value if isinstance(value, str) else json.dumps(value)
        groups.setdefault(shown, []).append(name)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[0]))
    parts = []
    for i, (value, who) in enumerate(ordered):
        if i == len(ordered) - 1 and len(who) > 2:
            parts.append(f"{value} (the other {len(who)} runs)")
        else:
            parts.append(f"{value} ({', '.join(who[:3])}{f' and {len(who) - 3} more' if len(who) > 3 else ''})")
    return "; ".join(parts)


def budget_notes(long: pd.DataFrame) -> list[str]:
    """A note per value read from a measurement on fewer tokens than the same run's largest at
    that set and length (`tokens`, `most_tokens`; NULL where unknown, as in the study's JSON
    dumps): a final step measured only by the light evaluation reads noisier than the rest."""
    known = long.dropna(subset=["tokens", "most_tokens"])
    short = known[known["tokens"] < known["most_tokens"]].sort_values(["run", "dataset", "eval_length"])
    return [f"Fewer tokens: {r.run} on {dataset_label(r.dataset)} at length {int(r.eval_length):,} is "
            f"read from {int(r.tokens):,} tokens at its final step; it was measured on up to "
            f"{int(r.most_tokens):,} at other steps." for r in short.itertuples()]


def sort_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The paper's order: dense, then fib before pow2, schedules fixed..coprime, then by W."""
    key = pd.DataFrame({
        "base": frame["base"].map(lambda b: BASE_ORDER.index(b) + 1 if b in BASE_ORDER else 0),
        "schedule": frame["schedule"].map(
            lambda s: SCHEDULE_ORDER.index(s) if s in SCHEDULE_ORDER else len(SCHEDULE_ORDER)),
        "window": frame["window"].fillna(-1),
    }, index=frame.index)
    order = key.sort_values(["base", "schedule", "window"], kind="stable").index
    return frame.loc[order].reset_index(drop=True)


def _wide(long: pd.DataFrame, columns: str, values: str, keys: list[str]) -> pd.DataFrame:
    """One row per run (keys kept), one column per value of `columns`."""
    wide = long.pivot(index="run", columns=columns, values=values)
    meta = long[["run", *keys]].drop_duplicates("run").set_index("run")
    return sort_runs(meta.join(wide).reset_index())


def _run_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """Identity columns as printed: Run, Base, Schedule, W (W as a nullable integer)."""
    out = frame.rename(columns={"run": "Run", "base": "Base", "schedule": "Schedule", "window": "W"})
    out["Base"] = out["Base"].fillna("-")
    out["W"] = out["W"].astype("Int64")
    return out


def table1(engine: Engine, *, seed: int = DEFAULT_SEED, matrix: str | None = None, only: str | None = None,
           dense: bool = False, compare: Engine | None = None, compare_label: str = "other") -> Table:
    """Final-step perplexity at the training length on every held-out set, sparse runs of one seed
    (and, with --dense, the dense baseline first; the paper's Table 1 leaves it out)."""
    def sql(runs: Runs) -> str:
        return f"""WITH {FINAL_STEP}
SELECT r.name AS run, r.base, r.schedule, r."window" AS "window", e.dataset, e.ppl,
       e.eval_length, e.tokens, {MOST_TOKENS}
FROM runs r
JOIN final f ON f.run_id = r.id
JOIN evaluations e ON e.run_id = r.id AND e.step = f.step AND e.eval_length = r.train_length
WHERE {"" if dense else "r.schedule <> 'dense' AND "}r.seed = :seed{runs.clause()}
ORDER BY r.name, e.dataset"""

    runs = pick_runs(engine, matrix, only)
    frame, sql_text, budgets = _table1_frame(engine, sql(runs), runs.params(seed=seed), seed, runs)
    cols = [c for c in frame.columns if c not in ("Run", "Base", "Schedule", "W")]
    title = f"Table 1: final perplexity at the training length (seed {seed})"
    formats = {c: ppl for c in cols}
    if compare is not None:  # matched by what the runs are: --only's names are this database's
        theirs = Runs(matrix)
        other, _, _ = _table1_frame(compare, sql(theirs), theirs.params(seed=seed), seed, theirs)
        frame, extra = _beside(frame, other, cols, compare_label)
        formats.update(extra)
        title += f", beside {compare_label}"
    notes = (unfinished_notes(engine, frame["Run"]) + deviation_notes(engine, frame["Run"])
             + sampler_notes(engine, frame["Run"]) + settings_notes(engine, frame["Run"])
             if "Run" in frame else []) + budgets
    if not dense and _has_dense(engine, seed, runs):  # said, or the reader looks for it in vain
        notes.append("the dense baseline is left out, as in the paper; --dense adds it")
    return Table("table1", title, frame, sql_text, formats, {c: "min" for c in cols}, notes)


def _has_dense(engine: Engine, seed: int, runs: Runs) -> bool:
    sql = f"SELECT count(*) AS n FROM runs r WHERE r.schedule = 'dense' AND r.seed = :seed{runs.clause()}"
    frame, _ = read_sql(engine, sql, **runs.params(seed=seed))
    return bool(frame["n"].iloc[0])


def _table1_frame(engine: Engine, sql: str, params: dict, seed: int,
                  runs: Runs) -> tuple[pd.DataFrame, str, list[str]]:
    long, sql_text = read_sql(engine, sql, **params)
    if long.empty:
        raise FibctlError(
            f"table1: no seed-{seed} sparse runs{runs.said()} have a final evaluation at "
            "their training length; train runs (`fibctl worker`), evaluate them (`fibctl eval NAME "
            "--length T`) or import the study (`fibctl import-study fib.db`)")
    wide = _wide(long, "dataset", "ppl", ["base", "schedule", "window"])
    order = ordered_datasets(long["dataset"])
    wide = wide[["run", "base", "schedule", "window", *order]]
    return _run_labels(wide.rename(columns={d: dataset_label(d) for d in order})), sql_text, budget_notes(long)


def _beside(this: pd.DataFrame, other: pd.DataFrame, cols: list[str],
            label: str) -> tuple[pd.DataFrame, dict[str, Formatter]]:
    """Each value column followed by the other database's value and the difference."""
    keys = ["Base", "Schedule", "W"]
    for frame, which in ((this, "this database"), (other, label)):  # a match must be one run each side
        for key, group in frame.groupby(keys, dropna=False):
            if len(group) > 1:
                kind = " ".join(str(k) for k in key[:2]) + ("" if pd.isna(key[2]) else f" W={key[2]}")
                raise FibctlError(f"table1 --compare matches runs by base, schedule and W: {which} has "
                                  f"{len(group)} runs of {kind} ({', '.join(sorted(group['Run'])[:4])}); "
                                  "--matrix picks one matrix's")
    other = other[keys + [c for c in cols if c in other.columns]]
    merged = this.merge(other, on=keys, how="left", suffixes=("", f" ({label})"))
    ordered, formats = list(keys), {}  # run names differ between databases: matched by identity
    for c in cols:
        theirs = f"{c} ({label})"
        if theirs not in merged.columns:
            merged[theirs] = float("nan")
        merged[f"Δ {c}"] = merged[c] - merged[theirs]
        ordered += [c, theirs, f"Δ {c}"]
        formats.update({theirs: ppl, f"Δ {c}": lambda x: f"{x:+.2f}"})
    return merged[ordered], formats


def table2(engine: Engine, *, only: str | None = None) -> Table:
    """The mechanism probe: learned-alpha range and retrieval accuracy per depth and init, for
    the study's imported probe models and fibctl's own probe runs (`fibctl probe`) alike."""
    runs = pick_runs(engine, only=only)
    sql = f"""WITH probe AS (
    -- one row per probe model: who trained it, for how many steps, on which task (length,
    -- vocabulary, distances), its depth, whether alpha started staggered, and how many
    -- held-out sequences scored it
    SELECT m.run_id,
           CASE WHEN r.source = 'fibctl' THEN 'fibctl' ELSE 'study' END AS origin,
           COALESCE(r.final_step, 0) AS steps,
           COALESCE(MAX(CASE WHEN m.metric = 'task' THEN m.text END), 'not recorded') AS task,
           MAX(CASE WHEN m.metric = 'depth' THEN m.value END) AS depth,
           MAX(CASE WHEN m.metric = 'staggered_init' THEN m.value END) AS staggered,
           MAX(CASE WHEN m.metric = 'eval_sequences' THEN m.value END) AS scored
    FROM aux_metrics m JOIN runs r ON r.id = m.run_id
    WHERE m.name = 'marked_retrieval'{runs.clause()}
    GROUP BY m.run_id, r.source, r.final_step
),
final_alpha AS (
    SELECT a.run_id, a.alpha FROM alphas a
    WHERE a.step = (SELECT MAX(a2.step) FROM alphas a2 WHERE a2.run_id = a.run_id)
)
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, 'alpha_min' AS metric, MIN(fa.alpha) AS value
FROM probe p JOIN final_alpha fa ON fa.run_id = p.run_id
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered
UNION ALL
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, 'alpha_max', MAX(fa.alpha)
FROM probe p JOIN final_alpha fa ON fa.run_id = p.run_id
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered
UNION ALL
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, 'seeds', COUNT(*)
FROM probe p
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered
UNION ALL
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, 'scored', MIN(p.scored)
FROM probe p
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered
UNION ALL
-- accuracy at each distance (metric acc_d<distance>), mean over seeds, and over how many
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, m.metric, AVG(m.value)
FROM probe p JOIN aux_metrics m ON m.run_id = p.run_id AND m.name = 'marked_retrieval'
WHERE m.metric LIKE 'acc_d%'
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered, m.metric
UNION ALL
SELECT p.origin, p.steps, p.task, p.depth, p.staggered, 'n_' || m.metric, COUNT(m.value)
FROM probe p JOIN aux_metrics m ON m.run_id = p.run_id AND m.name = 'marked_retrieval'
WHERE m.metric LIKE 'acc_d%'
GROUP BY p.origin, p.steps, p.task, p.depth, p.staggered, m.metric"""
    long, sql_text = read_sql(engine, sql, **runs.params())
    if long.empty:
        raise FibctlError(f"table2: no probe results (aux_metrics named 'marked_retrieval'){runs.said()}; "
                          "run the probe with "
                          "`fibctl probe` and `fibctl worker`, or import the study's with `fibctl import-study fib.db`")
    keys = ["origin", "steps", "task", "depth", "staggered"]
    wide = long.pivot_table(index=keys, columns="metric", values="value", aggfunc="first", dropna=False)
    # dropna=False keeps a cell whose accuracy is NaN, but also makes every combination of
    # the keys: keep the cells that have models (a half-trained matrix lacks some)
    wide = wide[wide["seeds"].notna()]
    wide = wide.reset_index().sort_values(keys, key=lambda c: c.map({"study": 0, "fibctl": 1}) if c.name == "origin"
                                          else c).reset_index(drop=True)
    accs = sorted((c for c in wide.columns if c.startswith("acc_d")), key=lambda c: int(c[5:]))
    # a task's description is long: rows name their task by letter, the notes spell it out
    tasks = list(dict.fromkeys(wide["task"]))
    letter = {task: chr(ord("A") + i) if i < 26 else str(i + 1) for i, task in enumerate(tasks)}
    frame = pd.DataFrame({
        "Source": wide["origin"], "Steps": wide["steps"].astype(int),
        "Task": wide["task"].map(letter),
        "Depth": wide["depth"].astype(int),
        "Init": wide["staggered"].map({0: "uniform", 1: "staggered"}),
        "α min": wide.get("alpha_min"), "α max": wide.get("alpha_max"),
        **{f"acc d={c[5:]}": wide[c] for c in accs},
        "Seeds": wide["seeds"].astype(int),
        "Scored": wide["scored"] if "scored" in wide else float("nan"),
    })
    formats = {"α min": lambda x: f"{x:.2f}", "α max": lambda x: f"{x:.2f}",
               **{f"acc d={c[5:]}": loss for c in accs},
               "Scored": lambda x: "" if pd.isna(x) else f"{x:.0f}"}
    # who trained the models, for how long, on what: columns only where the rows differ
    shared = [c for c in ("Source", "Steps", "Task") if frame[c].nunique() == 1]
    title = "Table 2: mechanism probe (learned alpha range, retrieval accuracy)"
    said = [f"{frame[c].iloc[0]:,} steps" if c == "Steps" else f"{frame[c].iloc[0]}'s models"
            for c in shared if c != "Task"]
    if said:
        title += "; " + ", ".join(said)
    frame = frame.drop(columns=shared)
    described = [f"Task: marked copy at {tasks[0]}."] if len(tasks) == 1 else \
        [f"Task {letter[t]}: marked copy at {t}." for t in tasks]
    return Table("table2", title, frame, sql_text, formats,
                 notes=described + ["Scored: held-out sequences per model (the study scored 2); accuracy is the mean "
                                    "over seeds; α min / max range over layers and seeds at the last step."]
                 + _fewer_scored(wide, accs), key=2)  # depth and init


def _fewer_scored(wide: pd.DataFrame, accs: list[str]) -> list[str]:
    """A note for each accuracy that is a mean over fewer seeds than its row counts: a model
    whose held-out sequences held no position at that distance recorded none (NULL)."""
    notes = []
    for _, row in wide.iterrows():
        for c in accs:
            n = row.get(f"n_{c}")
            if pd.notna(n) and int(n) < int(row["seeds"]):
                init = {0: "uniform", 1: "staggered"}.get(row["staggered"], row["staggered"])
                notes.append(f"Fewer seeds: depth {int(row['depth'])} {init}'s acc d={c[5:]} is the mean over "
                             f"{int(n)} of its {int(row['seeds'])} models (the others scored no position at that "
                             "distance).")
    return notes


def table3(engine: Engine, *, dataset: str | None = None, seed: int = DEFAULT_SEED,
           matrix: str | None = None, only: str | None = None, all_runs: bool = False) -> Table:
    """Perplexity of the same weights at every evaluated length, and the change at 4x.

    Rows: the paper's (docs/method.md) that are present, else (or with `all_runs`) every run
    evaluated at more than one length. Where per-position losses at 4x the training length
    exist, the mean loss over the positions past the training length is shown too.
    """
    runs = pick_runs(engine, matrix, only)
    dataset = dataset or default_dataset(engine)
    sql = f"""WITH {FINAL_STEP},
beyond AS (
    -- mean loss at the stored positions from T on (T..4T-2) of windows 4x the training length T
    SELECT p.run_id, AVG(p.mean_loss) AS loss_beyond
    FROM position_losses p
    JOIN runs r ON r.id = p.run_id
    JOIN final f ON f.run_id = p.run_id AND f.step = p.step
    WHERE p.dataset = :dataset AND p.eval_length = 4 * r.train_length
      AND p.position >= r.train_length
    GROUP BY p.run_id
)
SELECT r.name AS run, r.base, r.schedule, r."window" AS "window", r.train_length,
       e.dataset, e.eval_length, e.ppl, b.loss_beyond, e.tokens, {MOST_TOKENS}
FROM runs r
JOIN final f ON f.run_id = r.id
JOIN evaluations e ON e.run_id = r.id AND e.step = f.step
LEFT JOIN beyond b ON b.run_id = r.id
WHERE e.dataset = :dataset AND r.seed = :seed{runs.clause()}
ORDER BY r.name, e.eval_length"""
    long, sql_text = read_sql(engine, sql, **runs.params(dataset=dataset, seed=seed))
    counts = long.groupby("run")["eval_length"].nunique()
    multi = long[long["run"].isin(counts[counts > 1].index)]
    if multi.empty:
        raise FibctlError(_table3_missing(long, dataset, seed, runs))
    wide = _wide(multi, "eval_length", "ppl", ["base", "schedule", "window", "train_length", "loss_beyond"])
    wide, left_out = _table3_rows(wide, all_runs)
    lengths = sorted(multi["eval_length"].unique())
    ppl_at = wide[lengths].to_numpy()
    at = {n: i for i, n in enumerate(lengths)}
    with np.errstate(invalid="ignore"):  # a diverged run's inf / inf: no change to give, shown as -
        wide["Δ at 4x"] = [
            (ppl_at[i, at[4 * t]] / ppl_at[i, at[t]] - 1) * 100 if t in at and 4 * t in at else float("nan")
            for i, t in enumerate(wide["train_length"])
        ]
        # a perplexity of 0 or below (a row edited by hand) has no loss: shown as -, not a math error
        loss_at = np.log(np.where(ppl_at > 0, ppl_at, np.nan))
    cols = ["run", "base", "schedule", "window", *lengths, "Δ at 4x"]
    formats = {length_label(n): ppl for n in lengths} | {"Δ at 4x": percent}
    if wide["loss_beyond"].notna().any():
        # the collapse is plainest here: positions a model never trained on, against its 1x loss
        wide["Loss past T at 4x"] = wide["loss_beyond"]
        wide["vs 1x loss"] = [
            wide["loss_beyond"].iat[i] - loss_at[i, at[t]] if t in at else float("nan")
            for i, t in enumerate(wide["train_length"])
        ]
        cols += ["Loss past T at 4x", "vs 1x loss"]
        formats["Loss past T at 4x"] = loss
        formats["vs 1x loss"] = lambda x: f"{x:+.3f}"
    frame = _run_labels(wide[cols].rename(columns={n: length_label(n) for n in lengths}))
    title = f"Table 3: {dataset_label(dataset)} perplexity by evaluation length (seed {seed})"
    notes = (left_out + unfinished_notes(engine, frame["Run"]) + deviation_notes(engine, frame["Run"])
             + sampler_notes(engine, frame["Run"]) + settings_notes(engine, frame["Run"])
             + budget_notes(multi[multi["run"].isin(frame["Run"])]))
    return Table("table3", title, frame, sql_text, formats, {"Δ at 4x": "min"}, notes)


def _table3_rows(wide: pd.DataFrame, all_runs: bool) -> tuple[pd.DataFrame, list[str]]:
    """The paper's rows, in its order, when a sparse one is present (and not all runs asked
    for; the dense baseline alone is no paper table), and a note naming the runs left out."""
    def spec_index(row) -> int | None:
        key = (row["base"] if pd.notna(row["base"]) else None, row["schedule"],
               int(row["window"]) if pd.notna(row["window"]) else None)
        return TABLE3_ROWS.index(key) if key in TABLE3_ROWS else None

    rank = wide.apply(spec_index, axis=1)
    if all_runs or not (rank.notna() & (wide["schedule"] != "dense")).any():
        return wide, []
    left = sorted(wide.loc[rank.isna(), "run"])
    note = [f"The paper's rows only; also evaluated at several lengths ({len(left)}): "
            f"{', '.join(left[:4])}{', ...' if len(left) > 4 else ''} (--all-runs shows every run)."] if left else []
    return wide[rank.notna()].assign(_rank=rank).sort_values("_rank", kind="stable") \
        .drop(columns="_rank").reset_index(drop=True), note


def _table3_missing(long: pd.DataFrame, dataset: str, seed: int, runs: Runs) -> str:
    if long.empty:
        return (f"table3: no seed-{seed} runs{runs.said()} have final evaluations on "
                f"{dataset}; evaluate runs (`fibctl eval NAME --length T --length 4T`) or import the study")
    first = long.iloc[0]
    names = ", ".join(sorted(long["run"].unique())[:5])
    return (f"table3: runs {names} are evaluated on {dataset} only at their training length; "
            f"evaluate them longer, e.g. `fibctl eval {first['run']} --length {4 * int(first['train_length'])}`")


def table4(engine: Engine, *, dataset: str | None = None, window: int = 8, seed: int = DEFAULT_SEED,
           matrix: str | None = None, only: str | None = None) -> Table:
    """Mean loss by position bin (8 bins of the training window): fib fixed vs stagger, and the gap."""
    runs = pick_runs(engine, matrix, only)
    dataset = dataset or default_dataset(engine)
    sql = f"""WITH {FINAL_STEP},
n AS (
    SELECT run_id, step, dataset, eval_length, MAX(position) + 1 AS n_positions
    FROM position_losses
    GROUP BY run_id, step, dataset, eval_length
)
SELECT r.name AS run, r.matrix, r.schedule,
       -- bin i holds positions [edge_i, edge_i+1), edges = linspace(0, n_positions, {N_BINS + 1}) as integers
       ({N_BINS} * (p.position + 1) - 1) / n.n_positions AS bin,
       MIN(p.position) AS first_position, MAX(p.position) AS last_position,
       AVG(p.mean_loss) AS mean_loss
FROM position_losses p
JOIN runs r ON r.id = p.run_id
JOIN final f ON f.run_id = p.run_id AND f.step = p.step
JOIN n ON n.run_id = p.run_id AND n.step = p.step AND n.dataset = p.dataset
      AND n.eval_length = p.eval_length
WHERE p.dataset = :dataset AND p.eval_length = r.train_length
  AND r.base = 'fib' AND r."window" = :window AND r.schedule IN ('fixed', 'stagger')
  AND r.seed = :seed{runs.clause()}
GROUP BY r.name, r.matrix, r.schedule, ({N_BINS} * (p.position + 1) - 1) / n.n_positions
ORDER BY r.schedule, bin"""
    long, sql_text = read_sql(engine, sql, **runs.params(dataset=dataset, window=window, seed=seed))
    missing = [s for s in ("fixed", "stagger") if s not in set(long["schedule"])]
    if missing:
        elsewhere = _windows_with(engine, f"""SELECT r."window" FROM position_losses p JOIN runs r ON r.id = p.run_id
WHERE p.dataset = :dataset AND p.eval_length = r.train_length AND r.base = 'fib'
  AND r.schedule IN ('fixed', 'stagger') AND r.seed = :seed{runs.clause()}
GROUP BY r."window" HAVING COUNT(DISTINCT r.schedule) = 2""", runs.params(dataset=dataset, seed=seed))
        raise FibctlError(
            f"table4: no per-position losses on {dataset} at the training length for seed-{seed} "
            f"fib {' and '.join(missing)} at W={window}{runs.said()}; "
            + (f"fixed and stagger have them at {elsewhere}" if elsewhere else
               "record them with `fibctl eval NAME --length T --positions` or import the study's posloss.json"))
    _one_run_each(long, ["schedule"], lambda k: f"table4: fib {k['schedule']} W={window} seed {seed}", runs)
    bins = long.drop_duplicates("bin").sort_values("bin")
    labels = {b: f"{f}-{l}" for b, f, l in zip(bins["bin"], bins["first_position"], bins["last_position"])}
    wide = long.pivot(index="schedule", columns="bin", values="mean_loss").rename(columns=labels)
    wide.loc["gap"] = wide.loc["fixed"] - wide.loc["stagger"]
    runs = long.drop_duplicates("schedule").set_index("schedule")["run"]
    frame = wide.reset_index().rename(columns={"schedule": "Row"})
    frame.insert(1, "Run", frame["Row"].map(runs).fillna("fixed - stagger"))
    # the rows as the paper labels them (`fixed W8`); fibctl's own words write `W=8`
    frame["Row"] = frame["Row"].map({"fixed": f"fixed W{window}", "stagger": f"stagger W{window}",
                                     "gap": "gap"})
    title = (f"Table 4: mean {dataset_label(dataset)} loss by position bin "
             f"(fib, W={window}, seed {seed})")
    return Table("table4", title, frame, sql_text, {c: loss for c in labels.values()},
                 notes=unfinished_notes(engine, long["run"]) + sampler_notes(engine, long["run"])
                 + settings_notes(engine, long["run"]))


def table5(engine: Engine, *, dataset: str | None = None, window: int = 12,
           matrix: str | None = None, only: str | None = None) -> Table:
    """Per-seed final perplexity at window W, with mean and population std (ddof 0)."""
    runs = pick_runs(engine, matrix, only)
    dataset = dataset or default_dataset(engine)
    sql = f"""WITH {FINAL_STEP}
SELECT r.name AS run, r.matrix, r.base, r.schedule, r."window" AS "window", r.seed, r.init_seed, r.data_seed, e.ppl,
       e.dataset, e.eval_length, e.tokens, {MOST_TOKENS}
FROM runs r
JOIN final f ON f.run_id = r.id
JOIN evaluations e ON e.run_id = r.id AND e.step = f.step AND e.eval_length = r.train_length
WHERE e.dataset = :dataset AND r."window" = :window AND r.schedule <> 'dense'{runs.clause()}
ORDER BY r.base, r.schedule, r.seed"""
    long, sql_text = read_sql(engine, sql, **runs.params(dataset=dataset, window=window))
    long["config"] = long["base"] + " " + long["schedule"]
    n_seeds = long.groupby("config")["seed"].nunique()
    long = long[long["config"].isin(n_seeds[n_seeds > 1].index)]
    if long.empty:
        elsewhere = _windows_with(engine, f"""WITH {FINAL_STEP}
SELECT r."window" FROM runs r
JOIN final f ON f.run_id = r.id
JOIN evaluations e ON e.run_id = r.id AND e.step = f.step AND e.eval_length = r.train_length
WHERE e.dataset = :dataset AND r.schedule <> 'dense'{runs.clause()}
GROUP BY r."window", r.base, r.schedule HAVING COUNT(DISTINCT r.seed) > 1""", runs.params(dataset=dataset))
        raise FibctlError(
            f"table5: no configuration at W={window} on {dataset}{runs.said()} has "
            "final evaluations for two or more seeds; "
            # `queue add --set` takes no seed: say the option that does
            + (f"some have at {elsewhere}" if elsewhere else "train replicate seeds of the same runs "
               "(`fibctl queue add MATRIX --seed 43 --seed 44`: docs/schema.md, Matrices)"))
    _one_run_each(long, ["base", "schedule", "seed"],
                  lambda k: f"table5: {k['base']} {k['schedule']} W={window} seed {k['seed']}", runs)
    per_seed = long.pivot_table(index=["base", "schedule"], columns="seed", values="ppl").reset_index()
    seeds = [c for c in per_seed.columns if c not in ("base", "schedule")]
    values = per_seed[seeds]
    per_seed["Mean"] = values.mean(axis=1)
    per_seed["Std"] = values.std(axis=1, ddof=0)
    per_seed["window"] = window
    varied = {key: _varied(group) for key, group in long.groupby(["base", "schedule"])}
    per_seed["Varied"] = [varied[(b, s)] for b, s in zip(per_seed["base"], per_seed["schedule"])]
    # lowest mean first, as the paper lists them (its margins read down the table); a tie in
    # Table 1's order
    frame = sort_runs(per_seed).sort_values("Mean", kind="stable").reset_index(drop=True)
    frame = frame.rename(columns={s: f"seed {s}" for s in seeds})
    frame = frame.rename(columns={"base": "Base", "schedule": "Schedule", "window": "W"})
    frame = frame[["Base", "Schedule", "W", *(f"seed {s}" for s in seeds), "Mean", "Std", "Varied"]]
    formats = {f"seed {s}": ppl for s in seeds} | {"Mean": ppl, "Std": ppl}
    title = f"Table 5: {dataset_label(dataset)} perplexity across seeds (W={window})"
    notes = (["Varied: which seeds differ between the replicates (init: the initial weights; "
              "data: the batches and their order)."] + _fewer_seeds(per_seed, seeds, dataset)
             + unfinished_notes(engine, long["run"]) + deviation_notes(engine, long["run"])
             + sampler_notes(engine, long["run"]) + settings_notes(engine, long["run"]) + budget_notes(long))
    return Table("table5", title, frame, sql_text, formats, {"Mean": "min"}, notes, key=3)  # base, schedule, W


def _one_run_each(long: pd.DataFrame, keys: list[str], cell: Callable[[dict], str], runs: Runs) -> None:
    """Tables 4 and 5 hold one run per cell (a schedule; a configuration and seed): two runs
    there, from two matrices or two names for one configuration, would be averaged into one
    number (or not fit), so they are an error naming them; `cell` says which cell."""
    for key, group in long.drop_duplicates("run").groupby(keys, dropna=False):
        if len(group) > 1:
            shown = sorted(group["run"])[:4]
            names = ", ".join(shown) + (", ..." if len(group) > 4 else "")
            matrices = sorted(group["matrix"].unique())
            if runs.matrix is None and len(matrices) > 1:
                fix = f"choose one with --matrix ({', '.join(matrices)})"
            else:  # a sweep's runs (queue add --suffix) share a matrix and differ in name
                fix = (f"pick one per cell by name with --only GLOB{_suffix_example(shown)}, or see them "
                       f"side by side with `fibctl compare {' '.join(shown)}`")
            said = cell(dict(zip(keys, key if isinstance(key, tuple) else (key,))))
            raise FibctlError(f"{said}: {len(group)} runs ({names}) for one cell; {fix}")


def _suffix_example(names: list[str]) -> str:
    """' (--only '*_lr1e-3' reads the runs so named)' where the others are the shortest name with
    a suffix, as `queue add --suffix` names a sweep's runs; else ''."""
    first, *rest = sorted(names, key=len)
    suffixes = [n[len(first):] for n in rest if n.startswith(first) and len(n) > len(first)]
    return f" (--only '*{suffixes[0]}' reads the runs so named)" if suffixes else ""


def _windows_with(engine: Engine, sql: str, params: dict) -> str:
    """The windows `sql` finds, said as options to choose one ('' when none)."""
    found, _ = read_sql(engine, sql, **params)
    windows = sorted({int(w) for w in found.iloc[:, 0].dropna()})
    return " or ".join(f"--window {w}" for w in windows)


def _fewer_seeds(per_seed: pd.DataFrame, seeds: list, dataset: str) -> list[str]:
    """A note per row whose mean and std cover only some of the table's seeds."""
    notes = []
    for _, row in per_seed.iterrows():
        missing = [s for s in seeds if pd.isna(row[s])]
        if missing:
            over = ", ".join(str(s) for s in seeds if s not in missing)
            notes.append(f"Fewer seeds: {row['base']} {row['schedule']}'s mean and std are over seeds {over} "
                         f"only (no final {dataset_label(dataset)} perplexity for seed "
                         f"{', '.join(map(str, missing))}).")
    return notes


def _varied(replicates: pd.DataFrame) -> str:
    """Which of the two seeds differ across one configuration's replicates."""
    data = replicates["data_seed"].fillna(replicates["seed"]).nunique() > 1
    if replicates["init_seed"].isna().any():
        return "data (init not recorded)" if data else "init not recorded"
    init = replicates["init_seed"].nunique() > 1
    return " + ".join(n for n, v in (("init", init), ("data", data)) if v) or "none"


TABLES = {"table1": table1, "table2": table2, "table3": table3, "table4": table4, "table5": table5}
