"""Import the published study (docs/method.md, "The published files") into fibctl's schema.

- `fib.db` runs -> `runs` (matrix 'paper', preset 'paper', T 1024, status 'done', source =
  the file name). Names are kept (`f13__fib_stagger_w12`) and mapped to base / schedule /
  window / seed (`logsparse` = pow2, `hdc` = coprime, no schedule = fixed, `_s43` = seed);
  the last `done` attempt of each name wins. `ref_e0000`, registered in the study's db as a
  reference trained elsewhere, is the dense baseline (base and window NULL, seed 42).
- `metrics` -> `evaluations` at eval_length 1024 (dataset names and token counts as they are).
- `eval_results` -> `aux_metrics`: name = eval_name at the run's final step,
  `eval_name@step<N>` at earlier steps; metric as it is. A repeated measurement: the last wins.
- `retrieval_results` rows with source 'marked' (Table 2's probe) -> one run per probe model
  in matrix 'probe' (`probe_marked_d<depth>_<uniform|stagger>_s<seed>`, schedule learned, W 8,
  T 512), aux_metrics name 'marked_retrieval' (metrics `depth`, `staggered_init` 0/1,
  `acc_d<distance>`, `eval_sequences` 2: the study scored one batch of 2), and its final
  alphas in `alphas`.
- `lenextrap.json` -> `evaluations` at each length at the run's final step (tokens NULL: the
  file does not record them); a row already imported from `metrics` is kept.
- `posloss.json` -> `position_losses` at the run's final step, eval_length = seq_len.

Every row is written by its natural key, so importing twice changes nothing; the summary
counts the rows written or changed (a second import of the same files counts none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.engine import Connection, Engine

from fibctl.config import ProbeConfig, RunConfig, get_preset
from fibctl.probe.cells import PROBE_MATRIX, PROBE_METRICS
from fibctl.db import schema
from fibctl.db.store import run_row, upsert
from fibctl.errors import FibctlError

STUDY_MATRIX = "paper"
STUDY_LENGTH = 1024
STUDY_INIT_SEED = 42  # the paper matrix's shared init seed, for the reproducing config
DENSE_BASELINE = "ref_e0000"

_TITLE = re.compile(r"^(?P<tag>[a-z]\d+)__(?P<base>fib|logsparse)"
                    r"(?:_(?P<schedule>fixed|learned|stagger|hdc))?_w(?P<window>\d+)(?:_s(?P<seed>\d+))?$")
_BASES = {"fib": "fib", "logsparse": "pow2"}
_SCHEDULES = {None: "fixed", "fixed": "fixed", "learned": "learned", "stagger": "stagger", "hdc": "coprime"}

# The study's tables and the columns the importer reads from them.
EXPECTED = {
    "runs": ("id", "title", "status", "seed", "variant_or_baseline", "params_effective",
             "tokens_trained", "wall_seconds", "started_at", "ended_at", "created_at"),
    "metrics": ("run_id", "step", "dataset", "ppl", "loss", "eval_tokens", "recorded_at"),
    "eval_results": ("id", "run_id", "step", "eval_name", "metric", "value"),
    "retrieval_results": ("source", "depth", "seed", "staggered", "distance", "kind", "acc", "alphas"),
}


@dataclass(frozen=True)
class StudyRun:
    name: str
    base: str | None
    schedule: str
    window: int | None
    seed: int


@dataclass
class ImportSummary:
    """What an import wrote: rows inserted or changed, not rows that were already as read."""
    runs: int = 0
    evaluations: int = 0
    aux_metrics: int = 0
    probe_runs: int = 0
    position_losses: int = 0
    skipped: list[str] = field(default_factory=list)  # study runs with no fibctl meaning


def study_run(title: str) -> StudyRun | None:
    """What a published run name means, or None for names outside the study's matrix."""
    if title == DENSE_BASELINE:
        return StudyRun(title, None, "dense", None, 42)
    m = _TITLE.match(title)
    if not m:
        return None
    return StudyRun(title, _BASES[m["base"]], _SCHEDULES[m["schedule"]], int(m["window"]),
                    int(m["seed"] or 42))


def import_study(engine: Engine, fib_db: str | Path, lenextrap: str | Path | None = None,
                 posloss: str | Path | None = None) -> ImportSummary:
    """Load the study's database (and optionally its two JSON dumps) into `engine`'s schema."""
    fib_db = Path(fib_db)
    extrap = _load_json(lenextrap, "{run: {length: {dataset: ppl}}}") if lenextrap else None
    losses = _load_json(posloss, "{run: {dataset: {per_position, n_windows, seq_len}}}") if posloss else None
    summary = ImportSummary()
    study = _open_study(fib_db)
    try:
        with engine.begin() as conn:
            runs = _import_runs(conn, study, fib_db.name, summary)
            _import_probe(conn, study, fib_db.name, summary)
            if extrap is not None:
                _import_lenextrap(conn, extrap, Path(lenextrap).name, runs, summary)
            if losses is not None:
                _import_posloss(conn, losses, Path(posloss).name, runs, summary)
    finally:
        study.close()
    return summary


# --- reading the study's files -------------------------------------------------------------

def _open_study(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise FibctlError(f"{path}: no such file (expected the study's SQLite database, fib.db)")
    conn = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as e:
        conn.close()
        raise FibctlError(f"{path}: not an SQLite database ({e}); expected the study's fib.db") from None
    for table, columns in EXPECTED.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")} if table in tables else set()
        missing = [c for c in columns if c not in have]
        if missing:
            conn.close()
            what = f"table {table!r} lacks columns {', '.join(missing)}" if have else f"no table {table!r}"
            raise FibctlError(f"{path}: {what}; expected the study's layout (docs/method.md, 'The published files'): "
                              + "; ".join(f"{t}({', '.join(c)})" for t, c in EXPECTED.items()))
    return conn


def _load_json(path: str | Path, layout: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise FibctlError(f"{path}: cannot read JSON ({e}); expected {layout}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise FibctlError(f"{path}: expected an object {layout}")
    return data


def _time(value: str | None) -> datetime | None:
    """The study's ISO timestamps as naive UTC (how the schema stores times)."""
    if not value:
        return None
    t = datetime.fromisoformat(value)
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# --- writing ------------------------------------------------------------------------------

def _put_run(conn: Connection, values: dict, replace: bool = True) -> tuple[int, bool]:
    """The id of run `values['name']`, inserted or (with `replace`) updated, and whether
    that wrote anything (False when the row already held these values).

    A run fibctl trained itself is never overwritten by the published one of the same name.
    """
    runs = schema.Run.__table__
    row = conn.execute(select(runs).where(runs.c.name == values["name"])).first()
    if row is None:
        return conn.execute(runs.insert().values(**values)).inserted_primary_key[0], True
    if row.source == "fibctl":
        raise FibctlError(f"run {values['name']!r} already exists in this database as a fibctl run; "
                          "import the study into its own database (--db published.db) and compare "
                          "with `fibctl report table1 --compare published.db`")
    changes = {k: v for k, v in values.items()  # created_at stays: when this database first got the run
               if k != "created_at" and row._mapping[k] != v} if replace else {}
    if changes:
        conn.execute(update(runs).where(runs.c.id == row.id).values(**changes))
    return row.id, bool(changes)


def _run_values(run: StudyRun, source: str, final_step: int, **details) -> dict:
    config = RunConfig.resolve(run.name, STUDY_MATRIX, "paper", schedule=run.schedule,
                               base=run.base or "fib", window=run.window if run.window is not None else 8,
                               seed=run.seed, init_seed=STUDY_INIT_SEED)
    # The study seeded its runs after building the model: data_seed is its run seed, and its
    # init seed was never recorded (NULL), though replicates shared their initial weights.
    return run_row(config, init_seed=None, status=schema.RunStatus.DONE,
                   final_step=final_step, source=source, **details)


@dataclass(frozen=True)
class _Imported:
    id: int
    final_step: int


def _import_runs(conn: Connection, study: sqlite3.Connection, source: str,
                 summary: ImportSummary) -> dict[str, _Imported]:
    """Each study run's chosen attempt with its evaluations and auxiliary metrics."""
    out = {}
    for title, attempts in _attempts(study).items():
        run = study_run(title)
        chosen = _chosen_attempt(attempts)
        if run is None or chosen is None:
            summary.skipped.append(title)
            continue
        final_step = _final_step(study, chosen["id"])
        details = dict(
            attempts=len(attempts), created_at=_time(chosen["created_at"]),
            started_at=_time(chosen["started_at"]), finished_at=_time(chosen["ended_at"]),
            wall_seconds=chosen["wall_seconds"], params_total=chosen["params_effective"] or None,
            tokens_trained=chosen["tokens_trained"])
        run_id, written = _put_run(conn, _run_values(run, source, final_step, **details))
        out[title] = _Imported(run_id, final_step)
        summary.runs += written
        summary.evaluations += _import_metrics(conn, study, chosen["id"], run_id)
        summary.aux_metrics += _import_eval_results(conn, study, chosen["id"], run_id, final_step)
    return out


def _attempts(study: sqlite3.Connection) -> dict[str, list[sqlite3.Row]]:
    out: dict[str, list[sqlite3.Row]] = {}
    for row in study.execute("SELECT * FROM runs ORDER BY id"):
        out.setdefault(row["title"], []).append(row)
    return out


def _chosen_attempt(attempts: list[sqlite3.Row]) -> sqlite3.Row | None:
    """The last `done` attempt; a reference run (trained elsewhere, never 'done' here) as is."""
    done = [a for a in attempts if a["status"] == schema.RunStatus.DONE]
    if done:
        return done[-1]
    refs = [a for a in attempts if a["variant_or_baseline"] == "reference"]
    return refs[-1] if refs else None


def _final_step(study: sqlite3.Connection, study_id: int) -> int:
    """The last evaluated step; the paper recipe's last step when nothing was evaluated."""
    (step,) = study.execute(
        "SELECT MAX(step) FROM (SELECT step FROM metrics WHERE run_id = ? "
        "UNION ALL SELECT step FROM eval_results WHERE run_id = ?)", (study_id, study_id)).fetchone()
    return int(step) if step is not None and step >= 0 else get_preset("paper").train.steps


def _import_metrics(conn: Connection, study: sqlite3.Connection, study_id: int, run_id: int) -> int:
    rows = [dict(run_id=run_id, step=r["step"], dataset=r["dataset"], eval_length=STUDY_LENGTH,
                 tokens=r["eval_tokens"], ppl=r["ppl"],
                 loss=r["loss"] if r["loss"] is not None else math.log(r["ppl"]),
                 created_at=_time(r["recorded_at"]))
            for r in study.execute("SELECT * FROM metrics WHERE run_id = ? AND ppl IS NOT NULL "
                                   "ORDER BY step, dataset", (study_id,))]
    return upsert(conn, schema.Evaluation.__table__, rows, ("run_id", "step", "dataset", "eval_length"))


def _import_eval_results(conn: Connection, study: sqlite3.Connection, study_id: int, run_id: int,
                         final_step: int) -> int:
    latest: dict[tuple[str, str], dict] = {}
    for r in study.execute("SELECT * FROM eval_results WHERE run_id = ? ORDER BY id", (study_id,)):
        name = r["eval_name"] if r["step"] in (final_step, -1) else f"{r['eval_name']}@step{r['step']}"
        latest[(name, r["metric"])] = dict(run_id=run_id, name=name, metric=r["metric"],
                                           value=r["value"], text=None)
    return upsert(conn, schema.AuxMetric.__table__, list(latest.values()), ("run_id", "name", "metric"))


PROBE_STEPS = 2500
STUDY_SCORED = 2  # held-out sequences the study scored each probe model on (one batch of 2)


def _probe_config(name: str, depth: int, seed: int, staggered: bool) -> RunConfig:
    """The probe model of docs/method.md, "Table 2" (the mechanism probe), as `fibctl probe`
    would queue it."""
    preset = get_preset("probe")
    model = dataclasses.replace(preset.model, n_layers=depth).validate()
    probe = ProbeConfig(init="staggered" if staggered else "uniform", eval_sequences=STUDY_SCORED)
    return RunConfig(name=name, matrix=PROBE_MATRIX, preset="probe", init_seed=seed, data_seed=seed,
                     model=model, train=preset.train, probe=probe.validate(model))


def _import_probe(conn: Connection, study: sqlite3.Connection, source: str, summary: ImportSummary) -> None:
    models: dict[tuple[int, int, int], list[sqlite3.Row]] = {}
    for r in study.execute("SELECT * FROM retrieval_results WHERE source = 'marked' AND kind = 'target' "
                           "ORDER BY depth, staggered, seed, distance"):
        models.setdefault((r["depth"], r["staggered"], r["seed"]), []).append(r)
    for (depth, staggered, seed), rows in models.items():
        name = f"probe_marked_d{depth}_{'stagger' if staggered else 'uniform'}_s{seed}"
        config = _probe_config(name, depth, seed, bool(staggered))
        run_id, written = _put_run(conn, run_row(config, init_seed=None, status=schema.RunStatus.DONE,
                                                 final_step=PROBE_STEPS, source=source,
                                                 created_at=_now()))
        metrics = {"depth": depth, "staggered_init": staggered, "eval_sequences": STUDY_SCORED,
                   **{f"acc_d{r['distance']}": r["acc"] for r in rows}}
        written += upsert(conn, schema.AuxMetric.__table__,
                           [dict(run_id=run_id, name=PROBE_METRICS, metric=k, value=float(v), text=None)
                            for k, v in metrics.items()], ("run_id", "name", "metric"))
        alphas = _alphas(rows[0]["alphas"], name)
        written += upsert(conn, schema.Alpha.__table__,
                           [dict(run_id=run_id, step=PROBE_STEPS, layer=i, alpha=a) for i, a in enumerate(alphas)],
                           ("run_id", "step", "layer"))
        summary.probe_runs += bool(written)  # a probe model whose row, accuracies or alphas were written


def _alphas(text: str | None, name: str) -> list[float]:
    try:
        alphas = json.loads(text or "")
    except ValueError:
        alphas = None
    if not isinstance(alphas, list) or not all(isinstance(a, (int, float)) for a in alphas):
        raise FibctlError(f"retrieval_results for {name}: expected alphas as a JSON list of numbers, "
                          f"got {text!r}")
    return [float(a) for a in alphas]


def _json_run(conn: Connection, title: str, source: str, runs: dict[str, _Imported],
              summary: ImportSummary) -> _Imported:
    """A run named in a JSON dump: imported from fib.db, or created from its name alone."""
    if title in runs:
        return runs[title]
    run = study_run(title)
    if run is None:
        raise FibctlError(f"{source}: {title!r} is not a study run name "
                          f"(expected names like f13__fib_stagger_w12, or {DENSE_BASELINE})")
    step = get_preset("paper").train.steps
    values = _run_values(run, source, step, created_at=_now())
    run_id, written = _put_run(conn, values, replace=False)
    runs[title] = _Imported(run_id, step)
    summary.runs += written
    return runs[title]


def _import_lenextrap(conn: Connection, data: dict, source: str, runs: dict[str, _Imported],
                      summary: ImportSummary) -> None:
    rows = []
    for title, by_length in data.items():
        run = _json_run(conn, title, source, runs, summary)
        for length, by_dataset in by_length.items():
            if not str(length).isdigit() or not isinstance(by_dataset, dict) or not all(
                    isinstance(v, (int, float)) and v > 0 for v in by_dataset.values()):
                raise FibctlError(f"{source}: {title}.{length}: expected {{length: {{dataset: ppl}}}} "
                                  "with integer lengths and positive perplexities")
            rows += [dict(run_id=run.id, step=run.final_step, dataset=ds, eval_length=int(length),
                          tokens=None, ppl=float(v), loss=math.log(v), created_at=None)
                     for ds, v in by_dataset.items()]
    summary.evaluations += upsert(conn, schema.Evaluation.__table__, rows,
                                   ("run_id", "step", "dataset", "eval_length"), replace=False)


def _import_posloss(conn: Connection, data: dict, source: str, runs: dict[str, _Imported],
                    summary: ImportSummary) -> None:
    for title, by_dataset in data.items():
        run = _json_run(conn, title, source, runs, summary)
        rows = []
        for ds, entry in by_dataset.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("per_position"), list)
                    and isinstance(entry.get("n_windows"), int) and isinstance(entry.get("seq_len"), int)):
                raise FibctlError(f"{source}: {title}.{ds}: expected {{per_position: [losses], "
                                  "n_windows: int, seq_len: int}")
            rows += [dict(run_id=run.id, step=run.final_step, dataset=ds, eval_length=entry["seq_len"],
                          position=i, mean_loss=float(v), windows=entry["n_windows"])
                     for i, v in enumerate(entry["per_position"])]
        summary.position_losses += upsert(conn, schema.PositionLoss.__table__, rows,
                                           ("run_id", "step", "dataset", "eval_length", "position"))
