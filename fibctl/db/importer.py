"""Import the published study (docs/method.md, "The published files") into fibctl's schema.

- `fib.db` runs -> `runs` (matrix 'paper', preset 'paper', T=1024, status 'done', source =
  the file name). Names are kept (`f13__fib_stagger_w12`) and mapped to base / schedule /
  window / seed (`logsparse` = pow2, `hdc` = coprime, no schedule = fixed, `_s43` = seed; a
  name without one takes runs.seed, and a name whose seed runs.seed contradicts is an error);
  the last `done` attempt of each name that has metrics wins (else the last `done` one): a
  later registration holding nothing does not hide the results. A name with no `done`
  attempt is left out, and the summary says so. `ref_e0000`, registered in the study's db as a
  reference trained elsewhere, is the dense baseline (base and window NULL, seed 42).
- `metrics` -> `evaluations` at eval_length 1024 (dataset names and token counts as they are).
  A copy without the table's key may hold a step twice for one dataset: the measurement on
  the most tokens wins (Table 1 is read at 1,048,576 tokens, not the 262,144 of the
  periodic check); two different perplexities on as many tokens are an error (something the
  importer does not read tells them apart). A row with no perplexity but a loss gets exp(loss).
- `eval_results` -> `aux_metrics`: name = eval_name at the run's final step,
  `eval_name@step<N>` at earlier steps; metric as it is. A repeated measurement: the last wins.
- `retrieval_results` rows with source 'marked' (Table 2's probe) -> one run per probe model
  in matrix 'probe' (`probe_marked_d<depth>_<uniform|stagger>_s<seed>`, schedule learned, W=8,
  T=512), aux_metrics name 'marked_retrieval' (metrics `depth`, `staggered_init` 0/1,
  `acc_d<distance>`, `eval_sequences` 2: the study scored one batch of 2; `task`, text: the
  length, vocabulary and distances Table 2 groups by), and its final alphas in `alphas` (one
  per layer). A model's repeated rows must agree: two different accuracies at one distance,
  or two alpha lists, are an error, not a silent choice.
- `lenextrap.json` -> `evaluations` at each length at the run's final step (tokens NULL: the
  file does not record them); a row already imported from `metrics` is kept.
- `posloss.json` -> `position_losses` at the run's final step, eval_length = seq_len; each
  entry holds seq_len - 1 losses (every predicted position) over at least one window.
- `fib.db` is read where it lies and never changed: with no -wal content it is opened
  immutable, so SQLite makes no -wal and -shm files beside it.

Every row is written by its natural key, so importing twice changes nothing; the summary
counts the rows written or changed (a second import of the same files counts none).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import select, update
from sqlalchemy.engine import Connection, Engine

from fibctl.config import SEED_MAX, ProbeConfig, RunConfig, get_preset
from fibctl.probe.cells import PROBE_MATRIX, PROBE_METRICS, task_label
from fibctl.db import schema
from fibctl.db.store import run_row, upsert
from fibctl.errors import FibctlError, shown_path
from fibctl.matrix import load_matrix
from fibctl.names import is_name

STUDY_MATRIX = "paper"
STUDY_LENGTH = 1024
STUDY_INIT_SEED = 42  # the paper matrix's shared init seed, for the reproducing config
DENSE_BASELINE = "ref_e0000"
INT32 = 2**31 - 1  # the schema's Integer columns are 32-bit on PostgreSQL
INT64 = 2**63 - 1  # SQLite's integers
_TOPS = {INT32: "2**31 - 1", INT64: "2**63 - 1", SEED_MAX: "2**32 - 1"}  # how an error names a range's top
STEP_MIN = -1  # step -1: the study's mark for the final step (eval_results)
MEASURED = "(ppl IS NOT NULL OR loss IS NOT NULL)"  # a metrics row that holds a measurement

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


def _columns(table: str) -> str:
    """The columns of a study table that the import reads (EXPECTED's), never `*`: a column it
    does not read is never computed (a generated one of a crafted file that fails or is vast
    stopped the import, or took gigabytes a row)."""
    return ", ".join(EXPECTED[table])


@dataclass(frozen=True)
class StudyRun:
    name: str
    base: str | None
    schedule: str
    window: int | None
    seed: int
    seed_named: bool = False  # the name says the seed (`_s43`); else 42 by the study's naming


@dataclass
class ImportSummary:
    """What an import wrote: rows inserted or changed, not rows that were already as read."""
    runs: int = 0
    evaluations: int = 0
    aux_metrics: int = 0
    probe_runs: int = 0
    position_losses: int = 0
    skipped: list[str] = field(default_factory=list)  # study runs with no fibctl meaning
    unfinished: list[str] = field(default_factory=list)  # study runs with no `done` attempt
    unmeasured: list[str] = field(default_factory=list)  # sparse runs imported with no perplexity in fib.db


def study_run(title: str, where: str = "study run name") -> StudyRun | None:
    """What a published run name means, or None for names outside the study's matrix; a
    window or seed out of range is an error (`where`: the file it came from)."""
    if title == DENSE_BASELINE:
        return StudyRun(title, None, "dense", None, 42)
    m = _TITLE.fullmatch(title)  # not match: `$` also matches before a final newline
    if not m:
        return None

    def number(group: str, top: int) -> int | None:
        text = m[group]  # int() of at most 19 digits: Python refuses to parse thousands
        return None if text is None else _num(int(text) if len(text) < 20 else text, f"{where}: {group}",
                                              f"in run name {_shown(title)}", integer=True, hi=top)

    seed = number("seed", SEED_MAX)
    return StudyRun(title, _BASES[m["base"]], _SCHEDULES[m["schedule"]], number("window", INT32),
                    42 if seed is None else seed, seed_named=seed is not None)


def import_study(engine: Engine, fib_db: str | Path, lenextrap: str | Path | None = None,
                 posloss: str | Path | None = None) -> ImportSummary:
    """Load the study's database (and optionally its two JSON dumps) into `engine`'s schema."""
    check_inputs(fib_db, lenextrap, posloss)
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
    except sqlite3.Error as e:  # only the study raises these (SQLAlchemy wraps the output's): damaged, bad UTF-8
        raise FibctlError(f"study database {fib_db.name}: cannot read it ({_cut(str(e), 80)})") from None
    finally:
        study.close()
    return summary


# --- reading the study's files -------------------------------------------------------------

def check_inputs(fib_db: str | Path, lenextrap: str | Path | None = None, posloss: str | Path | None = None) -> None:
    """The study's files are there: checked before anything is read or an output database made."""
    for path, what in ((fib_db, "the study's SQLite database, fib.db"), (lenextrap, "the study's lenextrap.json"),
                       (posloss, "the study's posloss.json")):
        if path is None or Path(path).is_file():
            continue
        if not str(path).strip():
            raise FibctlError(f"an empty path where {what} was expected")
        if Path(path).is_dir():
            raise FibctlError(f"{shown_path(path)} is a folder, not a file (expected {what})")
        if Path(path).exists():  # /dev/null, a pipe: reading one would find nothing, or wait
            raise FibctlError(f"{shown_path(path)} is not a regular file (expected {what})")
        raise FibctlError(f"{shown_path(path)}: no such file (expected {what})")


def _open_study(path: Path) -> sqlite3.Connection:
    """The study's database, read-only. Where no -wal file holds anything (the published
    fib.db is a WAL database, its -wal absent or empty) it is opened immutable: SQLite then
    makes no -wal and -shm files beside it, and reads it from a folder or disk it cannot write
    (plain `mode=ro` needs an -shm file there, and fails without one). A non-empty -wal holds
    rows the file does not yet: read through it."""
    wal = path.with_name(path.name + "-wal")
    try:
        immutable = not wal.exists() or wal.stat().st_size == 0
    except OSError:
        immutable = False
    uri = f"file:{quote(str(path.resolve()))}?mode=ro{'&immutable=1' if immutable else ''}"
    conn = sqlite3.connect(uri, uri=True)
    conn.row_factory = sqlite3.Row
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as e:
        conn.close()
        if getattr(e, "sqlite_errorname", "") == "SQLITE_NOTADB":
            raise FibctlError(f"{shown_path(path)}: not an SQLite database; expected the study's fib.db") from None
        raise FibctlError(f"{shown_path(path)}: cannot read it ({_cut(str(e), 80)})") from None
    if "alembic_version" in tables:  # a fibctl database (its schema revision table)
        conn.close()
        raise FibctlError(f"{shown_path(path)} is a fibctl results database, not the study's fib.db; the reports "
                          "read it as it is (--db, or --compare beside another)")
    for table, columns in EXPECTED.items():
        have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")} if table in tables else set()
        missing = [c for c in columns if c not in have]
        if missing:
            conn.close()
            what = f"table {table!r} lacks columns {', '.join(missing)}" if have else f"no table {table!r}"
            raise FibctlError(f"{shown_path(path)}: {_cut(what, 120)}; not the layout of the study's fib.db "
                              "(docs/method.md, 'The published files')")
    return conn


def _load_json(path: str | Path, layout: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting too deep
        raise FibctlError(f"{shown_path(path)}: cannot read JSON ({_cut(str(e), 80)}); expected {layout}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise FibctlError(f"{shown_path(path)}: expected an object {layout}")
    return data


# Every value read from the study's files is checked where it is read: a bad one ends the
# import (rolled back) with one line naming the file, column, row and value.

def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _shown(value) -> str:
    return _cut(repr(value))  # repr: quotes, and newlines escaped (one line)


def _bad(what: str, value, of: str, expected: str) -> FibctlError:
    return FibctlError(f"{what} = {_shown(value)}{' ' + of if of else ''} is not {expected}")


def _num(value, what: str, of: str = "", *, lo: float = 0, hi: float = math.inf, integer: bool = False,
         positive: bool = False, null: bool = False):
    """`value` if it is a finite number (an int with `integer`) from `lo` to `hi` (above 0 with
    `positive`), or None with `null`; else the error for `what` (file: column) `of` (row)."""
    if value is None and null:
        return None
    try:
        ok = (isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and lo <= value <= hi and not (positive and value <= 0))
    except OverflowError:  # an int too large for a float
        ok = False
    if ok:
        return value if integer else float(value)
    if positive:
        raise _bad(what, value, of, "a finite positive number")
    if integer:
        raise _bad(what, value, of, f"an integer from {lo} to {_TOPS.get(hi, hi)}")
    raise _bad(what, value, of, f"a number from {lo} to {hi}" if hi < math.inf else
               "a finite number" if lo == -math.inf else f"a finite number >= {lo}")


def _text(value, what: str, of: str = "", limit: int = 100) -> str:
    """A name (dataset, metric): a string that fits its column (String(100) on PostgreSQL)."""
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise _bad(what, value, of, f"a name of 1 to {limit} characters")
    return value


def _dataset(value, what: str, of: str = "") -> str:
    """A held-out set's name: an identifier, as fibctl's own are (docs/cli.md), since figures
    and reports name files and columns after it."""
    if not is_name(value):
        raise _bad(what, value, of, "a held-out set name (up to 100 letters, digits, _ - .)")
    return value


def _time(value, what: str, of: str = "") -> datetime | None:
    """The study's ISO timestamps as naive UTC (how the schema stores times)."""
    if value is None or value == "":
        return None
    try:
        t = datetime.fromisoformat(value)
        return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t
    except (TypeError, ValueError, OverflowError):  # OverflowError: year 1 moved to UTC
        raise _bad(what, value, of, "an ISO 8601 timestamp") from None


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


@functools.cache
def _matrix_configs() -> dict[str, RunConfig]:
    return {c.name: c for c in load_matrix(STUDY_MATRIX).resolve()}


def _run_values(run: StudyRun, source: str, final_step: int, **details) -> dict:
    # a run of the paper matrix gets its config there (its micro-batch split included), so that
    # queueing the matrix beside the imported study finds the same runs
    config = _matrix_configs().get(run.name)
    if config is None or config.seed != run.seed:
        config = RunConfig.resolve(
            run.name, STUDY_MATRIX, "paper", schedule=run.schedule, base=run.base or "fib",
            window=run.window if run.window is not None else 8, seed=run.seed, init_seed=STUDY_INIT_SEED)
    # The study seeded its runs after building the model: data_seed is its run seed, and its
    # initial weights came from whatever state the generator had: no init seed (NULL).
    # its windows: numpy's global generator, the sampler fibctl records as numpy
    return run_row(config, init_seed=None, status=schema.RunStatus.DONE,
                   final_step=final_step, source=source, sampler="numpy", **details)


@dataclass(frozen=True)
class _Imported:
    id: int
    final_step: int


def _import_runs(conn: Connection, study: sqlite3.Connection, source: str,
                 summary: ImportSummary) -> dict[str, _Imported]:
    """Each study run's chosen attempt with its evaluations and auxiliary metrics."""
    out = {}
    where = f"study database {shown_path(source)}"
    ends = _measured_ends(study)
    for title, attempts in _attempts(study, where).items():
        run = study_run(title, where)
        chosen = _chosen_attempt(attempts, ends)
        if run is None or chosen is None:
            (summary.skipped if run is None else summary.unfinished).append(title)
            continue
        of = f"for run {_shown(title)}"
        run = _recorded_seed(run, chosen["seed"], f"{where}: runs.seed", of)
        final_step = _final_step(study, chosen["id"], where, of)
        count = dict(integer=True, hi=INT64, null=True)
        details = dict(
            attempts=len(attempts),
            created_at=_time(chosen["created_at"], f"{where}: runs.created_at", of) or _now(),
            started_at=_time(chosen["started_at"], f"{where}: runs.started_at", of),
            finished_at=_time(chosen["ended_at"], f"{where}: runs.ended_at", of),
            wall_seconds=_num(chosen["wall_seconds"], f"{where}: runs.wall_seconds", of, null=True),
            params_total=_num(chosen["params_effective"], f"{where}: runs.params_effective", of, **count) or None,
            tokens_trained=_num(chosen["tokens_trained"], f"{where}: runs.tokens_trained", of, **count))
        run_id, written = _put_run(conn, _run_values(run, source, final_step, **details))
        out[title] = _Imported(run_id, final_step)
        summary.runs += written
        summary.evaluations += _import_metrics(conn, study, chosen["id"], run_id, where, of)
        if chosen["id"] not in ends and run.schedule != "dense":  # the dense baseline's are in lenextrap.json
            summary.unmeasured.append(title)
        summary.aux_metrics += _import_eval_results(conn, study, chosen["id"], run_id, final_step, where, of)
    return out


def _recorded_seed(run: StudyRun, seed, what: str, of: str) -> StudyRun:
    """The run with the seed fib.db records for it: a name without `_s<seed>` is seed 42 only
    by the study's naming, so the recorded seed decides; a name that says another is an error."""
    seed = _num(seed, what, of, integer=True, hi=SEED_MAX, null=True)
    if seed is None or seed == run.seed:
        return run
    if run.seed_named:
        raise FibctlError(f"{what} = {seed} {of} disagrees with the seed its name says ({run.seed})")
    return dataclasses.replace(run, seed=seed)


def _attempts(study: sqlite3.Connection, where: str) -> dict[str, list[sqlite3.Row]]:
    out: dict[str, list[sqlite3.Row]] = {}
    for row in study.execute(f"SELECT {_columns('runs')} FROM runs ORDER BY id"):
        title = _text(row["title"], f"{where}: runs.title", f"for id {_shown(row['id'])}", limit=200)
        out.setdefault(title, []).append(row)
    return out


def _measured_ends(study: sqlite3.Connection) -> dict[int, tuple[int, int]]:
    """Each study id with measurements: (its last measured step, the most tokens measured
    there). Values of another type rank lowest here; the chosen attempt's are checked on import."""
    def rank(value) -> int:
        return value if isinstance(value, int) else -1

    ends: dict[int, tuple[int, int]] = {}
    for run_id, step, tokens in study.execute(f"SELECT run_id, step, eval_tokens FROM metrics WHERE {MEASURED}"):
        end = (rank(step), rank(tokens))
        ends[run_id] = max(ends.get(run_id, end), end)
    return ends


def _chosen_attempt(attempts: list[sqlite3.Row], ends: dict[int, tuple[int, int]]) -> sqlite3.Row | None:
    """Of the `done` attempts with metrics, the one measured at the latest step on the most
    tokens there (the full evaluation Table 1 reads, not a light one recorded again), the last
    of equals; else the last `done` one; a reference run (trained elsewhere, never 'done'
    here) as is."""
    done = [a for a in attempts if a["status"] == schema.RunStatus.DONE]
    if done:
        measured = [(ends[a["id"]], i) for i, a in enumerate(done) if a["id"] in ends]
        return done[max(measured)[1]] if measured else done[-1]
    refs = [a for a in attempts if a["variant_or_baseline"] == "reference"]
    return refs[-1] if refs else None


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _final_step(study: sqlite3.Connection, study_id: int, where: str, of: str) -> int:
    """The last step with a perplexity measured (a metrics row without one measures nothing);
    else the last with an auxiliary result; else the paper recipe's last step."""
    for table, measured in (("metrics", MEASURED), ("eval_results", "1 = 1")):
        steps = [_num(step, f"{where}: {table}.step", of, integer=True, lo=STEP_MIN, hi=INT32)
                 for (step,) in study.execute(f"SELECT step FROM {table} WHERE run_id = ? AND {measured}",
                                              (study_id,))]
        if steps and max(steps) >= 0:
            return max(steps)
    return get_preset("paper").train.steps


def _import_metrics(conn: Connection, study: sqlite3.Connection, study_id: int, run_id: int,
                    where: str, of: str) -> int:
    # one row per key (a study table without its primary key may repeat one; PostgreSQL
    # refuses an upsert that meets a key twice): the one on most tokens, then the last
    rows = {}
    for r in study.execute(f"SELECT {_columns('metrics')} FROM metrics WHERE run_id = ? AND {MEASURED}",
                           (study_id,)):
        at = f"{of} step {_shown(r['step'])}"  # the step itself was checked by _final_step
        loss = _num(r["loss"], f"{where}: metrics.loss", at, null=True)
        if r["ppl"] is None:  # perplexity is exp(loss): derived where only the loss was kept
            ppl = _num(_exp(loss), f"{where}: exp(metrics.loss)", at, positive=True)
        else:
            ppl = _num(r["ppl"], f"{where}: metrics.ppl", at, positive=True)
        row = dict(run_id=run_id, step=r["step"], dataset=_dataset(r["dataset"], f"{where}: metrics.dataset", at),
                   eval_length=STUDY_LENGTH,
                   tokens=_num(r["eval_tokens"], f"{where}: metrics.eval_tokens", at, integer=True, hi=INT64,
                               null=True),
                   ppl=ppl, loss=math.log(ppl) if loss is None else loss,
                   created_at=_time(r["recorded_at"], f"{where}: metrics.recorded_at", at))
        key = row["step"], row["dataset"]
        kept = rows.get(key)
        if kept is not None and (kept["tokens"] or 0) == (row["tokens"] or 0) and kept["ppl"] != row["ppl"]:
            # not a repeated row but two measurements: a column fibctl does not read (a newer
            # layout's length, say) tells them apart, and choosing one would be a guess
            raise FibctlError(f"{where}: metrics {of} step {row['step']} dataset {_shown(row['dataset'])}: two "
                              f"perplexities on {'unrecorded' if row['tokens'] is None else format(row['tokens'], ',')} tokens ({kept['ppl']:.6g} and "
                              f"{row['ppl']:.6g}); expected one")
        if kept is None or (row["tokens"] or 0) >= (kept["tokens"] or 0):
            rows[key] = row
    return upsert(conn, schema.Evaluation.__table__, list(rows.values()), ("run_id", "step", "dataset", "eval_length"))


def _import_eval_results(conn: Connection, study: sqlite3.Connection, study_id: int, run_id: int,
                         final_step: int, where: str, of: str) -> int:
    latest: dict[tuple[str, str], dict] = {}
    for r in study.execute(f"SELECT {_columns('eval_results')} FROM eval_results WHERE run_id = ? ORDER BY id",
                           (study_id,)):
        at = f"{of} step {_shown(r['step'])}"
        step = _num(r["step"], f"{where}: eval_results.step", of, integer=True, lo=STEP_MIN, hi=INT32)
        # 85 characters: with '@step<N>' the name still fits aux_metrics.name (100)
        eval_name = _text(r["eval_name"], f"{where}: eval_results.eval_name", at, limit=85)
        name = eval_name if step in (final_step, -1) else f"{eval_name}@step{step}"
        metric = _text(r["metric"], f"{where}: eval_results.metric", at)
        latest[(name, metric)] = dict(run_id=run_id, name=name, metric=metric, text=None,
                                      value=_num(r["value"], f"{where}: eval_results.value", at, lo=-math.inf))
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
    where = f"study database {shown_path(source)}: retrieval_results"
    models: dict[tuple[int, int, int], list[sqlite3.Row]] = {}
    for r in study.execute(f"SELECT {_columns('retrieval_results')} FROM retrieval_results "
                           "WHERE source = 'marked' AND kind = 'target' "
                           "ORDER BY depth, staggered, seed, distance"):
        key = (_num(r["depth"], f"{where}.depth", "in a 'marked' row", integer=True, lo=1, hi=INT32),
               _num(r["staggered"], f"{where}.staggered", "in a 'marked' row", integer=True, hi=1),
               _num(r["seed"], f"{where}.seed", "in a 'marked' row", integer=True, hi=SEED_MAX))
        models.setdefault(key, []).append(r)
    for (depth, staggered, seed), rows in models.items():
        name = f"probe_marked_d{depth}_{'stagger' if staggered else 'uniform'}_s{seed}"
        config = _probe_config(name, depth, seed, bool(staggered))
        run_id, written = _put_run(conn, run_row(config, init_seed=None, status=schema.RunStatus.DONE,
                                                 final_step=PROBE_STEPS, source=source,
                                                 created_at=_now()))
        of = f"for {name}"
        accs: dict[str, float] = {}
        for r in rows:
            distance = _num(r["distance"], f"{where}.distance", of, integer=True, hi=INT32)
            acc = _num(r["acc"], f"{where}.acc", of, hi=1)
            if accs.setdefault(f"acc_d{distance}", acc) != acc:
                raise FibctlError(f"{where}.acc: {name} has two accuracies at distance {distance} "
                                  f"({accs[f'acc_d{distance}']} and {acc}); expected one")
        metrics = {"depth": depth, "staggered_init": staggered, "eval_sequences": STUDY_SCORED, **accs}
        # the study's length and vocabulary, the distances it scored: as a fibctl probe records its task
        task = task_label(config.model.seq_len, config.model.vocab_size,
                          sorted(int(k[len("acc_d"):]) for k in accs))
        written += upsert(conn, schema.AuxMetric.__table__,
                           [dict(run_id=run_id, name=PROBE_METRICS, metric=k, value=float(v), text=None)
                            for k, v in metrics.items()]
                           + [dict(run_id=run_id, name=PROBE_METRICS, metric="task", value=None, text=task)],
                           ("run_id", "name", "metric"))
        alphas = _alphas(rows[0]["alphas"], f"{where}.alphas", of, depth)
        for r in rows[1:]:
            other = _alphas(r["alphas"], f"{where}.alphas", of, depth)
            if other != alphas:
                raise FibctlError(f"{where}.alphas: {name} has two different lists ({_shown(alphas)} and "
                                  f"{_shown(other)}); expected one per probe model")
        written += upsert(conn, schema.Alpha.__table__,
                           [dict(run_id=run_id, step=PROBE_STEPS, layer=i, alpha=a) for i, a in enumerate(alphas)],
                           ("run_id", "step", "layer"))
        summary.probe_runs += bool(written)  # a probe model whose row, accuracies or alphas were written


def _alphas(text: str | None, what: str, of: str, depth: int) -> list[float]:
    """A probe model's final alphas: one per layer."""
    try:
        alphas = json.loads(text or "")
    except (TypeError, ValueError, RecursionError):
        alphas = None
    if not isinstance(alphas, list) or len(alphas) != depth:
        raise _bad(what, text, of, f"a JSON list of {depth} numbers (one per layer)")
    return [_num(a, f"{what}[{i}]", of, lo=-math.inf) for i, a in enumerate(alphas)]  # json reads NaN


def _json_run(conn: Connection, title: str, source: str, runs: dict[str, _Imported],
              summary: ImportSummary) -> _Imported:
    """A run named in a JSON dump: imported from fib.db, or created from its name alone."""
    if title in runs:
        return runs[title]
    run = study_run(title, source)
    if run is None:
        raise FibctlError(f"{shown_path(source)}: {_shown(title)} is not a study run name "
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
        of = f"for run {_shown(title)}"
        for length, by_dataset in by_length.items():
            if not isinstance(by_dataset, dict):
                raise FibctlError(f"{shown_path(source)}: run {_shown(title)} length {_shown(length)}: expected "
                                  "{length: {dataset: ppl}} with integer lengths and positive perplexities")
            # int() only of ASCII digits, few enough to parse ('²' is a digit to str.isdigit)
            n = _num(int(length) if re.fullmatch(r"[0-9]{1,12}", length) else length, f"{shown_path(source)}: length", of,
                     integer=True, lo=1, hi=INT32)
            for ds, v in by_dataset.items():
                _dataset(ds, f"{shown_path(source)}: dataset", f"{of} length {n}")
                ppl = _num(v, f"{shown_path(source)}: ppl", f"{of} length {n} dataset {_shown(ds)}", positive=True)
                rows.append(dict(run_id=run.id, step=run.final_step, dataset=ds, eval_length=n, tokens=None,
                                 ppl=ppl, loss=math.log(ppl), created_at=None))
    summary.evaluations += upsert(conn, schema.Evaluation.__table__, rows,
                                   ("run_id", "step", "dataset", "eval_length"), replace=False)


def _import_posloss(conn: Connection, data: dict, source: str, runs: dict[str, _Imported],
                    summary: ImportSummary) -> None:
    for title, by_dataset in data.items():
        run = _json_run(conn, title, source, runs, summary)
        rows = []
        for ds, entry in by_dataset.items():
            of = f"for run {_shown(title)} dataset {_shown(ds)}"
            if not (isinstance(entry, dict) and isinstance(entry.get("per_position"), list)
                    and isinstance(entry.get("n_windows"), int) and isinstance(entry.get("seq_len"), int)):
                raise FibctlError(f"{shown_path(source)}: expected {{per_position: [losses], n_windows: int, seq_len: "
                                  f"int}} {of}")
            _dataset(ds, f"{shown_path(source)}: dataset", f"for run {_shown(title)}")
            seq_len = _num(entry["seq_len"], f"{shown_path(source)}: seq_len", of, integer=True, lo=2, hi=INT32)
            windows = _num(entry["n_windows"], f"{shown_path(source)}: n_windows", of, integer=True, lo=1, hi=INT32)
            if len(entry["per_position"]) != seq_len - 1:  # Table 4's bins span the whole window
                raise FibctlError(f"{shown_path(source)}: {len(entry['per_position'])} per-position losses {of}; "
                                  f"expected seq_len - 1 = {seq_len - 1} (one per predicted position of the window)")
            rows += [dict(run_id=run.id, step=run.final_step, dataset=ds, eval_length=seq_len, position=i,
                          mean_loss=_num(v, f"{shown_path(source)}: per_position[{i}]", of), windows=windows)
                     for i, v in enumerate(entry["per_position"])]
        summary.position_losses += upsert(conn, schema.PositionLoss.__table__, rows,
                                           ("run_id", "step", "dataset", "eval_length", "position"))
