"""The run queue: the `runs` table, worked off by any number of workers.

A run moves queued -> running -> done | failed; `cancel` and `retry` are the user's levers.
Claiming is one transaction (SQLite: BEGIN IMMEDIATE, see fibctl.db.engine; PostgreSQL:
SELECT ... FOR UPDATE SKIP LOCKED), so no two workers ever get the same run. A running
run whose heartbeat is older than the timeout is taken back by the next claim, and failed
once it has used `max_attempts` claims; a claim that ended in a clean release is not one.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import and_, bindparam, case, func, insert, inspect, null, or_, select, text, update
from sqlalchemy.engine import Connection, Engine

from fibctl import durable
from fibctl.config import RunConfig
from fibctl.db.schema import RUN_STATUSES, Event, Run, RunStatus, TrainStep
from fibctl.db.store import add_event, run_row, utcnow, write_retrying
from fibctl.errors import FibctlError, unknown
from fibctl.units import duration, eta_s

LIST_COLUMNS = ("id", "name", "matrix", "preset", "base", "schedule", "window", "seed", "init_seed",
                "data_seed", "status", "attempts", "worker", "host", "device", "optimizer", "heartbeat_at",
                "created_at", "started_at", "finished_at", "error")


@dataclass(frozen=True)
class ClaimedRun:
    id: int
    name: str
    attempts: int  # including this claim
    config: RunConfig
    checkpoint_path: str | None  # set when an earlier attempt saved one: resume from it


def add_runs(engine: Engine, configs: Sequence[RunConfig], *, seeded: bool = False,
             before_commit: Callable[[], None] | None = None) -> tuple[list[str], list[str]]:
    """Queue `configs`; returns (names added, names already present with the same config).

    All or nothing: a name that exists with a different config is an error naming the
    fields that differ, and nothing is added; so, for runs `seeded` by `queue add --seed`, is
    one whose config a run of another name has. `before_commit` is called last before the
    commit (`queue add` holds a Ctrl-C from there: one raised after the commit would leave
    it unable to tell whether the runs were queued).
    """
    names = [c.name for c in configs]
    with engine.begin() as conn:
        existing = _refuse_conflicts(conn, configs)
        if seeded:
            _refuse_repeated_configs(conn, configs)
        new = [c for c in configs if c.name not in existing]
        if new:
            conn.execute(insert(Run), [run_row(c) for c in new])
        if before_commit is not None:
            before_commit()
    return [c.name for c in new], [n for n in names if n in existing]


def added_line(added: Sequence[str], present: Sequence[str], what: str = "run") -> str:
    """What `queue add`, `probe` and the demo say of `add_runs`' result, in one wording."""
    return f"queued {len(added)} {what}(s); {len(present)} already present"


def _refuse_conflicts(conn: Connection, configs: Sequence[RunConfig]) -> dict:
    """The runs of `configs` the database has, by name; refused if any has another config.
    Reads runs.name, config_json and source only: every schema revision has them."""
    existing = {r.name: r for r in conn.execute(
        select(Run.name, Run.config_json, Run.source).where(Run.name.in_([c.name for c in configs])))}
    conflicts = [(c, _conflict(c, existing[c.name])) for c in configs if c.name in existing]
    conflicts = [(c, said) for c, said in conflicts if said]
    if conflicts:
        more = f" (and {len(conflicts) - 1} more run(s))" if len(conflicts) > 1 else ""
        # a probe's run names hold its depth, init, seed and steps, not its task's other
        # settings, and `fibctl probe` has no --suffix: another database holds such a probe
        way_out = ("a probe of other settings goes in another database (--db), or `fibctl queue rm` these runs first"
                   if all(c.probe is not None for c, _ in conflicts)
                   else "runs of other settings need other names (queue add --suffix)")
        raise FibctlError(f"already queued with a different config: {conflicts[0][1]}{more}; {way_out}")
    return existing


def _refuse_repeated_configs(conn: Connection, configs: Sequence[RunConfig]) -> None:
    """A run whose config another run has under its own name would train that model twice, and
    Tables 4 and 5 refuse the two as one cell's (`paper --only 'f*' --seed 43` makes f08's
    seed-43 run, which is the matrix's g01): refused, naming both."""
    ours = {c.config_hash: c.name for c in configs}
    held = conn.execute(select(Run.name, Run.config_hash).where(Run.config_hash.in_(list(ours))))
    clash = next(((ours[h], name) for name, h in held if name != ours[h]), None)
    if clash:
        raise FibctlError(f"--seed: run {clash[0]!r} would train the config of run {clash[1]!r}, already "
                          "queued; pick the runs with --only")


# --- checks before a write command changes the database (`fibctl.db.engine.connect`'s `check`):
# they refuse what the command's own transaction would, on the database as it is, so that a
# refused command neither upgrades it nor switches it to WAL mode. They read only what every
# schema revision has, and find no runs in a database fibctl has not written yet.

def _has_runs(conn: Connection) -> bool:
    return inspect(conn).has_table(Run.__tablename__)


def check_add(configs: Sequence[RunConfig], *, seeded: bool = False) -> Callable[[Engine], None]:
    def check(engine: Engine) -> None:
        with engine.connect() as conn:
            if _has_runs(conn):
                _refuse_conflicts(conn, configs)
                if seeded:
                    _refuse_repeated_configs(conn, configs)
    return check


def no_run_named(names: Sequence[str], known, where: str = "", advice: str = "") -> FibctlError:
    """The error for names no run has: the closest of the `known` run names if one is close (a
    run name is the likeliest thing to mistype: `fib_fixed_w9` for `fib_fixed_w8`), else the
    `advice`."""
    known = list(known)
    close = dict.fromkeys(m for n in names for m in difflib.get_close_matches(n, known, n=1))
    said = f"; did you mean {' or '.join(map(repr, close))}?" if close else advice
    return FibctlError(f"no run named {', '.join(map(repr, names))}{where}{said}")


def exists(engine: Engine, name: str) -> bool:
    """Whether a run of that name is in the database (of any revision, or none)."""
    with engine.connect() as conn:
        return _has_runs(conn) and conn.execute(select(Run.id).where(Run.name == name)).first() is not None


def _run_names(conn: Connection) -> list[str]:
    return list(conn.execute(select(Run.name)).scalars()) if _has_runs(conn) else []


def check_named(names: Sequence[str], hint: str = "") -> Callable[[Engine], None]:
    """Every name is a run's (train and eval name theirs): the wording claim_named and
    evaluation's find_runs use, before either may upgrade the database."""
    def check(engine: Engine) -> None:
        with engine.connect() as conn:
            found = set(conn.execute(select(Run.name).where(Run.name.in_(list(names)))).scalars()) \
                if _has_runs(conn) else set()
            missing = sorted(set(names) - found)
            if missing:  # every name read only now, for the closest
                raise no_run_named(missing, _run_names(conn), " in the database", hint)
    return check


def _check_status(name: str, refusal: Callable[[str], str | None]) -> Callable[[Engine], None]:
    def check(engine: Engine) -> None:
        with engine.connect() as conn:
            status = conn.execute(select(Run.status).where(Run.name == name)).scalar() if _has_runs(conn) else None
            if status is None:
                raise no_run_named([name], _run_names(conn))
        message = refusal(str(status))
        if message:
            raise FibctlError(message)
    return check


def check_cancel(name: str) -> Callable[[Engine], None]:
    return _check_status(name, lambda status: _not_from(name, status, CANCEL_FROM, "cancel"))


def check_retry(name: str, files: Callable[[str | None, str | None], None] | None = None
                ) -> Callable[[Engine], None]:
    """`files(runs_dir, checkpoint_path)`, as recorded: retry_from_start's own check of the
    run's folder, run here too so that its refusal comes before any upgrade."""
    return _then_files(_check_status(name, lambda status: _not_from(name, status, RETRY_FROM, "retry")), name, files)


def check_remove(name: str, files: Callable[[str | None, str | None], None] | None = None
                 ) -> Callable[[Engine], None]:
    return _then_files(_check_status(name, lambda status: _not_removable(name) if status == RunStatus.RUNNING
                                     else None), name, files)


def _then_files(status: Callable[[Engine], None], name: str,
                files: Callable[[str | None, str | None], None] | None) -> Callable[[Engine], None]:
    def check(engine: Engine) -> None:
        status(engine)
        if files is not None and (recorded := _recorded_files(engine, name)) is not None:
            files(*recorded)
    return check


def _has_runs_dir(conn: Connection) -> bool:
    return "runs_dir" in {c["name"] for c in inspect(conn).get_columns(Run.__tablename__)}


def _recorded_files(engine: Engine, name: str) -> tuple[str | None, str | None] | None:
    """The run's (runs_dir, checkpoint_path) as recorded; None where the schema predates
    `runs_dir` (revision 0005, whose upgrade rewrites the recorded paths)."""
    with engine.connect() as conn:
        if not _has_runs_dir(conn):
            return None
        row = conn.execute(select(Run.runs_dir, Run.checkpoint_path).where(Run.name == name)).first()
    return None if row is None else (row.runs_dir, row.checkpoint_path)


def stored_config(name: str, config_json: str | None) -> RunConfig:
    """A run's config as the database holds it; one line naming the run where that is not a
    fibctl config (a row edited by hand or written by another tool: damaged, or nested too
    deep for the JSON parser)."""
    try:
        return RunConfig.from_dict(json.loads(config_json))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise FibctlError(f"run {name!r}: its stored config is not a fibctl config ({reason[:80]}); "
                          f"remove it (fibctl queue rm {name}) and queue it again") from None


def _conflict(cfg: RunConfig, row) -> str | None:
    try:
        old = stored_config(row.name, row.config_json)
    except FibctlError:
        return f"{cfg.name} (its stored config, source {row.source}, is not a fibctl config)"
    fields = old.diff(cfg)
    return f"{cfg.name} differs in {', '.join(fields)}" if fields else None


def list_runs(engine: Engine, status: str | None = None) -> list[dict]:
    """Runs in queue order (id), optionally of one status."""
    if status is not None and status not in RUN_STATUSES:
        raise FibctlError(unknown("status", status, RUN_STATUSES))
    q = select(*(Run.__table__.c[c] for c in LIST_COLUMNS)).order_by(Run.id)
    if status is not None:
        q = q.where(Run.status == status)
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


def progress(engine: Engine) -> list[dict]:
    """Each running run with where it runs, its last logged step, training loss, throughput,
    ETA (fibctl.units.eta_s, as its training line has it) and heartbeat (from its newest
    `train_steps` row); `steps` and `eta_s` are None for a run whose stored config is damaged."""
    last = (select(TrainStep.run_id, func.max(TrainStep.step).label("step"))
            .group_by(TrainStep.run_id).subquery())
    q = (select(Run.name, Run.host, Run.device, Run.worker, Run.heartbeat_at, Run.config_json,
                TrainStep.step, TrainStep.loss, TrainStep.tokens_per_s, TrainStep.elapsed_s)
         .outerjoin(last, last.c.run_id == Run.id)
         .outerjoin(TrainStep, (TrainStep.run_id == Run.id) & (TrainStep.step == last.c.step))
         .where(Run.status == RunStatus.RUNNING).order_by(Run.id))
    out = []
    with engine.connect() as conn:
        for r in conn.execute(q):
            step, steps, eta = r.step or 0, None, None
            try:  # a config damaged after its worker read it: the run is still listed, its length unknown
                config = stored_config(r.name, r.config_json)
            except FibctlError:
                config = None
            if config is not None:  # the training line's ETA, from what its newest row records
                steps = config.train.steps
                eta = eta_s(step, steps, r.elapsed_s)
            out.append(dict(name=r.name, host=r.host, device=r.device, worker=r.worker, step=step,
                            steps=steps, loss=r.loss, tokens_per_s=r.tokens_per_s, eta_s=eta,
                            heartbeat_at=r.heartbeat_at))
    return out


def matrices_and_lengths(engine: Engine, names: Sequence[str]) -> list[tuple[str, int]]:
    """Each named run's matrix and training length: what the worker's closing hint names."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(Run.matrix, Run.train_length).where(Run.name.in_(names)))]


def status_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(select(Run.status, func.count()).group_by(Run.status)).all())


def _transition(conn: Connection, name: str, allowed_from: tuple[str, ...], values: dict,
                verb: str) -> int:
    """Move run `name` to a new state if its status allows; returns its id."""
    row = conn.execute(
        update(Run).where(Run.name == name, Run.status.in_(allowed_from)).values(**values)
        .returning(Run.id)).first()
    if row is None:
        status = conn.execute(select(Run.status).where(Run.name == name)).scalar()
        if status is None:
            raise no_run_named([name], _run_names(conn))
        raise FibctlError(_not_from(name, status, allowed_from, verb))
    return row.id


def _not_from(name: str, status: str, allowed_from: tuple[str, ...], verb: str) -> str | None:
    if status in allowed_from:
        return None
    return f"cannot {verb} run {name!r}: it is {status} (only {' or '.join(allowed_from)} runs can be)"


def _not_removable(name: str) -> str:
    return (f"cannot remove run {name!r}: it is running; stop its worker or "
            f"`fibctl queue cancel {name}` first")


CANCEL_FROM = (RunStatus.QUEUED, RunStatus.RUNNING)
RETRY_FROM = (RunStatus.FAILED, RunStatus.CANCELLED)


def cancel(engine: Engine, name: str) -> None:
    """Cancel a queued or running run (a running worker stops at its next heartbeat)."""
    with engine.begin() as conn:
        run_id = _transition(conn, name, CANCEL_FROM,
                             dict(status=RunStatus.CANCELLED, finished_at=utcnow()), "cancel")
        add_event(conn, run_id, "cancelled", "cancelled by the user")


def retry(engine: Engine, name: str) -> None:
    """Put a failed or cancelled run back in the queue with its attempts reset."""
    with engine.begin() as conn:
        run_id = _transition(conn, name, RETRY_FROM, dict(
            status=RunStatus.QUEUED, attempts=0, error=None, worker=None, host=None, device=None,
            heartbeat_at=None, started_at=None, finished_at=None), "retry")
        add_event(conn, run_id, "retried", "queued again by the user")


@dataclass
class Restart:
    """What `retry_from_start` discarded: the run's rows past step 0 and its auxiliary metrics,
    by table."""
    name: str
    discarded: dict[str, int]  # table -> rows deleted


def retry_from_start(engine: Engine, name: str, check: Callable[[str | None, str | None], None]) -> Restart:
    """Queue a failed or cancelled run again from step 0 (as `retry` does), deleting its rows
    past step 0 (train steps, evaluations, position losses, alphas) and its auxiliary metrics
    (a probe's scores, an evaluation's speed: measured of the weights it discards, and Table 2
    would pair them with its step-0 alphas): a run none of whose checkpoints loads. Rows at
    step 0 (its initial alphas) and events stay.
    `check(runs_dir, checkpoint_path)` (where it last trained, what it recorded) runs in the
    transaction before the delete: what it raises (a checkpoint in the run's folder that a
    retry would resume from) keeps everything as it was. The `retried` event (data `from_step` 0) counts the restart
    (`recorded_progress`): a worker then refuses the checkpoints written before it."""
    from sqlalchemy import delete

    from fibctl.db.schema import Alpha, AuxMetric, Evaluation, PositionLoss

    with engine.begin() as conn:
        row = conn.execute(select(Run.runs_dir, Run.checkpoint_path).where(Run.name == name)).first()
        run_id = _transition(conn, name, RETRY_FROM, dict(
            status=RunStatus.QUEUED, attempts=0, error=None, worker=None, host=None, device=None,
            heartbeat_at=None, started_at=None, finished_at=None, checkpoint_path=None, tokens_trained=None,
            wall_seconds=None, final_step=None), "retry")
        check(row.runs_dir, row.checkpoint_path)
        discarded = {t.__tablename__: conn.execute(delete(t).where(t.run_id == run_id, t.step > 0)).rowcount
                     for t in (TrainStep, Evaluation, PositionLoss, Alpha)}
        discarded[AuxMetric.__tablename__] = conn.execute(delete(AuxMetric).where(AuxMetric.run_id == run_id)).rowcount
        gone = ", ".join(f"{n} {t}" for t, n in discarded.items() if n) or "none"
        add_event(conn, run_id, "retried",
                  f"queued again from step 0 by the user; what it recorded past step 0 deleted: {gone}",
                  {"from_step": 0, "deleted": discarded})
    return Restart(name, discarded)


def retry_failed(engine: Engine) -> list[str]:
    """Put every failed run back in the queue (as `retry` does); returns their names."""
    with engine.begin() as conn:
        names = list(conn.execute(select(Run.name).where(Run.status == RunStatus.FAILED).order_by(Run.id)).scalars())
    for name in names:
        retry(engine, name)
    return names


def claim_next(engine: Engine, worker: str, host: str | None = None, device: str | None = None,
               heartbeat_timeout_s: float = 600, max_attempts: int = 3,
               on_failed: Callable[[str, str], object] = lambda name, error: None) -> ClaimedRun | None:
    """Claim the oldest queued (or abandoned) run for `worker`; None when nothing is left.

    Abandoned runs (running, heartbeat older than the timeout) that have used
    `max_attempts` claims are failed first, each with an `abandoned` event; one under the
    limit is claimed again with a `reclaimed` event naming its previous worker; any other
    claim writes a `claimed` event. On PostgreSQL all of it is one statement. A claimed run
    whose stored config is damaged (no worker can train it) is failed, `on_failed(name,
    error)` told, and the next one claimed.
    """
    while True:
        run = _claim_one(engine, worker, host, device, heartbeat_timeout_s, max_attempts)
        if run is None:
            return None
        try:
            config = stored_config(run.name, run.config_json)
        except FibctlError as e:
            fail(engine, run.id, str(e), worker)
            on_failed(run.name, str(e))
            continue
        return ClaimedRun(id=run.id, name=run.name, attempts=run.attempts, config=config,
                          checkpoint_path=run.checkpoint_path)


def _claim_one(engine: Engine, worker: str, host: str | None, device: str | None, heartbeat_timeout_s: float,
               max_attempts: int):
    """claim_next's row, its config not yet read."""
    now = utcnow()
    params = dict(by_worker=worker, on_host=host, on_device=device, now=now, max_attempts=max_attempts,
                  stale=now - timedelta(seconds=heartbeat_timeout_s),
                  reason=f"abandoned: no heartbeat for {heartbeat_timeout_s:g} s after {max_attempts} attempt(s)",
                  reclaim_tail=f" (no heartbeat for {heartbeat_timeout_s:g} s) by {worker}",
                  claimed_msg=f"claimed by {worker}", pid_space=durable.pid_space())
    if engine.dialect.name == "postgresql":
        with engine.begin() as conn:
            return conn.execute(_CLAIM_PG, params).first()
    return _claim_in_steps(engine, params)


# Statements built once: building and cache-keying Core constructs on every claim cost
# more than executing them on SQLite, and it all ran while holding the write lock.
_STALE = and_(Run.status == RunStatus.RUNNING, Run.heartbeat_at < bindparam("stale"))
_SWEEP = (update(Run).where(_STALE, Run.attempts >= bindparam("max_attempts"))
          .values(status=RunStatus.FAILED, finished_at=bindparam("now"), error=bindparam("reason"))
          .returning(Run.id, Run.worker))
_NEXT = (select(Run.id, Run.status, Run.worker)
         .where(or_(Run.status == RunStatus.QUEUED, and_(_STALE, Run.attempts < bindparam("max_attempts"))))
         .order_by(Run.id).limit(1))
_TAKE = (update(Run).where(Run.id == bindparam("run_id"))
         .values(status=RunStatus.RUNNING, worker=bindparam("by_worker"), host=bindparam("on_host"),
                 device=bindparam("on_device"), heartbeat_at=bindparam("now"),
                 started_at=func.coalesce(Run.started_at, bindparam("now")), attempts=Run.attempts + 1)
         .returning(Run.id, Run.name, Run.attempts, Run.config_json, Run.checkpoint_path))
_EVENT = insert(Event)


def _claim_in_steps(engine: Engine, p: dict):
    """SQLite: the sweep, the pick and the update in one BEGIN IMMEDIATE transaction (the
    write lock is held throughout, so no other claimer can pick the same run)."""
    with engine.begin() as conn:
        dead = conn.execute(_SWEEP, p).all()  # as cheap as an EXISTS when nothing is stale
        if dead:
            conn.execute(_EVENT, [dict(run_id=d.id, time=p["now"], kind="abandoned",
                                       message=f"{p['reason']} (last worker {d.worker})") for d in dead])
        row = conn.execute(_NEXT, p).first()
        if row is None:
            return None
        run = conn.execute(_TAKE, dict(p, run_id=row.id)).one()
        if row.status == RunStatus.RUNNING:
            event = dict(kind="reclaimed", message=f"taken from {row.worker}{p['reclaim_tail']}",
                         data={"previous_worker": row.worker, "attempt": run.attempts, "pid_space": p["pid_space"]})
        else:
            event = dict(kind="claimed", message=p["claimed_msg"],
                         data={"attempt": run.attempts, "pid_space": p["pid_space"]})
        conn.execute(_EVENT, dict(event, run_id=run.id, time=p["now"]))
    return run


# PostgreSQL: one round trip. Data-modifying CTEs run to completion whether or not the
# final SELECT reads them, and all parts see one snapshot, so the pick excludes the runs
# the sweep fails by their attempts rather than by their new status. SKIP LOCKED lets
# concurrent claimers pass over each other's rows instead of queueing behind them.
_CLAIM_PG = text("""
WITH dead AS (
    UPDATE runs SET status = 'failed', finished_at = :now, error = :reason
    WHERE status = 'running' AND heartbeat_at < :stale AND attempts >= :max_attempts
    RETURNING id, worker),
dead_events AS (
    INSERT INTO events (run_id, time, kind, message)
    SELECT id, :now, 'abandoned', concat(CAST(:reason AS text), ' (last worker ', worker, ')') FROM dead),
next AS (
    SELECT id, status, worker FROM runs
    WHERE status = 'queued'
       OR (status = 'running' AND heartbeat_at < :stale AND attempts < :max_attempts)
    ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE runs SET status = 'running', worker = :by_worker, host = :on_host, device = :on_device,
        heartbeat_at = :now, started_at = coalesce(runs.started_at, :now),
        attempts = runs.attempts + 1
    FROM next WHERE runs.id = next.id
    RETURNING runs.id, runs.name, runs.attempts, runs.config_json, runs.checkpoint_path,
        next.status AS was, next.worker AS previous_worker),
claim_events AS (
    INSERT INTO events (run_id, time, kind, message, data)
    SELECT id, :now,
        CASE WHEN was = 'running' THEN 'reclaimed' ELSE 'claimed' END,
        CASE WHEN was = 'running' THEN concat('taken from ', previous_worker, CAST(:reclaim_tail AS text))
             ELSE CAST(:claimed_msg AS text) END,
        CASE WHEN was = 'running'
             THEN json_build_object('previous_worker', previous_worker, 'attempt', attempts,
                                    'pid_space', CAST(:pid_space AS text))
             ELSE json_build_object('attempt', attempts, 'pid_space', CAST(:pid_space AS text)) END
    FROM claimed)
SELECT id, name, attempts, config_json, checkpoint_path FROM claimed
""")


NOT_QUEUED = "; queue it first (fibctl queue add MATRIX)"


def run_config(engine: Engine, run_name: str) -> RunConfig:
    """The config of run `run_name` (FibctlError when there is none)."""
    with engine.connect() as conn:
        config_json = conn.execute(select(Run.config_json).where(Run.name == run_name)).scalar()
        if config_json is None:
            raise no_run_named([run_name], _run_names(conn), " in the database", NOT_QUEUED)
    return stored_config(run_name, config_json)


def ended_here(engine: Engine, run_id: int, worker: str | None) -> bool:
    """Whether `worker` (`host:pid`, `host:pid:gpuN`), the one running run `run_id`, ran on
    this machine, in this PID namespace, and its process has ended (killed, its terminal
    closed): its run's fresh heartbeat no longer means anything. Its claim's event records
    where its PID means something (`pid_space`): a host name alone is shared by containers
    that see different processes, where one alive in the other looks ended. A claim an older
    fibctl recorded has none: its run waits for its heartbeat to go stale."""
    pid = (worker or "").split(":")[1:2]
    if not (pid and pid[0].isdigit()):
        return False
    with engine.connect() as conn:
        data = conn.execute(select(Event.data).where(Event.run_id == run_id, Event.kind.in_(("claimed", "reclaimed")))
                            .order_by(Event.id.desc()).limit(1)).scalar()
    return durable.ended(int(pid[0]), data.get("pid_space") if isinstance(data, dict) else None)


def claim_named(engine: Engine, run_name: str, worker: str, host: str, device: str,
                heartbeat_timeout_s: float, check: Callable[[RunConfig], object] = lambda _: None) -> ClaimedRun:
    """Claim one run by name. Raises FibctlError, changing nothing, when the run is unknown,
    done, or running with a live heartbeat, or when `check(config)` rejects its config. A run
    whose worker on this machine has ended is taken at once, heartbeat or not: `fibctl train
    NAME` again after a kill refused it for --heartbeat-timeout (10 minutes) without saying so."""
    runs = {r["name"]: r for r in list_runs(engine)}
    if run_name not in runs:
        raise no_run_named([run_name], runs, " in the database", NOT_QUEUED)
    row = runs[run_name]
    now = utcnow()
    stale = now - timedelta(seconds=heartbeat_timeout_s)
    if row["status"] == RunStatus.DONE:
        raise FibctlError(f"run {run_name!r} is already done")
    ended = None  # the worker of this machine whose run is taken although its heartbeat is fresh
    if row["status"] == RunStatus.RUNNING and row["heartbeat_at"] and row["heartbeat_at"] >= stale:
        if not ended_here(engine, row["id"], row["worker"]):
            raise FibctlError(f"run {run_name!r} is running on {row['worker']} (heartbeat "
                              f"{duration((now - row['heartbeat_at']).total_seconds())} ago); a run whose worker "
                              f"has ended elsewhere is taken once its heartbeat is older than --heartbeat-timeout "
                              f"({duration(heartbeat_timeout_s)})")
        ended = row["worker"]
    with engine.connect() as conn:
        config_json = conn.execute(select(Run.config_json).where(Run.name == run_name)).scalar_one()
    config = stored_config(run_name, config_json)
    check(config)
    now = utcnow()
    taken = (Run.heartbeat_at < stale) if ended is None else or_(Run.heartbeat_at < stale, Run.worker == ended)
    with engine.begin() as conn:
        run = conn.execute(
            update(Run).where(Run.name == run_name, or_(
                Run.status.in_((RunStatus.QUEUED, RunStatus.FAILED, RunStatus.CANCELLED)),
                (Run.status == RunStatus.RUNNING) & taken))
            .values(status=RunStatus.RUNNING, worker=worker, host=host, device=device, heartbeat_at=now,
                    started_at=func.coalesce(Run.started_at, now), attempts=Run.attempts + 1,
                    error=None, finished_at=None)
            .returning(Run.id, Run.attempts, Run.checkpoint_path)).first()
        if run is None:
            raise FibctlError(f"run {run_name!r} was claimed by another worker meanwhile")
        add_event(conn, run.id, "claimed", f"claimed by {worker} (fibctl train)"
                  + (f"; its worker {ended} on this machine had ended" if ended else ""),
                  {"attempt": run.attempts, "pid_space": durable.pid_space()})
    return ClaimedRun(run.id, run_name, run.attempts, config, run.checkpoint_path)


def removed(engine: Engine, run_id: int) -> bool:
    """Whether run `run_id` is gone: cancelled and removed (`fibctl queue rm`) while a worker
    still trained it, whose writes then fail on the missing row."""
    with engine.connect() as conn:
        return conn.execute(select(Run.id).where(Run.id == run_id)).first() is None


def _ours(run_id: int, worker: str | None) -> list:
    """The run, still running, and (with `worker`) still claimed by that worker: a worker that
    stalled past another's heartbeat timeout finds its run taken over, and must leave the new
    claim's row alone."""
    return [Run.id == run_id, Run.status == RunStatus.RUNNING, *([Run.worker == worker] if worker else [])]


def release(engine: Engine, run_id: int, reason: str = "released by its worker", worker: str | None = None) -> bool:
    """Return a running run to the queue (e.g. on SIGTERM, Ctrl-C, a SLURM preemption) with
    this attempt not counted: a clean stop is not one of the crashes `max_attempts` limits.
    False if it was no longer running (cancelled meanwhile: stays cancelled) or no longer
    `worker`'s."""
    def write(conn: Connection) -> bool:
        done = conn.execute(update(Run).where(*_ours(run_id, worker)).values(
            status=RunStatus.QUEUED, worker=None, host=None, device=None, heartbeat_at=None,
            attempts=Run.attempts - 1)).rowcount
        if done:
            add_event(conn, run_id, "released", reason)
        return bool(done)
    return write_retrying(engine, write)


def _claims_kept(run_id: int):
    """Claims of a run not undone by `unclaim`: with this one alone, it set `started_at`.
    (Its attempts cannot tell: a released claim is not counted either.)"""
    def count(*kinds: str):
        return select(func.count()).where(Event.run_id == run_id, Event.kind.in_(kinds)).scalar_subquery()
    return count("claimed", "reclaimed") - count("unclaimed")


def recorded_progress(engine: Engine, run_id: int) -> tuple[int, int]:
    """(the newest step of the run's train_steps, evaluations and alphas rows, 0 with none;
    how many times it was queued again from step 0): what the database accounts for, which a
    checkpoint must not be ahead of to be resumed from (fibctl.train.trainer.Recorded)."""
    from fibctl.db.schema import Alpha, Evaluation

    with engine.connect() as conn:
        step = max(conn.execute(select(func.max(t.step)).where(t.run_id == run_id)).scalar() or 0
                   for t in (TrainStep, Evaluation, Alpha))
        retried = conn.execute(select(Event.data).where(Event.run_id == run_id, Event.kind == "retried")).scalars()
        restarts = sum(isinstance(d, dict) and d.get("from_step") == 0 for d in retried)
    return step, restarts


def claimed_before(engine: Engine, run_id: int) -> bool:
    """Whether a claim of the run before its current one was kept (not undone by `unclaim`)."""
    with engine.connect() as conn:
        return conn.execute(select(_claims_kept(run_id))).scalar() > 1


def unclaim(engine: Engine, run_id: int, reason: str, worker: str | None = None) -> None:
    """Undo a claim whose worker cannot train it (its data or runs folder is wrong, not the
    run): the run is queued again with the attempt not counted."""
    def write(conn: Connection) -> None:
        done = conn.execute(update(Run).where(*_ours(run_id, worker)).values(
            status=RunStatus.QUEUED, worker=None, host=None, device=None, heartbeat_at=None,
            attempts=Run.attempts - 1,
            started_at=case((_claims_kept(run_id) <= 1, None), else_=Run.started_at))).rowcount
        if done:
            add_event(conn, run_id, "unclaimed", reason)
    write_retrying(engine, write)


def finish(engine: Engine, run_id: int, worker: str | None = None) -> bool:
    """Mark a running run done; False (nothing changed) if it is no longer running or no
    longer `worker`'s."""
    def write(conn: Connection) -> bool:
        done = conn.execute(update(Run).where(*_ours(run_id, worker)).values(
            status=RunStatus.DONE, finished_at=utcnow(), error=None)).rowcount
        if done:
            add_event(conn, run_id, "finished")
        return bool(done)
    return write_retrying(engine, write)


def fail(engine: Engine, run_id: int, error: str, worker: str | None = None) -> bool:
    """Mark a running run failed with the error text (e.g. the exception and its last lines);
    False (nothing changed) if it is no longer running or no longer `worker`'s."""
    def write(conn: Connection) -> bool:
        done = conn.execute(update(Run).where(*_ours(run_id, worker)).values(
            status=RunStatus.FAILED, finished_at=utcnow(), error=error)).rowcount
        if done:
            add_event(conn, run_id, "failed", error.splitlines()[0] if error else None)
        return bool(done)
    return write_retrying(engine, write)


@dataclass
class Removed:
    """What `remove` deleted: the run's row (its metrics and events went with it)."""
    name: str
    status: str
    rows: int  # metric, position, alpha and event rows deleted with it
    runs_dir: str | None  # where the run last trained (runs.runs_dir)


def _recorded_rows(conn: Connection, run_id: int) -> int:
    """The metric, position, alpha and event rows of a run: what goes with its row (at any
    schema revision: one before 0002 has no events)."""
    from fibctl.db.schema import Alpha, AuxMetric, Evaluation, Event, PositionLoss, TrainStep

    tables = set(inspect(conn).get_table_names())
    return sum(conn.execute(select(func.count()).select_from(t).where(t.run_id == run_id)).scalar()
               for t in (TrainStep, Evaluation, PositionLoss, Alpha, AuxMetric, Event) if t.__tablename__ in tables)


def to_remove(engine: Engine, name: str) -> Removed:
    """What `remove` would delete now, deleting nothing (what `fibctl queue rm` asks about):
    read from the database as it is, of any schema revision, so that a "no" finds it not
    upgraded (runs_dir came with 0005)."""
    with engine.connect() as conn:
        runs_dir = Run.runs_dir if _has_runs_dir(conn) else null().label("runs_dir")
        row = conn.execute(select(Run.id, Run.status, runs_dir).where(Run.name == name)).first()
        if row is None:
            raise no_run_named([name], _run_names(conn))
        return Removed(name, str(row.status), _recorded_rows(conn, row.id), row.runs_dir)


def remove(engine: Engine, name: str, check: Callable[[str | None, str | None], None] | None = None,
           deleted: Callable[[], None] | None = None) -> Removed:
    """Delete a run that is not running. Its train steps, evaluations, position losses,
    alphas, auxiliary metrics and events go with it (ON DELETE CASCADE); its checkpoints are
    files, left to the caller. A running run is refused: cancel it first. `check(runs_dir,
    checkpoint_path)` (the folder it last trained in, its recorded checkpoint) runs before the
    delete, `deleted()` after it and before the commit; what either raises keeps the run."""
    from sqlalchemy import delete

    with engine.begin() as conn:
        row = conn.execute(select(Run.id, Run.status, Run.runs_dir, Run.checkpoint_path)
                           .where(Run.name == name)).first()
        if row is None:
            raise no_run_named([name], _run_names(conn))
        if row.status == "running":
            raise FibctlError(_not_removable(name))
        if check:
            check(row.runs_dir, row.checkpoint_path)
        rows = _recorded_rows(conn, row.id)
        # the status check again in the delete: a worker may have claimed it meanwhile
        if not conn.execute(delete(Run).where(Run.id == row.id, Run.status != "running")).rowcount:
            raise FibctlError(f"cannot remove run {name!r}: a worker claimed it meanwhile")
        if deleted:
            deleted()
    return Removed(name, str(row.status), rows, row.runs_dir)
