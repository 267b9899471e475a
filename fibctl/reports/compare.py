"""`fibctl compare`: runs side by side, as a sweep's reader wants them: the settings that differ,
then how each trained and what it scored at its final step."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from fibctl.config import differing, flatten
from fibctl.errors import FibctlError
from fibctl.reports.overview import Overview, overview
from fibctl.reports.tables import sampler_notes

MAX_RUNS = 12  # side by side; more would not be read as a comparison (Table 1 lists many)


@dataclass
class Comparison:
    runs: list[str]
    settings: dict[str, list]  # dotted setting -> each run's value (every setting with `every`)
    trained: dict[str, list]  # status, step, eval step, tokens, seconds, loss, tokens/s -> each run's
    perplexity: dict[tuple[str, int], list]  # (held-out set, length) -> each run's at its evaluated step
    notes: list[str] = field(default_factory=list)  # what no column shows: windows drawn otherwise


def compare(engine: Engine, names: list[str], *, every: bool = False) -> Comparison:
    """The runs named, in the order given (a name given twice is compared once)."""
    names = list(dict.fromkeys(names))
    if not 2 <= len(names) <= MAX_RUNS:
        raise FibctlError(f"compare takes 2 to {MAX_RUNS} different run names, got {len(names)}")
    found = [overview(engine, name, events=0) for name in names]
    return Comparison(names, _settings(found, every), _trained(found), _perplexity(found),
                      sampler_notes(engine, names))


# what a dense run's config carries but dense attention does not use (a window of 0 read as
# a setting): None, not applicable, as the runs table, the tables and `queue show` have it
DENSE_UNUSED = ("model.base", "model.window", "model.n_rungs")


def _settings(found: list[Overview], every: bool) -> dict[str, list]:
    flat = [flatten(o.config.to_dict()) if o.config is not None else {} for o in found]
    for f in flat:
        f.pop("name", None)
        f.pop("probe", None)  # null on every run but the probe's, whose settings are probe.*
    applied = [{k: None if k in DENSE_UNUSED and f.get("model.schedule") == "dense" else v for k, v in f.items()}
               for f in flat]
    keys = sorted(set().union(*flat), key=lambda k: (k.count("."), k))  # the run's own first, then model, train
    shown = {k: [f.get(k) for f in applied] for k in keys}
    # a setting differs where both the configs and what applies of them do: dense beside a
    # sparse run is not said to differ in base (unused beside "fib"), nor two dense runs in K
    varied = differing(flat) & differing(applied)
    return {k: values for k, values in shown.items() if every or k in varied}


def _trained(found: list[Overview]) -> dict[str, list]:
    runs = [o.run for o in found]
    last = [o.last_step or {} for o in found]
    return {
        "status": [r["status"] for r in runs],
        "step": [r["final_step"] for r in runs],
        "eval step": [o.eval_step for o in found],
        "tokens": [r["tokens_trained"] for r in runs],
        "seconds": [r["wall_seconds"] for r in runs],
        "loss": [s.get("loss") for s in last],  # the last logged step's, as tokens/s
        "tokens/s": [s.get("tokens_per_s") for s in last],
        "sampler": [r["sampler"] for r in runs],  # what drew its windows (runs.sampler)
    }


def _perplexity(found: list[Overview]) -> dict[tuple[str, int], list]:
    cells = sorted({(d, n) for o in found for d, by in o.perplexity.items() for n in by})
    return {(d, n): [o.perplexity.get(d, {}).get(n) for o in found] for d, n in cells}
