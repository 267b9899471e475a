"""`fibctl bench attention` and `fibctl bench train`: speed against dense measured in the same run.

`bench_attention` times the attention core of each path against dense SDPA: medians over
repeats after warm-up, fp32. `bench_train` times whole training steps (forward, backward,
clip, optimizer) of a preset's model per schedule, each schedule in a fresh process so that
its peak memory is its own.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

from fibctl.attention import chosen_impls, default_impl, dense_attention, flex_unavailable, sparse_attention
from fibctl.attention import skipped as attention_skipped
from fibctl.config import INT32_MAX, ConfigError, check_length, get_preset
from fibctl.device import (autocast, check_compile, check_threads, describe, out_of_memory, resolve_device,
                           setup_process, synchronize)
from fibctl.errors import FibctlError
from fibctl.flops import mfu, peak_flops, training_flops_per_token
from fibctl.lazy import pandas as pd  # not in the measured processes: they never build a frame
from fibctl.model import Attention, FibLM
from fibctl.train.optim import build_optimizer, clip_gradients, lr_at, set_lr
from fibctl.train.sampler import batch_to

PATHS = ("dense", "mask", "gather", "learned")


def check_counts(**counts: tuple[int, int]) -> None:
    """Refuse a count option (name: (value, least)) below its least or past INT32_MAX, the bound
    fibctl's training counts take: a larger one overflows torch's shapes (a traceback), or
    would never finish."""
    for name, (value, least) in counts.items():
        flag = "--" + name.replace("_", "-")
        if value < least:
            raise ConfigError(f"{flag} {value} must be >= {least}")
        if value > INT32_MAX:
            raise ConfigError(f"{flag} {value:,} is too large: at most {INT32_MAX:,}")


def check_window(window: int, base: str, length: int) -> None:
    """Refuse a sparse window queue add would refuse at `length` (ModelConfig.check_window):
    one that reaches T - 1 times dense attention under a sparse name, and a huge one would
    build its distances for ever."""
    dataclasses.replace(get_preset("paper").model, schedule="fixed", window=window, base=base,
                        seq_len=length).validate().check_window()


def attention_paths(device_type: str = "cpu") -> tuple[str, ...]:
    """PATHS, and `flex` (the fixed schedule through FlexAttention) where it runs; on CUDA also
    `learned-flex`, learned offsets through FlexAttention over the blended copies (on the
    CPU, flex's unfused forward over T (1 + R) keys would time nothing training uses)."""
    flex = flex_unavailable(device_type, backward=False) is None
    return PATHS + (("flex",) if flex else ()) + (("learned-flex",) if flex and device_type == "cuda" else ())


def attention_dtype(device: torch.device, path: str = "dense") -> torch.dtype:
    """What a path's attention core computes in when a model trains on `device`: bf16 under
    CUDA's autocast, fp32 on the CPU; learned layers in fp32 everywhere (Attention.forward)."""
    return torch.bfloat16 if device.type == "cuda" and not path.startswith("learned") else torch.float32


def _time(fn: Callable[[], None], repeats: int, warmup: int, device: torch.device = torch.device("cpu")) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)  # CUDA returns before its kernels finish
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _core(path: str, T: int, window: int, base: str, device: torch.device):
    """A closure computing one path's attention output for a layer of the paper preset."""
    cfg = get_preset("paper").model
    schedule = "dense" if path == "dense" else "learned" if path.startswith("learned") else "fixed"
    attn = Attention(dataclasses.replace(cfg, schedule=schedule, window=window, base=base), 0).to(device)
    if schedule == "learned":
        with torch.no_grad():
            attn.theta.fill_(0.3)  # alpha ~ 1.07: every rung fractional, the costly case
    impl = path.removeprefix("learned-") if path.removeprefix("learned-") in ("mask", "flex") else "gather"

    def run(q, k, v):
        if schedule == "dense":
            return dense_attention(q, k, v, impl)
        return sparse_attention(q, k, v, attn.columns(T), impl)

    return run, attn


def bench_attention(lengths: list[int], paths: tuple[str, ...] | None = None, batch: int = 1, repeats: int = 5,
                    warmup: int = 2, window: int = 8, base: str = "fib", device: torch.device | str = "cpu",
                    progress: Callable[[str], None] | None = None) -> "pd.DataFrame":
    """Forward and forward+backward medians per length and path, in the dtype training gives
    the attention on `device` (attention_dtype)."""
    cfg = dataclasses.replace(get_preset("paper").model, window=window, base=base).validate()  # W >= 0, a known base
    for T in lengths:  # every length before any is timed
        check_window(window, base, T)
    device = torch.device(device)
    paths = attention_paths(device.type) if paths is None else paths
    no_flex_backward = flex_unavailable(device.type, backward=True) is not None
    rows = []
    for T in lengths:
        try:
            rows += _attention_rows(T, cfg, paths, batch, repeats, warmup, window, base, device, no_flex_backward,
                                    progress)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not out_of_memory(e):
                raise
            raise FibctlError(f"bench attention: T={T}, batch {batch} is out of memory on {describe(device)}") from None
    df = pd.DataFrame(rows)
    dense = df[df.path == "dense"].set_index("length")
    if not dense.empty:
        df["forward_vs_dense"] = df.forward_ms / df.length.map(dense.forward_ms)
        df["fwd_bwd_vs_dense"] = df.fwd_bwd_ms / df.length.map(dense.fwd_bwd_ms)
    return df


def _attention_rows(T: int, cfg, paths: tuple[str, ...], batch: int, repeats: int, warmup: int, window: int,
                    base: str, device: torch.device, no_flex_backward: bool,
                    progress: Callable[[str], None] | None) -> list[dict]:
    """One length's rows of bench_attention, one per path."""
    rows = []
    g = torch.Generator().manual_seed(T)
    shape = lambda h: (batch, h, T, cfg.head_dim)
    made = [torch.randn(shape(h), generator=g) for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads,
                                                          cfg.n_heads)]
    for path in paths:
        if progress:
            progress(f"T={T} {path}")
        dtype = attention_dtype(device, path)
        q0, k0, v0, grad_out = (t.to(device, dtype) for t in made)
        run, attn = _core(path, T, window, base, device)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))

        def forward():
            with torch.no_grad():
                run(q0, k0, v0)

        def forward_backward():
            run(q, k, v).backward(grad_out)

        rows.append({
            "length": T, "path": path,
            "forward_ms": 1e3 * _time(forward, repeats, warmup, device),
            # no backward where flex has none (the CPU): NaN, shown as -
            "fwd_bwd_ms": (float("nan") if path.endswith("flex") and no_flex_backward
                           else 1e3 * _time(forward_backward, repeats, warmup, device)),
            "dtype": str(dtype).removeprefix("torch."), "device": describe(device),
        })
    return rows


# ----------------------------------------------------------------------------- training steps

TRAIN_SCHEDULES = ("dense", "fixed", "stagger", "learned")


@dataclasses.dataclass(frozen=True)
class TrainBench:
    """One `bench train` setting: a preset's model and recipe at `seq_len`, `batch_size` sequences
    per micro-batch and `grad_accum` micro-batches per optimizer step; with `compile`, the
    steps run through torch.compile."""

    preset: str
    seq_len: int
    batch_size: int
    grad_accum: int
    steps: int = 20
    warmup: int = 3
    device: str = "cpu"
    threads: int = 1
    window: int = 8
    base: str = "fib"
    compile: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


def train_bench(preset: str, seq_len: int | None = None, batch_size: int | None = None, steps: int = 20,
                warmup: int = 3, device: str | None = None, threads: int | None = None, window: int = 8,
                base: str = "fib", grad_accum: int | None = None, compile: bool = False) -> TrainBench:
    """The setting, checked. Without `batch_size`, a micro-batch holds as many tokens as the
    preset's (its batch_size x its seq_len), so that every length does the same work per step;
    without `grad_accum`, the preset's."""
    p = get_preset(preset)
    # bounded as bench attention's --length: a huge one grew the child to gigabytes until killed
    T = p.model.seq_len if seq_len is None else check_length(seq_len, "--seq-len")
    if batch_size is None:
        batch_size = max(1, p.train.batch_size * p.model.seq_len // T)
    grad_accum = p.train.grad_accum if grad_accum is None else grad_accum
    check_counts(batch_size=(batch_size, 1), grad_accum=(grad_accum, 1), steps=(steps, 1), warmup=(warmup, 0))
    if threads is not None:
        check_threads(threads)
    resolved = resolve_device(device)
    dataclasses.replace(p.model, base=base, window=window).validate()  # W >= 0, a known base
    if compile:
        check_compile(resolved)
    peak_flops(resolved)  # FIBCTL_PEAK_TFLOPS, if set, is a number
    return TrainBench(preset, T, batch_size, grad_accum, steps, warmup, str(resolved),
                      threads if threads is not None else (1 if resolved.type == "cpu" else torch.get_num_threads()),
                      window, base, compile)


def bench_train(bench: TrainBench, schedules: tuple[str, ...] = TRAIN_SCHEDULES,
                progress: Callable[[str], None] | None = None) -> "pd.DataFrame":
    """Training tokens/s and peak memory of each schedule, dense first (measured in this same
    run whether asked for or not: the ratios are to it). One row per schedule."""
    for schedule in schedules:  # a sparse one takes queue add's windows at the length trained
        dataclasses.replace(get_preset(bench.preset).model, schedule=schedule, window=bench.window, base=bench.base,
                            seq_len=bench.seq_len).validate().check_window()
    order = ["dense", *dict.fromkeys(s for s in schedules if s != "dense")]
    return _each_in_fresh_process(
        _measure_train, bench, order,
        lambda schedule: f"bench train: {schedule} at seq-len {bench.seq_len:,}, batch {bench.batch_size:,} "
                         f"on {bench.device}",
        progress, {"speed_vs_dense": "tokens_per_s", "memory_vs_dense": "peak_memory_mb"})


def _each_in_fresh_process(measure: Callable[..., dict], bench, names: list[str], what: Callable[[str], str],
                           progress: Callable[[str], None] | None, ratios: dict[str, str]) -> "pd.DataFrame":
    """`measure(bench, name)` for each of `names`, each in a fresh process (`in_fresh_process`,
    `what(name)` naming it), a row each; each column of `ratios` is the column it names over
    that column's value in the first row (the baseline, measured in this same run)."""
    rows = []
    for name in names:
        if progress:
            progress(name)
        rows.append(in_fresh_process(measure, bench, name, what=what(name)))
    df = pd.DataFrame(rows)
    for ratio, column in ratios.items():
        df[ratio] = df[column] / df[column].iloc[0]
    return df


def in_fresh_process(measure: Callable[..., dict], *args, what: str) -> dict:
    """`measure(*args)` in a new interpreter (spawned: no state shared with this process, its
    threads or its allocator), so the process's peak memory is that measurement's alone.
    `what` names the measurement in the one-line error when it runs out of memory, or when
    its process does not come back (killed, for memory say). The process ignores Ctrl-C
    (it printed a traceback, torch's import interrupted in it): this one stops it and ends."""
    from fibctl.flows.bench_queue import sigint_left_to_parent, stop_children

    ctx = multiprocessing.get_context("spawn")
    received, sent = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_measured, args=(sent, measure, args), name="fibctl-bench")
    try:
        with sigint_left_to_parent():
            process.start()
        sent.close()  # the child's end only: a process that dies without sending is an EOFError
        try:
            outcome, value, remote = received.recv()
        except EOFError:
            raise FibctlError(f"{what}: its process died (out of memory?)") from None
        process.join(60)  # its exit (torch's teardown), else ended below
    finally:
        sent.close()
        received.close()
        stop_children([process])
    if outcome == "result":
        return value
    if isinstance(value, (torch.OutOfMemoryError, RuntimeError)) and out_of_memory(value):
        raise FibctlError(f"{what}: out of memory") from None
    raise value from _RemoteTraceback(remote)


class _RemoteTraceback(Exception):
    """The measuring process's traceback, as the cause of its error raised here (as
    concurrent.futures gives one)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _measured(sent, measure: Callable[..., dict], args: tuple) -> None:
    """The measuring process: `measure(*args)`'s result, or the error it raised, sent back."""
    import pickle
    import signal
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as inherited: Ctrl-C is the parent's to act on
    try:
        outcome = ("result", measure(*args), "")
    except BaseException as e:  # noqa: BLE001 (every error is the parent's to raise)
        outcome = ("error", e, traceback.format_exc())
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 (an error that does not cross processes: its text does)
            outcome = ("error", RuntimeError(f"{type(e).__name__}: {e}"), outcome[2])
    sent.send(outcome)
    sent.close()


def _measure_train(bench: TrainBench, schedule: str) -> dict:
    """Train `warmup` untimed then `steps` timed optimizer steps on random tokens; the median
    step. Peak memory: CUDA's peak allocation on a GPU, else the process's peak RSS (the
    torch runtime included; `base_memory_mb` is the same measure before the first step)."""
    device = setup_process(bench.device, bench.threads)
    p = get_preset(bench.preset)
    cfg = dataclasses.replace(p.model, schedule=schedule, window=bench.window, base=bench.base,
                              seq_len=bench.seq_len).validate()
    tc = dataclasses.replace(p.train, batch_size=bench.batch_size, steps=bench.warmup + bench.steps,
                             warmup_steps=min(p.train.warmup_steps, bench.warmup + bench.steps))
    torch.manual_seed(0)
    model = FibLM(cfg, default_impl(device)).to(device)
    step_model = model
    if bench.compile:  # as the trainer compiles: paths measured and tables built first
        model.choose_paths(bench.batch_size, cfg.seq_len, device)
        model.prepare(cfg.seq_len, device)
        step_model = torch.compile(model)
    built = build_optimizer(model, tc, device)
    optimizer = built.optimizer
    g = torch.Generator().manual_seed(1)
    base_mb = _memory_mb(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], float("nan")
    for step in range(1, tc.steps + 1):
        batches = [torch.randint(0, cfg.vocab_size, (bench.batch_size, bench.seq_len + 1), generator=g)
                   for _ in range(bench.grad_accum)]
        synchronize(device)
        t0 = time.perf_counter()
        set_lr(optimizer, lr_at(step, tc))
        total = torch.zeros((), dtype=torch.float64, device=device)  # as the trainer sums a step's loss
        for batch in batches:
            x, y = batch_to(batch, device)  # the trainer's copy: pinned on CUDA, as its sampler's
            with autocast(device):
                micro = step_model(x, y) / bench.grad_accum
            micro.backward()
            total += micro.detach()
        clip_gradients(model, tc.clip_bound)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = float(total)  # the trainer's one sync per step
        synchronize(device)
        if step > bench.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens_per_s = bench.tokens_per_step / step_s
    per_token = training_flops_per_token(model, bench.seq_len)
    return {"schedule": schedule, "step_ms": 1e3 * step_s, "tokens_per_s": tokens_per_s,
            "tflops": per_token * tokens_per_s / 1e12, "mfu": mfu(per_token, tokens_per_s, peak_flops(device)),
            "peak_memory_mb": _peak_memory_mb(device), "base_memory_mb": base_mb, "loss": loss,
            "optimizer": built.name, "device": describe(device), "torch_version": torch.__version__,
            "params": model.param_counts()["total"], "attention": _paths_used(model)}


def _paths_used(model: FibLM) -> str:
    """The attention paths the model ran: its impl, or for `auto` what it chose, with how
    many settings (layer, shape, grad mode) went to each."""
    if model.cfg.schedule == "dense":
        return "sdpa"
    if model.blocks[0].attn.impl != "auto":
        return model.blocks[0].attn.impl
    used = ", ".join(f"{impl} x{n}" for impl, n in sorted(chosen_impls().items())) or "auto"
    return used + "".join(f"; {impl} failed: {why}" for impl, why in sorted(attention_skipped.items()))


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return _peak_memory_mb(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


# ----------------------------------------------------------------------------- the probe's blur attention

BLUR_IMPLS = ("reference", "fast")


@dataclasses.dataclass(frozen=True)
class ProbeBench:
    """One `bench probe` setting: a layer of the probe preset (4 query heads, 2 kv heads, dim
    64) at alpha 1, `batch` sequences of `length`, blur rungs of `width`."""

    width: float = 40.0
    length: int = 512
    batch: int = 2
    repeats: int = 3
    warmup: int = 1
    threads: int = 1


def bench_probe(bench: ProbeBench, progress: Callable[[str], None] | None = None) -> "pd.DataFrame":
    """Forward+backward time (median) and memory of the blur attention's reference and fast
    path, each in a fresh process; ratios are fast / reference, from this same run."""
    return _each_in_fresh_process(
        _measure_blur, bench, list(BLUR_IMPLS),
        lambda impl: f"bench probe: {impl} at width {bench.width:g}, length {bench.length:,}, batch {bench.batch:,}",
        progress, {"time_vs_reference": "fwd_bwd_ms", "memory_vs_reference": "memory_mb"})


def _measure_blur(bench: ProbeBench, impl: str) -> dict:
    """Memory: the process's peak RSS after the calls minus before them: what the attention
    and its saved tensors took, the inputs excluded."""
    from fibctl.probe.blur import blur_attention
    from fibctl.schedules import base_sequence, blur_rungs, window_distances

    setup_process("cpu", bench.threads)
    cfg = get_preset("probe").model
    T, D = bench.length, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(bench.batch, cfg.n_heads, T, D, generator=g, requires_grad=True)
    k, v = (torch.randn(bench.batch, cfg.n_kv_heads, T, D, generator=g, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(bench.batch, cfg.n_heads, T, D, generator=g)
    theta = torch.zeros((), requires_grad=True)  # alpha 1
    window = window_distances(cfg.window, T)
    base = base_sequence(cfg.base, T, cfg.n_rungs)

    def forward_backward():
        centres = (0.5 + torch.sigmoid(theta)) * torch.tensor(base, dtype=torch.float32)
        kept = blur_rungs(base, centres.detach().tolist(), cfg.window, T)
        idx = torch.tensor([i for i, _ in kept], dtype=torch.long)
        out = blur_attention(q, k, v, window, [c for _, c in kept], centres[idx], bench.width, impl)
        out.backward(grad_out)

    before = _peak_memory_mb(torch.device("cpu"))
    ms = 1e3 * _time(forward_backward, bench.repeats, bench.warmup)
    return {"impl": impl, "fwd_bwd_ms": ms, "memory_mb": _peak_memory_mb(torch.device("cpu")) - before,
            "rungs": len(blur_rungs(base, base, cfg.window, T))}
