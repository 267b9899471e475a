"""Workers on a SLURM cluster, through submitit.

`submit` sends one SLURM job whose tasks each run a worker (`fibctl.flows.worker.work`) against
the shared database: one task per GPU of each node (`--gpus-per-node G`), or `--tasks-per-node
T` CPU workers. Each task trains queued runs until the queue is empty.

Before the time limit (SLURM sends USR2 `signal_delay_s` earlier, `#SBATCH --signal`) or on
preemption, every task stops its worker at the end of the step in progress: the worker
checkpoints and puts its run back in the queue. Task 0 (submitit's handler calls
`WorkerTask.checkpoint`) waits for its sibling tasks to have done the same, then submitit
requeues the job, which starts again on a new allocation and claims the released runs, which
resume from their checkpoints: a matrix larger than one allocation finishes across several.
SIGTERM (`scancel`) stops the workers the same way, without a requeue.

With `ddp` the job is one DDP group instead (`GroupTask`): each task starts torchrun on its
node, the tasks meet at a c10d rendezvous at the job's first host, and the group's ranks run
`fibctl worker --ddp`; a stop reaches each task's ranks through the task.

Each run a task starts gets a `slurm` event naming the job id, the task and the host, which
`jobs` joins with SLURM's own view of the job (squeue, and sacct where accounting is on).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine

from fibctl import queue
from fibctl.config import RunConfig
from fibctl.data.streams import load_manifest
from fibctl.db.engine import connect, connect_readonly, has_password, resolve_url, shown
from fibctl.db.schema import Event, Run, RunStatus
from fibctl.db.store import add_event, write_retrying
from fibctl.errors import FibctlError, printable, shown_path, unprintable
from fibctl.flows.torchrun import JOB_TASK, REQUEUE
from fibctl.paths import expanded
from fibctl.reports.tables import loss as loss_label

try:
    from submitit.helpers import Checkpointable
except ImportError:  # the class stays importable; `require_submitit` refuses to submit without it
    Checkpointable = object

EXTRA_HINT = "pip install -e '.[slurm]' (submitit)"
JOB_NAME = "fibctl-worker"
SIGNAL_DELAY_S = 120  # USR2 this long before the time limit: time to finish a step and checkpoint
STOP_WAIT_S = 90  # how long task 0 waits for the workers to release their runs before requeueing
MAX_TIME_S = 365 * 24 * 3600
TOOL_TIMEOUT_S = 30  # squeue, sacct, scancel: SLURM's tools retry a missing config for 60 s
# ASCII digits, the whole text: it goes into the script as given (a line break after it, or
# '٠٤:٠٠:٠٠', which \d and int() took, made an #SBATCH --time line SLURM cannot read)
_TIME = re.compile(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)", re.ASCII)
_WORD = re.compile(r"^[A-Za-z0-9_.,:+@=-]+$")  # a partition or account: goes into the sbatch script


def require_submitit():
    try:
        import submitit
    except ImportError:
        raise FibctlError(f"fibctl slurm needs submitit, which is not installed: {EXTRA_HINT}") from None
    return submitit


def require_slurm(command: str = "sbatch") -> str:
    path = shutil.which(command)
    if path is None:
        raise FibctlError(f"no `{command}` on this machine: run fibctl slurm on a SLURM login node "
                          "(fibctl slurm submit --dry-run shows the script without one)")
    return path


def parse_time(text: str) -> int:
    """`HH:MM:SS` or `D-HH:MM:SS` -> seconds."""
    m = _TIME.fullmatch(text)
    if not m or int(m[3]) >= 60 or int(m[4]) >= 60:
        raise FibctlError(f"--time {text!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00")
    seconds = ((int(m[1] or 0) * 24 + int(m[2])) * 60 + int(m[3])) * 60 + int(m[4])
    if seconds <= 0:
        raise FibctlError(f"--time {text!r} must be above zero")
    if seconds > MAX_TIME_S:  # SLURM read 99999999-00:00:00 as INVALID: no signal before the limit
        raise FibctlError(f"--time {text!r}: at most 365-00:00:00 (a year)")
    return seconds


@dataclass(frozen=True)
class JobSpec:
    """The allocation: what `#SBATCH` lines say."""
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int | None = None  # default: one per GPU, or 1 on a CPU-only cluster
    cpus_per_task: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    # after reaching the time limit: submitit's max_num_timeout. A preemption does not count unless
    # it comes late: submitit takes any USR2 after min(80 %, limit - 10 min) of --time for the limit
    max_requeues: int = 100
    signal_delay_s: int = SIGNAL_DELAY_S
    ddp: bool = False  # the job is one torchrun group: each task starts torchrun on its node
    nproc: int | None = None  # with ddp on a CPU-only cluster: gloo processes a task
    rdzv_port: int | None = None  # with ddp: the c10d rendezvous's port (default: from the job id)

    def tasks(self) -> int:
        """Tasks a node: without ddp, one worker each; with it, one torchrun each (one a node,
        or --tasks-per-node on a CPU-only cluster, several groups' "nodes" on one)."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return 1 if self.ddp else self.gpus_per_node or 1

    def per_task(self) -> int:
        """The processes each task runs: its torchrun's ranks (one a GPU, or --nproc), else 1."""
        return (self.gpus_per_node or self.nproc or 1) if self.ddp else 1

    def world(self) -> int:
        """The processes training each run: the DDP group's size, or 1."""
        return self.nodes * self.tasks() * self.per_task() if self.ddp else 1

    def check(self) -> None:
        if self.nodes < 1:
            raise FibctlError(f"--nodes {self.nodes} must be >= 1")
        if self.gpus_per_node < 0:
            raise FibctlError(f"--gpus-per-node {self.gpus_per_node} must be >= 0 (0: a CPU-only cluster)")
        if self.tasks() < 1:
            raise FibctlError(f"--tasks-per-node {self.tasks()} must be >= 1")
        if self.nproc is not None and not self.ddp:
            raise FibctlError(f"--nproc {self.nproc} goes with --ddp (one group of processes trains each run)")
        if self.rdzv_port is not None and not self.ddp:
            raise FibctlError(f"--rdzv-port {self.rdzv_port} goes with --ddp (the port where the group's "
                              "tasks meet)")
        if self.ddp:
            self._check_ddp()
        elif self.gpus_per_node and self.tasks() != self.gpus_per_node:
            raise FibctlError(f"--tasks-per-node {self.tasks()} with --gpus-per-node {self.gpus_per_node}: "
                              "each task is one worker on one GPU; leave --tasks-per-node out")
        if self.max_requeues < 0:
            raise FibctlError(f"--max-requeues {self.max_requeues} must be >= 0")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise FibctlError(f"--cpus-per-task {self.cpus_per_task} must be >= 1")
        for option, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not _WORD.match(value):
                raise FibctlError(f"{option} {value!r}: not a SLURM name (letters, digits, _.,:+@=-)")
        limit = parse_time(self.time)
        if limit <= self.signal_delay_s + 60:
            raise FibctlError(f"--time {self.time}: too short; the workers are told to stop "
                              f"{self.signal_delay_s} s before the limit, so give at least "
                              f"{_hms(self.signal_delay_s + 120)}")

    def _check_ddp(self) -> None:
        if self.gpus_per_node and self.nproc is not None:
            raise FibctlError(f"--ddp --nproc {self.nproc} with --gpus-per-node {self.gpus_per_node}: each node's "
                              "torchrun starts one process per GPU; drop --nproc")
        if self.gpus_per_node and self.tasks_per_node is not None:
            raise FibctlError(f"--ddp --tasks-per-node {self.tasks_per_node} with --gpus-per-node "
                              f"{self.gpus_per_node}: one task a node starts torchrun on all its GPUs; drop "
                              "--tasks-per-node")
        if not self.gpus_per_node and self.nproc is None:
            raise FibctlError("--ddp on a CPU-only cluster (--gpus-per-node 0): give each task's gloo processes "
                              "with --nproc N")
        if self.nproc is not None and self.nproc < 1:
            raise FibctlError(f"--nproc {self.nproc} must be >= 1")
        # below 1024 only root may listen: the rendezvous would fail on the first host, in its log
        if self.rdzv_port is not None and not 1024 <= self.rdzv_port <= 65535:
            raise FibctlError(f"--rdzv-port {self.rdzv_port}: a TCP port from 1024 to 65535")
        if not self.gpus_per_node and self.cpus_per_task is not None and self.cpus_per_task < self.nproc:
            raise FibctlError(f"--cpus-per-task {self.cpus_per_task} with --ddp --nproc {self.nproc}: each gloo "
                              f"process needs a CPU; give at least {self.nproc}")

    def parameters(self, setup: list[str]) -> dict:
        """submitit's SlurmExecutor parameters."""
        limit = parse_time(self.time)
        params = dict(job_name=JOB_NAME, nodes=self.nodes, ntasks_per_node=self.tasks(),
                      time=-(-limit // 60),  # minutes, for submitit's own accounting of timeouts
                      signal_delay_s=self.signal_delay_s, setup=setup,
                      additional_parameters={"time": self.time})  # the exact limit in the script
        if self.gpus_per_node:
            params["gpus_per_node"] = self.gpus_per_node
        # a CPU group's task: one CPU for each of its gloo processes, unless told otherwise
        cpus = self.cpus_per_task or (self.nproc if self.ddp and not self.gpus_per_node else None)
        if cpus:
            params["cpus_per_task"] = cpus
        if self.partition:
            params["partition"] = self.partition
        if self.account:
            params["account"] = self.account
        return params


def _hms(seconds: int) -> str:
    days, seconds = divmod(seconds, 24 * 3600)
    return (f"{days}-" if days else "") + f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# a time limit as SLURM's tools show it: squeue's %l drops the hours under one (10:00), scontrol's
# MaxTime has them (00:10:00); UNLIMITED, INFINITE or INVALID have no seconds
_SHOWN_TIME = re.compile(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d\d)", re.ASCII)


def shown_seconds(text: str) -> int | None:
    """A time limit squeue or scontrol printed, in seconds; None for none (UNLIMITED) or one unread."""
    m = _SHOWN_TIME.fullmatch(text.strip())
    return None if m is None else ((int(m[1] or 0) * 24 + int(m[2] or 0)) * 60 + int(m[3])) * 60 + int(m[4])


@dataclass(frozen=True)
class WorkerSettings:
    """What each task's worker is given (the `fibctl worker` options)."""
    db: str
    data_dir: Path
    runs_dir: Path
    threads: int | None = None
    heartbeat_timeout_s: float = 600
    max_attempts: int = 3
    max_runs: int | None = None


def absolute_db(db: str) -> str:
    """A SQLite database as an absolute path (the job's tasks start in another folder)."""
    url = resolve_url(db)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return db
    path = str(Path(url.database).resolve())  # `~` expanded by resolve_url
    return path if "://" not in db else url.set(database=path).render_as_string(hide_password=False)


def queued_configs(engine: Engine) -> list[RunConfig]:
    """The queued runs' configs, in queue order."""
    q = select(Run.name, Run.config_json).where(Run.status == RunStatus.QUEUED.value).order_by(Run.id)
    with engine.connect() as conn:
        rows = conn.execute(q).all()
    configs = []
    for name, config_json in rows:
        configs.append(queue.stored_config(name, config_json))  # a worker claiming it would fail the same way
    return configs


def check_worker(worker: WorkerSettings, spec: JobSpec, configs: list[RunConfig]) -> None:
    """What each task's worker would check before its first claim (as `fibctl worker` does),
    checked on this host before submitting: the data and runs folders are on a filesystem the
    nodes share, and a refusal there ends every task, each with a traceback in its log."""
    from fibctl.device import check_threads  # torch: loaded to submit, not for `slurm status`
    from fibctl.train.trainer import check_data

    if worker.threads is not None:
        if spec.cpus_per_task is None:
            check_threads(worker.threads)  # this host's CPUs stand in for a node's
        elif not 1 <= worker.threads <= spec.cpus_per_task:  # a task may not use more CPUs than it has
            raise FibctlError(f"--threads {worker.threads} must be from 1 to --cpus-per-task {spec.cpus_per_task}")
        elif spec.ddp and not spec.gpus_per_node and worker.threads * spec.per_task() > spec.cpus_per_task:
            raise FibctlError(f"--threads {worker.threads} with --nproc {spec.per_task()}: "
                              f"{worker.threads * spec.per_task()} CPUs a task, above --cpus-per-task "
                              f"{spec.cpus_per_task}")
    manifest = None  # no folder: probe runs make their own data; check_data refuses text runs
    try:
        if worker.data_dir.exists():
            manifest = load_manifest(worker.data_dir)
            for split in manifest.splits:
                manifest.stream(split)
        for config in configs:
            check_data(config, manifest)
    except FibctlError as e:
        raise FibctlError(f"--data {shown_path(worker.data_dir)}: {e}") from None
    if spec.ddp:  # what the group's rank 0 would put back in the queue, stopping the group
        from fibctl.flows.worker import check_group_run

        for config in configs:
            try:
                check_group_run(config, manifest, spec.world())
            except FibctlError as e:
                raise FibctlError(f"--ddp, a group of {spec.world()} process(es): {e}") from None
    check_runs_dir(worker.runs_dir)


def check_runs_dir(runs_dir: Path) -> None:
    """The worker's check that --runs-dir can hold checkpoints, without making the folder (a
    dry run changes nothing): it, or the nearest folder above it (the worker makes the rest),
    must be a folder this user may write to."""
    existing = runs_dir
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise FibctlError(f"--runs-dir {shown_path(runs_dir)} cannot hold checkpoints: {shown_path(existing)} is not "
                          "a folder")
    kind = filesystem_type(existing)
    if kind in PSEUDO_FILESYSTEMS:  # os.access says root may write to /proc, where nothing can be made
        raise FibctlError(f"--runs-dir {shown_path(runs_dir)} cannot hold checkpoints: {shown_path(existing)} is on "
                          f"{kind}, a pseudo filesystem of the kernel's")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FibctlError(f"--runs-dir {shown_path(runs_dir)} cannot hold checkpoints: {shown_path(existing)} is not "
                          "writable")


# the kernel's own filesystems, which hold no files (a folder made in cgroup is a control group)
PSEUDO_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore", "bpf",
                      "configfs", "efivarfs", "devpts", "mqueue", "binfmt_misc", "fusectl", "selinuxfs", "nsfs"}


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` is on: the mount of its device in Linux's
    /proc/self/mountinfo (read, nothing written); None where that does not say."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(dev)}:{os.minor(dev)}"
    for line in mounts:  # ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTIONS... - TYPE SOURCE OPTIONS
        fields, _, rest = line.partition(" - ")
        if fields.split()[2:3] == [device] and rest:
            return rest.split()[0]
    return None


@dataclass
class Submission:
    job_id: str | None  # None on a dry run
    script: str
    folder: Path
    tasks: int
    queued: int


def submit(worker: WorkerSettings, spec: JobSpec, folder: Path, *, dry_run: bool = False) -> Submission:
    """Submit the job (or, with `dry_run`, only write out its sbatch script). Every refusal
    is one line and comes before anything is submitted: the options first, then the tools."""
    spec.check()
    db = absolute_db(worker.db)
    if spec.nodes > 1 and resolve_url(db).get_backend_name() == "sqlite":
        raise FibctlError(f"--nodes {spec.nodes} with the SQLite database {shown(db)}: SQLite's locks do not "
                          "hold over a network filesystem; give a database server every node reaches "
                          "(--db postgresql+psycopg://...), see docs/cluster.md")
    # a dry run changes nothing: it reads the queue without upgrading the database's schema
    configs = queued_configs(connect_readonly(db) if dry_run else connect(db, must_exist=True))
    queued = len(configs)
    if not queued:  # a dry run too: it shows what would be submitted
        raise FibctlError(f"no queued runs in {shown(db)}: nothing for the workers to do (fibctl queue add)")
    settings = WorkerSettings(db, Path(expanded(worker.data_dir)).resolve(), Path(expanded(worker.runs_dir)).resolve(),
                              worker.threads, worker.heartbeat_timeout_s, worker.max_attempts, worker.max_runs)
    check_worker(settings, spec, configs)
    folder = Path(expanded(folder)).resolve()
    if unprintable(str(folder)):  # submitit writes it into #SBATCH lines unescaped: a line break ends one
        raise FibctlError(f"--folder {shown_path(folder)}: a control or bidi character (a line break, say) in "
                          "its path would break or disguise the job script's lines; choose another folder")
    if "%" in str(folder) or "\\" in str(folder):  # its log paths: SLURM's patterns (%x, %u...), not submitit's
        raise FibctlError(f"--folder {shown_path(folder)}: SLURM reads a '%' or '\\' in its path as a pattern of "
                          "its log file names, and the job would fail with no log; choose another folder")
    blocked = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # a dry run too: its script names job folders that could never be made
        raise FibctlError(f"--folder {shown_path(folder)}: {shown_path(blocked)} is a file, not a folder")
    submitit = require_submitit()
    if not dry_run:
        require_slurm("sbatch")
        require_slurm("srun")
    # the paths travel as variables: a node whose filesystem differs sets its own in its TaskProlog
    setup = [f"export FIBCTL_DATA={shlex.quote(str(settings.data_dir))}",
             f"export FIBCTL_RUNS_DIR={shlex.quote(str(settings.runs_dir))}"]
    if spec.ddp:  # what each task runs, said in the script (the task itself is submitit's pickle)
        port = "PORT" if spec.rdzv_port is None else str(spec.rdzv_port)
        rdzv = torchrun_args(spec.nodes * spec.tasks(), spec.per_task(), f"FIRST_NODE:{port}", "$SLURM_JOB_ID")
        setup += [f"# one DDP group of {spec.world()} process(es): each of the job's {spec.nodes * spec.tasks()} "
                  "task(s) starts torchrun on its node,",
                  "# FIRST_NODE the job's first host" + (f", PORT {PORT_BASE} + the job id % {PORTS} (--rdzv-port):"
                                                         if spec.rdzv_port is None else " (--rdzv-port):"),
                  "#   torchrun " + " ".join(rdzv) + " -m fibctl " + " ".join(
                      group_args(settings, bool(spec.gpus_per_node), "$FIBCTL_DATA", "$FIBCTL_RUNS_DIR"))]
        task = GroupTask(settings, spec.gpus_per_node, spec.per_task(), folder, rdzv_port=spec.rdzv_port)
    else:
        task = WorkerTask(settings, spec.gpus_per_node, folder)
    params = spec.parameters(setup)
    if dry_run:
        from submitit.slurm.slurm import _make_sbatch_string

        command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder / "%j"))])
        return Submission(None, _make_sbatch_string(command=command, folder=folder / "%j", **params), folder,
                          spec.nodes * spec.tasks(), queued)
    # the pickled task holds the database URL: one with a password is for this user's eyes only,
    # in the files submitted and in those the job writes (SLURM gives it the umask submitted with);
    # a password in the URL's query (?password=) is one too
    umask = os.umask(0o077) if has_password(resolve_url(db)) else None
    try:
        job = _submit(submitit, task, params, folder, spec.max_requeues)
    finally:
        if umask is not None:
            os.umask(umask)
    script = job.paths.submission_file.read_text() if job.paths.submission_file.is_file() else ""
    return Submission(str(job.job_id), script, folder, spec.nodes * spec.tasks(), queued)


# pending reasons that never clear by themselves: the job asks for more than the partition, its
# nodes or a per-job limit of the account or QOS will ever give, or for what it may not use; only
# an administrator changes that. Any other reason (Resources, Priority; ReqNodeNotAvail and
# PartitionDown: nodes or a partition down or reserved, for now) clears, and the job waits
NEVER_STARTS = {
    "PartitionNodeLimit": "more nodes than the partition has or allows: --nodes",
    "PartitionTimeLimit": "a longer --time than the partition allows",
    "PartitionConfig": "more than the partition or its nodes allow: --nodes, --cpus-per-task, --gpus-per-node, "
                       "--tasks-per-node",
    "BadConstraints": "what no node of the partition has",
    "InvalidAccount": "no such account: --account",
    "InvalidQOS": "no such QOS",
    "AccountNotAllowed": "the partition does not take this account",
    "QOSNotAllowed": "the partition or account does not take this QOS",
}
_PER_JOB_LIMIT = re.compile(r"^(?:QOS|Assoc)Max\w*PerJob")  # QOSMaxNodePerJobLimit, AssocMaxWallDurationPerJobLimit
WATCH_S = 3.0  # how long a job SLURM has not yet looked at is watched after sbatch


def never_clears(reason: str) -> bool:
    """Whether a pending job's reason (squeue's %r) keeps it from ever starting."""
    return reason in NEVER_STARTS or bool(_PER_JOB_LIMIT.match(reason))


def _never_hint(reason: str) -> str:
    return NEVER_STARTS.get(reason) or "above a per-job limit of the account or QOS"


def _scontrol(*what: str) -> list[dict[str, str]]:
    """`scontrol -o show WHAT`'s records, each as its KEY=VALUE fields (the first of a key: a
    free-text field may hold words like them); none where scontrol does not say."""
    records = []
    for line in _slurm_lines(["scontrol", "-o", "show", *what]) or []:
        fields: dict[str, str] = {}
        for field in line.split():
            key, eq, value = field.partition("=")
            if eq:
                fields.setdefault(key, value)
        records.append(fields)
    return records


def _count(text: str | None) -> int | None:
    """A count scontrol printed (2, or a range's least, 2-2); None for UNLIMITED, N/A or none."""
    m = re.match(r"\d+", text or "")
    return int(m[0]) if m else None


def _config_cause(job_id: str, partition: dict[str, str]) -> str | None:
    """Which option a job pending with SLURM's generic PartitionConfig asks too much of, from
    what scontrol says of the job, the partition and its nodes: more nodes than the partition
    has, or more CPUs a node (tasks times CPUs each) than its largest node has or the partition
    lets a job use; None where neither is it (scontrol silent, or another cause: memory, GPUs)."""
    name = partition.get("PartitionName")
    job = next(iter(_scontrol("job", job_id)), {}) if name else {}
    if not job:
        return None
    nodes = _count(job.get("NumNodes"))
    # the nodes it has, or fewer where it lets a job have fewer (MaxNodes)
    most_nodes = min([n for n in (_count(partition.get("TotalNodes")), _count(partition.get("MaxNodes")))
                      if n is not None], default=None)
    if nodes is not None and most_nodes is not None and nodes > most_nodes:
        return f"--nodes {nodes} is above the partition's {most_nodes} node(s): give at most that"
    # tasks a node as asked (0 where only a task count was: a node's share of them)
    tasks = _count(job.get("NtasksPerN:B:S:C")) or -(-(_count(job.get("NumTasks")) or 1) // (nodes or 1))
    each = _count(job.get("CPUs/Task")) or 1
    cpus = [n for node in _scontrol("node") if name in node.get("Partitions", "").split(",")
            if (n := _count(node.get("CPUEfctv") or node.get("CPUTot"))) is not None]
    if not cpus:
        return None
    most, capped = max(cpus), _count(partition.get("MaxCPUsPerNode"))
    allowed = f"the {most} CPUs of the partition's largest node"
    if capped is not None and capped < most:
        most, allowed = capped, f"the partition's MaxCPUsPerNode {capped}"
    if tasks * each <= most:
        return None
    if tasks == 1:
        return f"--cpus-per-task {each} is above {allowed}: give at most that"
    # tasks a node: --tasks-per-node's, or one a GPU (--gpus-per-node)
    return (f"{tasks} tasks a node of {each} CPU(s) each (--tasks-per-node or --gpus-per-node, --cpus-per-task) "
            f"are {tasks * each} CPUs, above {allowed}")


def never_message(job_id: str, reason: str, partition: str, limit: str) -> str:
    """Why a pending job can never start, `limit` its time limit as given or shown: the
    partition's MaxTime where the limit is above it, else what the reason means. The time is
    named whenever it is above: SLURM's first word for that is its generic PartitionConfig,
    for which the option asking too much (nodes, CPUs) is named where scontrol tells it."""
    asked = shown_seconds(limit)
    fields = next(iter(_scontrol("partition", partition)), {}) \
        if reason in ("PartitionTimeLimit", "PartitionConfig") else {}
    most = shown_seconds(fields["MaxTime"]) if "MaxTime" in fields else None
    # SLURM holds a limit in whole minutes: 00:05:30 is 6 of them, above a MaxTime of 00:05:00
    if asked is not None and most is not None and -(-asked // 60) * 60 > most:
        why = f"--time {_hms(asked)} is above the partition's MaxTime {_hms(most)}: give at most that"
    else:
        why = (reason == "PartitionConfig" and _config_cause(job_id, fields)) or _never_hint(reason)
    return f"SLURM job {job_id} can never start in partition {partition}: {reason} ({why})"


def never_starts(job_id: str, watch_s: float = WATCH_S, poll_s: float = 0.25) -> tuple[str, str] | None:
    """(reason, partition) when squeue says, within `watch_s`, that SLURM will never start the
    pending job; None when it runs, ended, waits for a reason that clears, or squeue does not
    tell. sbatch queues such a job (EnforcePartLimits=NO, SLURM's default), to pend forever."""
    deadline = time.monotonic() + watch_s
    while True:
        try:
            lines = _slurm_lines(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%P"])
        except FibctlError:  # a job sbatch accepted stays submitted when squeue fails
            lines = None
        state, reason, partition = ((lines or [""])[0].split("|") + ["", ""])[:3]
        if state != "PENDING":
            return None
        never = never_clears(reason)
        # SLURM's first word may be its generic PartitionConfig, which its next pass names
        # (PartitionNodeLimit); "None": not yet looked at
        if never and reason != "PartitionConfig":
            return reason, partition
        if not never and reason != "None":
            return None
        if time.monotonic() >= deadline:
            return (reason, partition) if never else None
        time.sleep(poll_s)


def _submit(submitit, task: "WorkerTask", params: dict, folder: Path, max_requeues: int):
    """sbatch the task; a refusal is one line and leaves nothing in the job folder, and so
    is a job SLURM queued but will never start, which is cancelled."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())

    def discard() -> None:  # the script and pickle of a job that never was
        for path in set(folder.iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if made:
            folder.rmdir()

    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=max_requeues)
    executor.update_parameters(**params)
    try:
        with _stderr_kept() as said:  # sbatch writes its refusal to our stderr: it goes in the one line
            job = executor.submit(task)
    except Exception as e:  # sbatch refused: its own last line says why
        detail = [*str(e).strip().splitlines(), *said()]
        discard()
        raise FibctlError(f"sbatch refused the job: {_refusal(detail) or type(e).__name__}") from None
    blocked = never_starts(str(job.job_id))
    if blocked is None:
        return job
    reason, partition = blocked
    message = never_message(str(job.job_id), reason, partition, params["additional_parameters"]["time"])
    try:
        cancel = subprocess.run(["scancel", str(job.job_id)], capture_output=True, text=True, errors="replace",
                                timeout=TOOL_TIMEOUT_S)
        why = None if cancel.returncode == 0 else (cancel.stderr.strip().splitlines() or ["no message"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why is not None:  # it stays queued, its files with it: the user is told to cancel it
        raise FibctlError(f"{message}; scancel failed ({why}): scancel {job.job_id} yourself")
    discard()
    raise FibctlError(f"{message}; the job was cancelled")


@contextmanager
def _stderr_kept():
    """File descriptor 2 into a temporary file while the block runs (a child's writes too);
    yields a function returning the lines written."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as kept:
        lines: list[str] = []
        os.dup2(kept.fileno(), 2)
        try:
            yield lambda: lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            kept.seek(0)
            lines += kept.read().decode(errors="replace").strip().splitlines()


def _refusal(lines: list[str]) -> str:
    """sbatch's reason: the first `sbatch: error:` line that is not its generic closing one."""
    errors = [line.split("error:", 1)[1].strip() for line in lines if "sbatch: error:" in line]
    specific = [e for e in errors if not e.startswith("Batch job submission failed")]
    return (specific or errors or [line for line in lines if line.strip()][-1:] or [""])[0]


# ----------------------------------------------------------------------------- inside the job


class JobDisplay:
    """A task's log (plain lines, to submitit's log file) and a `slurm` event on each run it starts."""

    def __init__(self, engine: Engine, job_id: str, task: int, restart: int, every: int = 50):
        self.engine, self.job_id, self.task, self.restart, self.every = engine, job_id, task, restart, every
        self.host = socket.gethostname()

    def start(self, name: str, steps: int):
        note_job(self.engine, name, self.job_id, self.task, self.host, self.restart)
        self._say(f"{name}: training, {steps} steps")

        def line(p) -> None:
            if p.step % self.every == 0 or p.step == p.steps:
                self._say(f"{name} step {p.step}/{p.steps} loss {loss_label(p.loss)} {p.tokens_per_s:,.0f} tok/s")
        return line

    def warn(self, message: str) -> None:
        self._say(f"warning: {message}")

    def note(self, message: str) -> None:
        self._say(message)

    def finish(self, outcome) -> None:
        detail = f": {outcome.error}" if outcome.error else ""
        self._say(f"{outcome.name}: {outcome.status} {outcome.at}{detail}")

    def _say(self, text: str) -> None:
        # names and errors come from the database: a log read in a terminal shows their
        # control codes, never obeys them
        print(f"task {self.task}: {printable(text, lines=True)}", flush=True)


def in_job(connect_db, display):
    """In a rank of a --ddp job's group (JOB_TASK set by its task): the database's connect and
    a display that gives each run rank 0 starts its `slurm` event and logs as a worker's task
    does; elsewhere, both as given."""
    where = os.environ.get(JOB_TASK)
    if where is None:
        return connect_db, display
    try:
        job_id, task, restart = where.split()
        noted = JobDisplay(None, job_id, int(task), int(restart))
    except ValueError:
        raise FibctlError(f"{JOB_TASK}={where!r} is not a job id, task and restart (fibctl slurm submit --ddp "
                          "sets it for its ranks): unset it") from None

    def connect_noted():
        noted.engine = connect_db()
        return noted.engine
    return connect_noted, noted


def note_job(engine: Engine, run_name: str, job_id: str, task: int, host: str, restart: int = 0) -> None:
    """The `slurm` event: which job, task and host trains the run (the worker is host:pid)."""
    def write(conn):
        run_id = conn.execute(select(Run.id).where(Run.name == run_name)).scalar()
        add_event(conn, run_id, "slurm", f"SLURM job {job_id} task {task} on {host} (pid {os.getpid()})",
                  {"job_id": job_id, "task": task, "host": host, "pid": os.getpid(), "restart": restart})
    write_retrying(engine, write)


class WorkerTask(Checkpointable):
    """One SLURM task: a worker in a thread, stopped by the stop event when the job must end.

    Task 0 is submitit's: its USR2 handler calls `checkpoint`, which stops this task's worker,
    waits for the other tasks' workers (each leaves a marker file when it stopped), and returns
    a fresh copy of the task for submitit to requeue. The other tasks stop on USR2 themselves.
    Any task stops on SIGTERM (scancel, the time limit itself)."""

    def __init__(self, worker: WorkerSettings, gpus_per_node: int, folder: Path, stop_wait_s: float = STOP_WAIT_S):
        self.worker, self.gpus_per_node, self.folder, self.stop_wait_s = worker, gpus_per_node, folder, stop_wait_s
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._where: tuple[str, int, int, int] | None = None  # job id, restart, task, tasks

    def __getstate__(self) -> dict:  # what is pickled (submitted, requeued): the settings only
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stop, self._thread, self._where = None, None, None

    def __call__(self):
        import submitit

        env = submitit.JobEnvironment()
        restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        self._where = (str(env.job_id), restart, env.global_rank, env.num_tasks)
        self._stop = threading.Event()
        signal.signal(signal.SIGTERM, self._halt)
        if env.global_rank != 0:  # task 0's USR2 is submitit's, which calls checkpoint()
            signal.signal(signal.SIGUSR2, self._halt)
        result: dict = {}
        self._thread = threading.Thread(target=self._keep, args=(self._begin(env, restart), result),
                                        name="fibctl-worker", daemon=True)
        self._thread.start()
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)  # a timeout: signals reach this (main) thread in between
        finally:
            if env.global_rank != 0:
                self._marker(env.global_rank).touch()
        if env.global_rank == 0 and env.num_tasks > 1:
            # stay until every task is done: a USR2 that comes meanwhile must still requeue the job
            while not self._siblings_stopped() and not self._stop.is_set():
                time.sleep(1)
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def _begin(self, env, restart: int):
        """Set up this task's work; the function its thread runs (what it returns, the task's)."""
        from fibctl.flows.worker import WorkerOptions, work

        w = self.worker
        opts = WorkerOptions(data_dir=_node_path("FIBCTL_DATA", w.data_dir),
                             runs_dir=_node_path("FIBCTL_RUNS_DIR", w.runs_dir), device=self._device(env.local_rank),
                             threads=w.threads, heartbeat_timeout_s=w.heartbeat_timeout_s,
                             max_attempts=w.max_attempts, max_runs=w.max_runs)
        engine = connect(w.db, must_exist=True)
        display = JobDisplay(engine, str(env.job_id), env.global_rank, restart)
        print(f"task {env.global_rank}/{env.num_tasks} of SLURM job {env.job_id} (restart {restart}) on "
              f"{socket.gethostname()}: worker on {opts.device}, database {shown(w.db)}", flush=True)
        return lambda: [dict(name=o.name, status=o.status, step=o.step)
                        for o in work(engine, opts, display, self._stop)]

    def _halt(self, *_) -> None:
        """Stop this task's work at the end of the step in progress (a signal's handler)."""
        self._stop.set()

    def _device(self, local_rank: int) -> str:
        if not self.gpus_per_node:
            return "cpu"
        import torch

        # one GPU per task either way: SLURM may show a task all of the node's GPUs, or only its own
        return f"cuda:{local_rank if torch.cuda.device_count() > 1 else 0}"

    @staticmethod
    def _keep(run, result: dict) -> None:
        try:
            result["value"] = run()
        except BaseException as e:  # raised again in the task's main thread
            result["error"] = e

    def _marker(self, task: int) -> Path:
        job_id, restart, _, _ = self._where
        return self.folder / job_id / f"stopped.{restart}.{task}"

    def _siblings_stopped(self) -> bool:
        _, _, _, tasks = self._where
        return all(self._marker(t).exists() for t in range(1, tasks))

    def checkpoint(self, *args, **kwargs):
        """Called by submitit in task 0 on USR2: stop, wait for the other tasks, requeue."""
        deadline = time.monotonic() + self.stop_wait_s
        if self._stop is not None:
            self._halt()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        while self._where is not None and not self._siblings_stopped() and time.monotonic() < deadline:
            time.sleep(0.5)
        print("task 0: workers stopped; the job is requeued", flush=True)
        return super().checkpoint(*args, **kwargs)


def _node_path(variable: str, given: Path) -> Path:
    """A folder as this node has it: the job's variable (a TaskProlog may set its own), else as given."""
    return Path(os.environ.get(variable) or given)


# the rendezvous port of a --ddp job without --rdzv-port: PORT_BASE + the job id % PORTS, below
# Linux's ephemeral ports (32768 and up), so that two jobs on a node collide only 10,000 job ids apart
PORT_BASE, PORTS = 20000, 10000


def rendezvous_endpoint(hosts: list[str], job_id: str, port: int | None = None) -> str:
    """The c10d rendezvous of a --ddp job: the job's first host, at --rdzv-port or a port from its id."""
    return f"{hosts[0]}:{port if port is not None else PORT_BASE + int(re.match(r'[0-9]+', job_id)[0]) % PORTS}"


def torchrun_args(nnodes: int, per_node: int, endpoint: str, rdzv_id: str) -> list[str]:
    return [f"--nnodes={nnodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]


def group_args(worker: WorkerSettings, gpus: bool, data: str, runs_dir: str) -> list[str]:
    """`fibctl worker --ddp ...` as each rank of a --ddp job's group runs it."""
    args = ["worker", "--ddp", "--plain", "--device", "cuda" if gpus else "cpu", "--data", data,
            "--runs-dir", runs_dir, "--heartbeat-timeout", str(worker.heartbeat_timeout_s),
            "--max-attempts", str(worker.max_attempts)]
    return (args + (["--max-runs", str(worker.max_runs)] if worker.max_runs else [])
            + (["--threads", str(worker.threads)] if worker.threads else []))


class GroupTask(WorkerTask):
    """One task of a --ddp job: torchrun on its node, one "node" of the job's one DDP group
    (its c10d rendezvous at the job's first host, `rendezvous_endpoint`), whose ranks run
    `fibctl worker --ddp`: global rank 0 claims each run and the whole group trains it.

    A stop (USR2, SIGTERM) goes to this task's ranks as SIGTERM (`stop_group`); the ranks
    agree on the step to stop after, and rank 0, wherever it is, checkpoints and puts the run
    back in the queue. SLURM's USR2 reaches every process of the task where it tracks them
    (proctrack/linuxproc, cgroup): it is blocked in torchrun and the ranks, which would end
    by it, and acted on here alone. Its SIGTERM (scancel) reaches them too, and torchrun
    passes its own on: a rank of such a group takes each SIGTERM after the first for the same
    stop (`stop_on_signals`). Task 0's checkpoint, as for workers, waits for every task's
    group to end, then requeues the job."""

    rdzv_port: int | None = None  # a task pickled before --rdzv-port existed has none: the job id's

    def __init__(self, worker: WorkerSettings, gpus_per_node: int, per_task: int, folder: Path,
                 stop_wait_s: float = STOP_WAIT_S, rdzv_port: int | None = None):
        super().__init__(worker, gpus_per_node, folder, stop_wait_s)
        self.per_task, self.rdzv_port = per_task, rdzv_port
        self._group: tuple[subprocess.Popen, str] | None = None
        self._group_stopped = False
        self._why = ""  # what the stop mark tells rank 0 (REQUEUE: the job requeues itself)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._group, self._group_stopped, self._why = None, False, ""

    def _begin(self, env, restart: int):
        from fibctl.flows.torchrun import start_group

        job_id = str(env.job_id)
        # every node sees it (the job folder is shared): a rank of another node that ends still
        # starting, by this stop, is read as the stop, not as a rank that died
        mark = str(self.folder / job_id / f"stopping.{restart}")
        endpoint = rendezvous_endpoint(env.hostnames, os.environ.get("SLURM_JOB_ID") or job_id, self.rdzv_port)
        rdzv = torchrun_args(env.num_tasks, self.per_task, endpoint, job_id)
        args = group_args(self.worker, bool(self.gpus_per_node), str(_node_path("FIBCTL_DATA", self.worker.data_dir)),
                          str(_node_path("FIBCTL_RUNS_DIR", self.worker.runs_dir)))
        print(f"task {env.global_rank}/{env.num_tasks} of SLURM job {job_id} (restart {restart}) on "
              f"{socket.gethostname()}: torchrun {' '.join(rdzv)}, database {shown(self.worker.db)}", flush=True)
        child = start_group(rdzv, args, mark, {"FIBCTL_DB": self.worker.db,
                                               JOB_TASK: f"{job_id} {env.global_rank} {restart}"},
                            shielded=(signal.SIGUSR2,))
        self._group = (child, mark)
        if self._stop.is_set():  # asked while torchrun started
            self._stop_group()
        return lambda: self._ended(child.wait())

    def _halt(self, signum: int | None = None, _frame=None) -> None:
        """USR2 (task 0: submitit's, through `checkpoint`, without a signal) requeues the job;
        SIGTERM (scancel) ends it."""
        if not self._stop.is_set():
            self._why = REQUEUE if signum in (None, signal.SIGUSR2) else ""
        super()._halt()
        self._stop_group()

    def _stop_group(self) -> None:
        """Once: a rank signalled twice takes the second for an abort, without a checkpoint."""
        from fibctl.flows.torchrun import stop_group

        if self._group is not None and not self._group_stopped:
            self._group_stopped = True
            stop_group(*self._group, self._why)

    def _ended(self, code: int) -> dict:
        # 1: a run failed, as a worker's task records and goes on; after a stop, how it ended
        # is the stop's (torchrun stopped before its ranks started reports the signal)
        if code not in (0, 1) and not self._stop.is_set():
            raise FibctlError(f"this task's torchrun ended with exit code {code}: its ranks' lines above say why")
        return {"exit_code": code}


# ----------------------------------------------------------------------------- fibctl slurm status


def squeue_jobs() -> list[dict]:
    """This user's fibctl jobs that SLURM knows: squeue (pending, running), then sacct where
    accounting is on."""
    require_slurm("squeue")
    jobs: dict[str, dict] = {}
    # another user's job of the same name is not this queue's: squeue lists every user's jobs,
    # and so does sacct run by root. A uid, not squeue's --me, which sacct (22.05) lacks
    mine = ["--user", str(os.getuid())]
    out = _slurm_lines(["squeue", "-h", "-t", "all", "--name", JOB_NAME, *mine, "-o", "%i|%T|%M|%l|%D|%R|%P|%r"])
    for line in out or []:
        job_id, state, elapsed, limit, nodes, where, partition, reason = (line.split("|") + [""] * 8)[:8]
        jobs[job_id] = dict(job_id=job_id, state=state, elapsed=elapsed, limit=limit, nodes=nodes, where=where,
                            partition=partition, reason=reason if state == "PENDING" else "")
    if shutil.which("sacct"):
        for line in _slurm_lines(["sacct", "-n", "-P", "-X", "--name", JOB_NAME, *mine,
                                  "-o", "JobID,State,Elapsed,Timelimit,NNodes,NodeList"]) or []:
            job_id, state, elapsed, limit, nodes, where = (line.split("|") + [""] * 6)[:6]
            jobs.setdefault(job_id, dict(job_id=job_id, state=state.split()[0] if state else "", elapsed=elapsed,
                                         limit=limit, nodes=nodes, where=where, partition="", reason=""))
    return sorted(jobs.values(), key=lambda j: _job_key(j["job_id"]))


def _job_key(job_id: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[_.]", job_id))


def _slurm_lines(cmd: list[str]) -> list[str] | None:
    try:
        # errors="replace": SLURM quotes what it read (a config file of other bytes) as it is,
        # which strict UTF-8 failed with a UnicodeDecodeError traceback
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        if cmd[0] == "squeue":  # its silence was read as no jobs: `slurm status` listed none, exit 0
            said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
            why = (f"no answer in {TOOL_TIMEOUT_S} s" if isinstance(e, subprocess.TimeoutExpired)
                   else e.strerror or str(e))
            last = (said.strip().splitlines() or [""])[-1]
            raise FibctlError(f"squeue failed: {why}" + (f" ({last})" if last else "")) from None
        return None
    if proc.returncode != 0:
        if cmd[0] == "squeue":  # sacct without accounting fails: that is not an error here
            raise FibctlError(f"squeue failed: {(proc.stderr.strip().splitlines() or ['no message'])[-1]}")
        return None
    return [line for line in proc.stdout.splitlines() if line.strip()]


def runs_by_job(engine: Engine) -> dict[str, list[dict]]:
    """Each run's last `slurm` event (the job that trained it last), grouped by job id:
    the run's name, status and step reached."""
    q = (select(Event.run_id, Event.data, Event.id, Run.name, Run.status, Run.host)
         .join(Run, Run.id == Event.run_id).where(Event.kind == "slurm").order_by(Event.id))
    last: dict[int, dict] = {}
    with engine.connect() as conn:
        for r in conn.execute(q):
            data = r.data or {}
            last[r.run_id] = dict(name=r.name, status=r.status, host=data.get("host") or r.host,
                                  task=data.get("task"), job_id=str(data.get("job_id")))
    steps = {p["name"]: (p["step"], p["steps"]) for p in queue.progress(engine)}
    out: dict[str, list[dict]] = {}
    for run in last.values():
        run["step"] = steps.get(run["name"])
        out.setdefault(run["job_id"], []).append(run)
    return out


def jobs(engine: Engine) -> tuple[list[dict], dict[str, int]]:
    """SLURM's jobs joined with the runs each trained; and the queue's counts."""
    slurm = squeue_jobs()
    by_job = runs_by_job(engine)
    for job in slurm:
        job["runs"] = by_job.get(job["job_id"], [])
    return slurm, queue.status_counts(engine)
