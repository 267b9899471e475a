"""`fibctl db copy`: a whole results database into another (SQLite to a team's PostgreSQL,
say), run by run.

Runs are matched by name and every metric by its natural key, so copying again changes
nothing and a target that already holds other runs keeps them. Row ids are the target's own
(a PostgreSQL sequence would collide with copied ids). A run the target trained itself under
the same name with another config is refused, naming it, before anything is written.
Events have no natural key: a run's events are copied when the target has none for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from fibctl.db import schema
from fibctl.db.store import upsert
from fibctl.errors import FibctlError

# tables keyed by run: (model, its natural key without run_id)
METRIC_TABLES = (schema.TrainStep, schema.Evaluation, schema.PositionLoss, schema.Alpha, schema.AuxMetric)
RUN_COLUMNS = [c.name for c in schema.Run.__table__.columns if c.name != "id"]


@dataclass
class CopySummary:
    rows: dict[str, int] = field(default_factory=dict)  # table -> rows written or changed

    @property
    def written(self) -> int:
        return sum(self.rows.values())


def copy_database(source: Engine, target: Engine, *, batch: int = 5000) -> CopySummary:
    """Copy every run with its metrics and events from `source` into `target` (both at the
    current schema revision)."""
    runs = schema.Run.__table__
    with source.connect() as src:
        rows = [dict(r._mapping) for r in src.execute(select(runs).order_by(runs.c.id))]
    with target.connect() as dst:
        theirs = {r.name: r.config_hash for r in dst.execute(select(runs.c.name, runs.c.config_hash))}
    clashes = [r["name"] for r in rows if r["name"] in theirs and theirs[r["name"]] != r["config_hash"]]
    if clashes:
        raise FibctlError(f"the target already has run(s) {', '.join(map(repr, clashes[:5]))} with another "
                          "config; nothing was copied")
    summary = CopySummary()
    with target.begin() as dst:
        summary.rows["runs"] = upsert(dst, runs, [{c: r[c] for c in RUN_COLUMNS} for r in rows], ("name",))
        ids = {name: id_ for id_, name in dst.execute(select(runs.c.id, runs.c.name))}
    id_map = {r["id"]: ids[r["name"]] for r in rows}
    for model in METRIC_TABLES:
        table = model.__table__
        columns = [c.name for c in table.columns if c.name != "id"]
        written = 0
        with source.connect() as src, target.begin() as dst:
            result = src.execution_options(stream_results=True).execute(select(table).order_by(table.c.id))
            while chunk := result.fetchmany(batch):
                written += upsert(dst, table, [{c: (id_map[r.run_id] if c == "run_id" else getattr(r, c))
                                                for c in columns} for r in chunk])
        summary.rows[table.name] = written
    summary.rows["events"] = _copy_events(source, target, id_map)
    return summary


def _copy_events(source: Engine, target: Engine, id_map: dict[int, int]) -> int:
    events = schema.Event.__table__
    with target.connect() as dst:
        has = {run_id for (run_id,) in dst.execute(select(events.c.run_id).group_by(events.c.run_id))}
    columns = [c.name for c in events.columns if c.name != "id"]
    with source.connect() as src:
        rows = [{c: (id_map.get(r.run_id) if c == "run_id" else getattr(r, c)) for c in columns}
                for r in src.execute(select(events).order_by(events.c.id))]
    new = [r for r in rows if r["run_id"] is not None and r["run_id"] not in has]
    if new:
        with target.begin() as dst:
            dst.execute(events.insert(), new)
    return len(new)


def counts(engine: Engine) -> dict[str, int]:
    """Rows per table, to compare a copy with its source."""
    out = {}
    with engine.connect() as conn:
        for model in (schema.Run, *METRIC_TABLES, schema.Event):
            out[model.__tablename__] = conn.execute(select(func.count()).select_from(model.__table__)).scalar()
    return out
