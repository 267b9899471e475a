"""Where a process computes: device names, threads, the precision of the recipe (bf16
autocast on CUDA, fp32 on CPU), and whether torch.compile can run here."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys

import torch

from fibctl.errors import FibctlError


def resolve_device(name: str | None = None) -> torch.device:
    """`auto` (or None): the first CUDA device if there is one, else the CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not name.strip():
        raise FibctlError("--device is empty; use cpu, cuda, cuda:N or auto")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # meta, mps, xpu: nothing fibctl runs on
        raise FibctlError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FibctlError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def describe(device: torch.device) -> str:
    """What the run row records, e.g. `cuda:0 NVIDIA H200` or `cpu (1 thread)`."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'s' if n != 1 else ''})"


def setup_process(device: str | None = None, threads: int | None = None) -> torch.device:
    """The one process setup of training and evaluation: the device, the CPU threads (1 by
    default on CPU, so that several processes can share a machine) and the allocator."""
    resolved = resolve_device(device)
    set_threads(threads if threads is not None or resolved.type == "cuda" else 1)
    if resolved.type == "cpu":
        keep_freed_memory()
    return resolved


def keep_freed_memory() -> None:
    """Ask glibc to reuse freed memory instead of returning it to the system.

    Activations and logits of tens of MB are allocated and freed every step; by default glibc
    gives such blocks back to the OS, and touching fresh pages again costs a large part of a
    CPU training step in page faults (docs/benchmarks.md).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: blocks below 1 GiB come from the heap
            libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
            pass


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failing: CUDA's own error, or the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def check_threads(threads: int) -> int:
    cpus = os.cpu_count() or 1
    if not 1 <= threads <= cpus:  # more would only contend (and a huge count exhausts memory)
        raise FibctlError(f"--threads must be from 1 to this machine's {cpus} CPUs, got {threads}")
    return threads


def set_threads(threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(check_threads(threads))


def autocast(device: torch.device):
    """bf16 autocast on CUDA; nothing (fp32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def constant(values: tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small tensor of fixed values (distances, rows) on `device`, made once per process and
    shared: never write to it. On CUDA a tensor made from a Python list is a blocking copy;
    made in a layer's forward, it would hold the host until the GPU caught up, in every layer
    of every micro-batch, and the host could no longer queue kernels ahead of the GPU."""
    if torch.compiler.is_compiling():  # traced, it is a constant of the graph
        return torch.tensor(values, dtype=dtype, device=device)
    return _constant(tuple(values), dtype, str(device))


@functools.lru_cache(maxsize=1024)
def _constant(values: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot run on `device` here, or None when it can: Python without
    dynamo, no C++ compiler for inductor's CPU kernels (`g++`, or `CXX`), or any failure to
    compile and run a one-line function on the device (a CUDA machine without triton, say)."""
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return f"torch {torch.__version__} has no torch.compile for Python {sys.version.split()[0]}"
        if device.type == "cpu":
            # the kernel cache can hide a missing compiler from a probe until a new kernel is built
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        probe = torch.compile(_compile_probe, fullgraph=True)
        probe(torch.ones(8, device=device))
    except Exception as e:  # InvalidCxxCompiler, BackendCompilerFailed, ImportError, ...
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return None


def check_compile(device: torch.device) -> None:
    why = compile_unavailable(device)
    if why:
        raise FibctlError(f"--compile: torch.compile cannot run on {device} here ({why}); "
                          "install a C++ compiler (g++, or set CXX) or drop --compile")


def _compile_probe(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1
