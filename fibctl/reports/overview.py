"""One run at a glance (`fibctl queue show NAME`): its queue state, config, provenance, last
logged training step, the perplexities of its last evaluation and its latest events, read
from the results database in one read-only pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from fibctl.config import RunConfig
from fibctl.db.schema import Evaluation, Event, Run, TrainStep
from fibctl.errors import FibctlError


@dataclass
class Overview:
    run: dict  # the runs row, by column
    config: RunConfig | None  # None: its stored config is not a fibctl config (`config_error` says why)
    config_error: str | None = None
    last_step: dict | None = None  # the newest train_steps row
    eval_step: int | None = None  # the step of the evaluations below: the final one if evaluated, else the newest
    perplexity: dict[str, dict[int, float]] = field(default_factory=dict)  # dataset -> length -> ppl
    events: list[dict] = field(default_factory=list)  # the newest, oldest first
    event_count: int = 0


def overview(engine: Engine, name: str, *, events: int = 10) -> Overview:
    """The run named `name`, with at most `events` of its newest events; FibctlError for a
    name no run has."""
    from fibctl.queue import no_run_named, stored_config

    with engine.connect() as conn:
        row = conn.execute(select(Run).where(Run.name == name)).mappings().first()
        if row is None:
            raise no_run_named([name], conn.execute(select(Run.name)).scalars(), advice=" (see fibctl queue ls)")
        run = dict(row)
        found = Overview(run=run, config=None)
        try:
            found.config = stored_config(name, run["config_json"])
        except FibctlError as e:
            found.config_error = str(e)
        last = conn.execute(select(TrainStep).where(TrainStep.run_id == run["id"])
                            .order_by(TrainStep.step.desc()).limit(1)).mappings().first()
        found.last_step = dict(last) if last else None
        steps = {s for (s,) in conn.execute(select(Evaluation.step).where(Evaluation.run_id == run["id"]).distinct())}
        if steps:
            found.eval_step = run["final_step"] if run["final_step"] in steps else max(steps)
            for dataset, length, ppl in conn.execute(
                    select(Evaluation.dataset, Evaluation.eval_length, Evaluation.ppl)
                    .where(Evaluation.run_id == run["id"], Evaluation.step == found.eval_step)
                    .order_by(Evaluation.dataset, Evaluation.eval_length)):
                found.perplexity.setdefault(dataset, {})[length] = ppl
        found.event_count = conn.execute(select(func.count()).select_from(Event)
                                         .where(Event.run_id == run["id"])).scalar_one()
        newest = conn.execute(select(Event.time, Event.kind, Event.message).where(Event.run_id == run["id"])
                              .order_by(Event.id.desc()).limit(events)).mappings().all()
        found.events = [dict(e) for e in reversed(newest)]
    return found
