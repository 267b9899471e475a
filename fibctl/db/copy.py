"""`fibctl db copy`: a whole results database into another (SQLite to a team's PostgreSQL,
say), in one transaction: a copy stopped part-way writes nothing.

Runs are matched by name and every metric by its natural key, so copying again changes
nothing and a target that already holds other runs keeps them. Row ids are the target's own
(a PostgreSQL sequence would collide with copied ids). A run the target trained itself under
the same name with another config is refused, naming it, before anything is written.

A run never goes backwards: where the target has it as far along as the source or further
(done over running over failed or cancelled over queued, then the later final step), or
with a result the source's row lacks, the target's row stays as it is and of the source's
metrics for it only those the target has no row for are added; none of its rows is ever
replaced or deleted. A stale copy (the same runs queued again elsewhere, say) thus cannot
undo a trained run, nor make a worker train it again. Otherwise the source's row replaces
the target's, and its metrics replace the target's of the same key.
Events have no natural key: a run's events are copied when the target has none for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlalchemy import func, inspect, or_, select
from sqlalchemy.engine import Connection, Engine

from fibctl.db import schema
from fibctl.db.schema import RunStatus
from fibctl.db.store import upsert
from fibctl.errors import FibctlError

# tables keyed by run: (model, its natural key without run_id)
METRIC_TABLES = (schema.TrainStep, schema.Evaluation, schema.PositionLoss, schema.Alpha, schema.AuxMetric)
RUN_COLUMNS = [c.name for c in schema.Run.__table__.columns if c.name != "id"]
# how far along a run is; a failed or cancelled run has stopped, a running one may finish
PROGRESS = {RunStatus.QUEUED: 0, RunStatus.FAILED: 1, RunStatus.CANCELLED: 1, RunStatus.RUNNING: 2,
            RunStatus.DONE: 3}
# what training recorded about a run (a retried run is queued again but keeps them)
RESULT_COLUMNS = ("final_step", "tokens_trained", "wall_seconds", "params_total", "params_non_embedding",
                  "checkpoint_path")
# why a run stayed as the target has it, as the summary says it
FURTHER, MORE_RESULTS, AS_FAR = "further along there", "with results the source lacks", \
    "as far along, recorded otherwise"


@dataclass
class CopySummary:
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows written or changed
    kept: dict[str, str] = field(default_factory=dict)  # run kept as the target has it -> why
    events_left: int = 0  # the source's events of runs the target has events of: not copied

    @property
    def written(self) -> int:
        return sum(self.rows.values())


def copy_database(source: Engine, target: Engine, *, batch: int = 5000) -> CopySummary:
    """Copy every run with its metrics and events from `source` into `target` (both at the
    current schema revision); a run the target has further along stays as it is there."""
    runs = schema.Run.__table__
    with source.connect() as src:
        rows = [dict(r._mapping) for r in src.execute(select(runs).order_by(runs.c.id))]
    summary = CopySummary()
    # one transaction: a copy stopped part-way (a signal, a lost server) leaves the target as it
    # was, never with done runs lacking their metrics. The target's runs are read, and locked
    # on PostgreSQL, in it: a worker cannot move one on in between
    with target.begin() as dst:
        theirs = {r.name: {c: r._mapping[c] for c in RUN_COLUMNS}
                  for r in dst.execute(select(runs).with_for_update())}
        _refuse_clashes(rows, {name: r["config_hash"] for name, r in theirs.items()})
        for r in rows:
            if r["name"] in theirs and (why := _kept_because(theirs[r["name"]], r)):
                summary.kept[r["name"]] = why
        taken = [{c: r[c] for c in RUN_COLUMNS} for r in rows if r["name"] not in summary.kept]
        _storable(dst, "runs", taken, lambda r: r["name"])
        summary.rows["runs"] = upsert(dst, runs, taken, ("name",))
        ids = {name: id_ for id_, name in dst.execute(select(runs.c.id, runs.c.name))}
        names = {id_: name for name, id_ in ids.items()}
        id_map = {r["id"]: ids[r["name"]] for r in rows}
        kept = {ids[name] for name in summary.kept}  # their metrics only add to the target's
        with source.connect() as src:
            for model in METRIC_TABLES:
                table = model.__table__
                columns = [c.name for c in table.columns if c.name != "id"]
                written = 0
                result = src.execution_options(stream_results=True).execute(select(table).order_by(table.c.id))
                while chunk := result.fetchmany(batch):
                    copied = [{c: (id_map[r.run_id] if c == "run_id" else getattr(r, c)) for c in columns}
                              for r in chunk]
                    _storable(dst, table.name, copied, lambda r: names[r["run_id"]])
                    written += upsert(dst, table, [r for r in copied if r["run_id"] not in kept])
                    written += upsert(dst, table, [r for r in copied if r["run_id"] in kept], replace=False)
                summary.rows[table.name] = written
            summary.rows["events"], summary.events_left = _copy_events(src, dst, id_map)
    return summary


def _refuse_clashes(rows: list[dict], hashes: dict[str, str]) -> None:
    """Refuse a copy of a run the target has with another config (`hashes`: the target's
    config hash by run name)."""
    clashes = [r["name"] for r in rows if r["name"] in hashes and hashes[r["name"]] != r["config_hash"]]
    if clashes:
        raise FibctlError(f"the target already has run(s) {', '.join(map(repr, clashes[:5]))} with another "
                          "config; nothing was copied")


def check_copy(source: Engine):
    """For `connect(check=)` on the target: its clashes refused before it is upgraded or
    switched to WAL mode, on the target as it is (runs.name and config_hash: every schema
    revision has them; a database fibctl has not written yet has no runs)."""
    def check(target: Engine) -> None:
        runs = schema.Run.__table__
        with target.connect() as conn:
            hashes = dict(conn.execute(select(runs.c.name, runs.c.config_hash)).all()) \
                if inspect(conn).has_table(runs.name) else {}
        with source.connect() as src:
            rows = [dict(r._mapping) for r in src.execute(select(runs.c.name, runs.c.config_hash))]
            _refuse_clashes(rows, hashes)
            if target.dialect.name == "sqlite":
                _metrics_storable(src)
    return check


def _metrics_storable(src: Connection) -> None:
    """The refusal `_storable` makes of the metric tables (every row of them is copied),
    found by a query on the source before the target is touched: the first NaN the copy
    would meet."""
    if src.dialect.name == "sqlite":  # SQLite stores a NaN as NULL: it has none to copy
        return
    runs = schema.Run.__table__
    for model in METRIC_TABLES:
        table = model.__table__
        floats = [c for c in table.columns if c.type.python_type is float]
        if not floats:
            continue
        nan = float("nan")  # PostgreSQL's NaN equals NaN
        hit = src.execute(select(table, runs.c.name.label("_run")).join(runs, runs.c.id == table.c.run_id)
                          .where(or_(*(c == nan for c in floats))).order_by(table.c.id).limit(1)).first()
        if hit is not None:
            row = {c.name: hit._mapping[c] for c in table.columns if c.name != "id"}
            _storable_to_sqlite(table.name, [row], lambda r: hit._mapping["_run"])


def _storable(dst: Connection, table: str, rows: list[dict], run_name) -> None:
    """Refuse a NaN (PostgreSQL holds it) bound for SQLite, which stores NULL instead: the copy
    would fail on a column that must have a value, and silently lose it in any other."""
    if dst.dialect.name == "sqlite":
        _storable_to_sqlite(table, rows, run_name)


def _storable_to_sqlite(table: str, rows: list[dict], run_name) -> None:
    for r in rows:
        for column, value in r.items():
            if isinstance(value, float) and math.isnan(value):
                raise FibctlError(f"{table}.{column} of run {run_name(r)!r} is NaN, which SQLite cannot hold "
                                  "(it reads back as NULL); nothing was copied")


def _kept_because(theirs: dict, mine: dict) -> str | None:
    """Why the target's row of a run stays as it is rather than becoming the source's; None
    where the source's row is the same or further along, and holds every result the
    target's does."""
    if all(theirs[c] == mine[c] for c in RUN_COLUMNS):
        return None
    if _progress(theirs) > _progress(mine):
        return FURTHER
    if any(theirs[c] is not None and (mine[c] is None or (c in ("final_step", "tokens_trained")
                                                          and mine[c] < theirs[c]))
           for c in RESULT_COLUMNS):
        return MORE_RESULTS
    return AS_FAR if _progress(theirs) == _progress(mine) else None


def _progress(run: dict) -> tuple[int, int]:
    return PROGRESS.get(run["status"], 0), -1 if run["final_step"] is None else run["final_step"]


def _copy_events(src: Connection, dst: Connection, id_map: dict[int, int]) -> tuple[int, int]:
    """(events copied, events left out because the target has events of their run)."""
    events = schema.Event.__table__
    has = {run_id for (run_id,) in dst.execute(select(events.c.run_id).group_by(events.c.run_id))}
    columns = [c.name for c in events.columns if c.name != "id"]
    rows = [{c: (id_map.get(r.run_id) if c == "run_id" else getattr(r, c)) for c in columns}
            for r in src.execute(select(events).order_by(events.c.id))]
    new = [r for r in rows if r["run_id"] is not None and r["run_id"] not in has]
    if new:
        dst.execute(events.insert(), new)
    return len(new), sum(r["run_id"] in has for r in rows)


def counts(engine: Engine) -> dict[str, int]:
    """Rows per table, to compare a copy with its source."""
    out = {}
    with engine.connect() as conn:
        for model in (schema.Run, *METRIC_TABLES, schema.Event):
            out[model.__tablename__] = conn.execute(select(func.count()).select_from(model.__table__)).scalar()
    return out
