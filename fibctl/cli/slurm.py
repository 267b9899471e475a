"""`fibctl slurm submit` / `fibctl slurm status`: workers as the tasks of a SLURM job (fibctl.flows.slurm)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fibctl.cli import app
from fibctl.cli.common import DEFAULT_DB, DbOption, console, fitted_table, folder_value, plain, step_of
from fibctl.cli.train import (DEFAULT_DATA, DEFAULT_RUNS, DataOption, HeartbeatOption, RunsDirOption, ThreadsOption,
                              check_worker_limits)
from fibctl.db.schema import RunStatus

slurm_app = typer.Typer(help="Workers on a SLURM cluster (needs the slurm extra: pip install -e '.[slurm]').",
                        no_args_is_help=True)
app.add_typer(slurm_app, name="slurm")


@slurm_app.command("submit")
def submit_cmd(
    db: DbOption = DEFAULT_DB,
    data: DataOption = DEFAULT_DATA,
    runs_dir: RunsDirOption = DEFAULT_RUNS,
    nodes: Annotated[int, typer.Option("--nodes", help="Nodes to allocate.")] = 1,
    gpus_per_node: Annotated[int, typer.Option(
        "--gpus-per-node", help="GPUs per node: one worker task per GPU. 0: a CPU-only cluster (see --tasks-per-node).")] = 0,
    tasks_per_node: Annotated[Optional[int], typer.Option(
        "--tasks-per-node", help="Worker tasks per node on a CPU-only cluster (default 1).")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option("--cpus-per-task", help="CPUs for each task.")] = None,
    partition: Annotated[Optional[str], typer.Option("--partition", help="SLURM partition.")] = None,
    time: Annotated[str, typer.Option(
        "--time", help="The job's time limit, HH:MM:SS or D-HH:MM:SS. The workers checkpoint and release their runs "
        "shortly before it, and the job requeues itself.")] = "04:00:00",
    account: Annotated[Optional[str], typer.Option("--account", help="SLURM account to charge.")] = None,
    max_requeues: Annotated[int, typer.Option(
        "--max-requeues", help="How often the job requeues itself after reaching its time limit before it gives up "
        "(requeues after a preemption do not count, unless it comes late in --time, where submitit "
        "takes it for the limit: docs/cluster.md).")] = 100,
    max_runs: Annotated[Optional[int], typer.Option("--max-runs", help="Each worker stops after this many runs.")] = None,
    max_attempts: Annotated[int, typer.Option("--max-attempts", help="Claims before an abandoned run fails.")] = 3,
    threads: ThreadsOption = None,
    heartbeat_timeout: HeartbeatOption = 600,
    folder: Annotated[Path, typer.Option(
        "--folder", parser=folder_value("--folder", "the folder of the job's logs (default: slurm-jobs)"),
        metavar="<path>", help="Where submitit keeps the job's logs and state, one folder per job (on a filesystem "
        "every node shares).")] = Path("slurm-jobs"),
    ddp: Annotated[bool, typer.Option(
        "--ddp", help="The job is one DDP group: each task starts torchrun on its node (one process per GPU), "
        "and the group trains each run on all of them.")] = False,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", help="With --ddp on a CPU-only cluster: gloo processes per task.")] = None,
    rdzv_port: Annotated[Optional[int], typer.Option(
        "--rdzv-port", help="With --ddp: the port (1024-65535) of the group's c10d rendezvous on the job's first "
        "host (default: 20000 + the job id % 10000).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the sbatch script; submit nothing.")] = False,
) -> None:
    """Submit a SLURM job whose tasks each run a worker against the database until the queue is
    empty. Before the time limit or on preemption each worker checkpoints and puts its run back
    in the queue, and the job requeues itself. A job SLURM queues but would never start
    (beyond its partition's limits: squeue's reason) is cancelled and refused. With --ddp the
    job is one DDP group instead, which trains each run on all of its nodes' processes.

    Example: fibctl slurm submit --gpus-per-node 8 --time 04:00:00 --dry-run"""
    from fibctl.flows.slurm import JobSpec, WorkerSettings, submit

    # the checks of `fibctl worker`: here, before a job whose every task would refuse them
    check_worker_limits(heartbeat_timeout, max_attempts, max_runs)
    spec = JobSpec(nodes=nodes, gpus_per_node=gpus_per_node, tasks_per_node=tasks_per_node,
                   cpus_per_task=cpus_per_task, partition=partition, account=account, time=time,
                   max_requeues=max_requeues, ddp=ddp, nproc=nproc, rdzv_port=rdzv_port)
    worker = WorkerSettings(db=db, data_dir=data, runs_dir=runs_dir, threads=threads,
                            heartbeat_timeout_s=heartbeat_timeout, max_attempts=max_attempts, max_runs=max_runs)
    sub = submit(worker, spec, folder, dry_run=dry_run)
    if dry_run:
        console.print(sub.script, highlight=False, markup=False, soft_wrap=True)
        return
    tasks = (f"{sub.tasks} task(s) of one DDP group of {spec.world()} process(es)" if ddp
             else f"{sub.tasks} worker task(s)")
    console.print(f"submitted SLURM job {sub.job_id}: {tasks} for {sub.queued} queued run(s); "
                  f"logs in {sub.folder / sub.job_id}", highlight=False, markup=False, soft_wrap=True)


@slurm_app.command("status")
def status_cmd(db: DbOption = DEFAULT_DB) -> None:
    """Your fibctl SLURM jobs (squeue; sacct where accounting is on; other users' jobs are
    not listed) with the runs each trains or trained, then the queue's counts. A job that
    can never start (e.g. a --time above its partition's MaxTime) is named, with why.

    Example: fibctl slurm status --db results.db"""
    from fibctl.db.engine import connect_readonly
    from fibctl.flows.slurm import jobs, never_clears, never_message, require_slurm

    require_slurm("squeue")
    found, counts = jobs(connect_readonly(db))
    if found:
        rows = []
        for job in found:
            runs = job["runs"]
            running = [f"{r['name']}@{r['host']}" + (f" {step_of(*r['step'])}" if r["step"] else "")
                       for r in runs if r["status"] == RunStatus.RUNNING]
            others = {}
            for r in runs:
                if r["status"] != RunStatus.RUNNING:
                    others[r["status"]] = others.get(r["status"], 0) + 1
            rows.append([job["job_id"], job["state"], f"{job['elapsed']}/{job['limit']}", job["nodes"],
                         ", ".join(running) or "-", ", ".join(f"{n} {s}" for s, n in sorted(others.items())) or "-"])
        table, _ = fitted_table(["job", "state", "time/limit", "nodes", "running", "other runs"], rows,
                                width=console.width, fold=("running", "other runs"), optional=("nodes",))
        console.print(table)
        for job in found:  # a job that pends forever (a partition's limit lowered since): say so, once
            if never_clears(job["reason"]):
                console.print(plain(f"{never_message(job['job_id'], job['reason'], job['partition'], job['limit'])}; "
                                    f"cancel it: scancel {job['job_id']}"))
    else:
        console.print(plain("no fibctl SLURM jobs of yours known to squeue or sacct"))
    console.print(plain(", ".join(f"{counts.get(s, 0)} {s}" for s in ("queued", "running", "done", "failed",
                                                                      "cancelled"))))

