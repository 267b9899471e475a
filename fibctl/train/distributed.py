"""One run over several processes: torchrun's environment, the process group, and the few
collectives the training loop needs (DistributedDataParallel does the gradients).

Every rank builds the same model (same `init_seed`) and draws the same batches (same
`data_seed`); the `grad_accum` micro-batches of an optimizer step are split between the
ranks in contiguous blocks, so the global batch and the data order are those of one process.
Rank 0 alone claims the run, writes to the database, evaluates and writes checkpoints.
A collective that fails (a rank died, or stayed silent past the timeout) raises `PeerLost`.
"""

from __future__ import annotations

import gc
import os
import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fibctl.device import resolve_device, setup_process
from fibctl.errors import FibctlError

class PeerLost(FibctlError):
    """Another rank of the group died or stopped answering: this rank stops too. Exit code 2,
    as for a worker's setup (the run goes back to the queue), not 1: that says a run failed,
    after which a SLURM task ends as done (GroupTask._ended), the queue not drained."""


def check_split(grad_accum: int, world: int, name: str) -> None:
    """The micro-batches of a step must split evenly, or the global batch would change."""
    if grad_accum % world:
        raise FibctlError(f"run {name!r} accumulates {grad_accum} micro-batches per step, which "
                          f"{world} processes cannot share evenly: use a process count that divides {grad_accum}, "
                          "or queue it with more, smaller micro-batches (train.grad_accum)")


@dataclass
class Group:
    rank: int
    world: int
    local_rank: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    def micro_batches(self, grad_accum: int) -> range:
        """The indices of a step's micro-batches this rank computes: a contiguous block."""
        k = grad_accum // self.world
        return range(self.rank * k, (self.rank + 1) * k)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        except Exception as e:  # DistBackendError, RuntimeError: connection closed, timeout
            raise PeerLost(_lost(e)) from None
        return t

    def any(self, *flags: bool, device: torch.device) -> list[bool]:
        """Each flag, true when it is true on any rank: every rank takes the same decision."""
        t = torch.tensor([int(f) for f in flags], device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except Exception as e:
            raise PeerLost(_lost(e)) from None
        return [bool(v) for v in t.tolist()]

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as e:
            raise PeerLost(_lost(e)) from None
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            # the last DDP wrapper's reference cycles freed now, with the interpreter whole: its
            # group's C++ threads torn down at exit instead can abort the process
            gc.collect()
            dist.destroy_process_group()


def _rank() -> tuple[int, int, int]:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them. Other values (a rank started by
    hand) failed as a traceback (int('abc'), a world of 0), or waited for ranks that never come."""
    given = [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")]
    if all(v.strip().isdecimal() for v in given):  # int() takes '+1' and '1_0' too
        rank, world, local = map(int, given)
        port = os.environ["MASTER_PORT"]
        # torch's rendezvous raised ValueError for it, a traceback, as for int('abc') above
        if not (port.strip().isdecimal() and int(port) <= 65535):
            raise FibctlError(f"--ddp: MASTER_PORT={port!r} is not a port (0 to 65535); start the ranks with torchrun")
        if rank < world:
            return rank, world, local
    raise FibctlError(f"--ddp: RANK={given[0]!r} WORLD_SIZE={given[1]!r} LOCAL_RANK={given[2]!r} is not a rank "
                      "of a group (whole numbers, RANK below WORLD_SIZE); start the ranks with torchrun")


def join(device: str | None, threads: int | None, timeout_s: float) -> tuple[Group, torch.device]:
    """Join the torchrun group: gloo on the CPU, NCCL on CUDA (one GPU per local rank).
    A collective waits at most `timeout_s` for the other ranks."""
    rank, world, local = _rank()
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        if local >= torch.cuda.device_count():
            raise FibctlError(f"rank {rank} has local rank {local} but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
        resolved = torch.device("cuda", local)
        torch.cuda.set_device(resolved)
    setup_process(str(resolved), threads)
    dist.init_process_group("nccl" if resolved.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return Group(rank, world, local), resolved


class Silent:
    """The reporter of ranks other than 0: they train, rank 0 reports."""

    def log_step(self, *a, **k) -> None: ...

    def log_eval(self, *a, **k) -> None: ...

    def log_alphas(self, *a, **k) -> None: ...

    def heartbeat(self) -> bool:
        return True

    def event(self, *a, **k) -> None: ...


PEER_FAILURES = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo", "nccl",
                 "process group", "socket")


def peer_failure(e: BaseException) -> bool:
    """Whether an error raised inside DDP (its gradient exchange) is another rank's death or
    silence rather than this rank's own failure."""
    if isinstance(e, (dist.DistError, PeerLost)):
        return True
    return isinstance(e, RuntimeError) and any(word in str(e).lower() for word in PEER_FAILURES)


def as_peer_lost(e: Exception) -> PeerLost:
    return e if isinstance(e, PeerLost) else PeerLost(_lost(e))


# gloo's and NCCL's messages open with the C++ source line that raised them
SOURCE_LINE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|cu|h|hpp):\d+\]\s*")


def _lost(e: Exception) -> str:
    """The first sentence of the collective's error, without the source file it names: gloo's
    ran to 200 characters, cut mid-word ("[/__w/pytorch/.../pair.cc:553] Connection closed by
    peer [127.0.0.1]:59017. This is typically caused by a remote worker crashing. Check the
    logs of the remote w")."""
    lines = str(e).strip().splitlines()
    said = SOURCE_LINE.sub("", lines[0], count=1).split(". ")[0][:200] if lines else ""
    return "another rank of the group died or stopped answering (" + (said or type(e).__name__) + ")"
