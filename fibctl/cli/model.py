"""`fibctl model`, `fibctl coverage`, `fibctl bench attention|train|probe`: inspect and
time the core and the training step."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.text import Text

from fibctl.cli import app
from fibctl.cli.common import attention_label, console, fitted_view, model_line, on_interrupt, split_label
from fibctl.config import BASES, PRESETS, SCHEDULES, ConfigError, check_length, get_preset
from fibctl.errors import FibctlError
from fibctl.reports.tables import length_label
from fibctl.schedules import attended_distances, coverage as coverage_counts, coinciding, deviations, layer_alphas

COVERAGE_MAX_LAYERS = 1024
NOTHING_KEPT = "a benchmark writes nothing: nothing is kept"
MAX_LISTED = 2**24  # layers x length

Preset = Annotated[str, typer.Option(help=f"Model preset: {', '.join(PRESETS)}.")]
Schedule = Annotated[str, typer.Option(help=f"Per-layer spacing: {', '.join(SCHEDULES)}.")]
Base = Annotated[str, typer.Option(help=f"Rung sequence: {', '.join(BASES)}.")]
Window = Annotated[int, typer.Option(help="Local window W: distances 0..W are always attended.")]
Length = Annotated[int | None, typer.Option(help="Sequence length to build at (default: the preset's).")]


def _model_config(preset: str, schedule: str, base: str, window: int, length: int | None):
    # the window queue add accepts at the preset's training length; --length then caps it
    cfg = dataclasses.replace(get_preset(preset).model, schedule=schedule, base=base, window=window)
    cfg = cfg.validate().check_window()
    return cfg if length is None else cfg.with_length(check_length(length)).validate()


@app.command("model")
def model_cmd(preset: Preset = "paper", schedule: Schedule = "fixed", base: Base = "fib",
              window: Window = 8, length: Length = None) -> None:
    """Print a model's parameter breakdown and, per layer, alpha and the attended distances.

    Example: fibctl model --preset paper --schedule stagger --window 12"""
    import torch

    from fibctl.model import FibLM

    cfg = _model_config(preset, schedule, base, window, length)
    with torch.device("meta"):  # shapes only: the paper model builds instantly
        model = FibLM(cfg)
    counts = model.param_counts()
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        key = "embedding (tied head)" if name.startswith("embed") else (
            "attention theta" if name.endswith("theta") else
            "attention q,k,v,o" if ".attn." in name else
            "ffn (SwiGLU)" if ".ffn." in name else "norms")
        groups[key] = groups.get(key, 0) + p.numel()
    title = f"{preset}: {model_line(cfg)}"  # as queue show says it (it said V=4096 beside vocab 4,096)
    rows = [[k, f"{v:,}"] for k, v in groups.items()]
    rows += [[Text(label, style), Text(f"{counts[key]:,}", style)]
             for label, key, style in (("non-embedding", "non_embedding", "dim"), ("total", "total", "bold"))]
    # fitted: a plain table cut its headers at 40 columns ('distanc…')
    console.print(fitted_view(["parameters", "count"], rows, whole=("parameters",), right=("count",), title=title))
    if schedule == "dense":
        console.print("dense: every layer attends to all previous positions")
        return
    per_layer = attended_distances(base, schedule, window, cfg.n_layers, cfg.seq_len, cfg.n_rungs)
    alphas = layer_alphas(schedule, cfg.n_layers)
    rows = []
    for l, (a, d) in enumerate(zip(alphas, per_layer)):
        near = min(window, cfg.seq_len - 1)  # the window, capped at T - 1 as the model caps it
        rungs = ", ".join(map(str, d[near + 1:]))  # none when the window reaches T - 1
        rows.append([str(l), f"{a:.4f}", str(len(d)), f"0..{near}" + (f" + {rungs}" if rungs else "")])
    # the distances wrap between numbers, never inside one; a short header, as a field a line
    # reads it too (`  window + rungs: 0..8 + 13, 21`)
    console.print(fitted_view(["layer", "alpha", "distances", "window + rungs"], rows, whole=("window + rungs",),
                              right=("alpha", "distances"), title="per layer" + (" (learned: alpha at initialisation)" if schedule == "learned"
                                                   else "")))
    _print_notes(schedule, cfg.n_layers)


def _print_notes(schedule: str, n_layers: int) -> None:
    """Where this stack is fibctl's choice, and which other schedules it is the same model as."""
    notes = deviations(schedule, n_layers)
    same = coinciding(schedule, n_layers)
    if same:
        names = ", ".join([schedule, *same][:-1]) + f" and {same[-1]}"
        notes.append(f"at {n_layers} layer{'s' if n_layers > 1 else ''}, {names} give every layer the same "
                     "alpha: their runs train the same model")
    for note in notes:
        console.print(f"note: {note}", highlight=False, markup=False)


@app.command("coverage")
def coverage_cmd(base: Base = "fib", schedule: Schedule = "fixed", window: Window = 8,
                 # as `model` and `figure coverage` take it: the preset's layers and length
                 preset: Annotated[str, typer.Option(help=f"Take layers and length from this preset: "
                                                          f"{', '.join(PRESETS)}.")] = "paper",
                 layers: Annotated[int | None, typer.Option(
                     help="Number of layers L (default: the preset's).")] = None,
                 length: Annotated[int | None, typer.Option(
                     help="Sequence length T (default: the preset's).")] = None) -> None:
    """Count the distinct distances each layer reaches, and their union over layers.

    Example: fibctl coverage --schedule stagger --window 8 --length 1024"""
    model = get_preset(preset).model
    layers = model.n_layers if layers is None else layers
    length = model.seq_len if length is None else length
    if layers < 1:  # named as the option, not as the config's n_layers
        raise FibctlError(f"--layers {layers} must be >= 1")
    if layers > COVERAGE_MAX_LAYERS:  # one table row per layer
        raise FibctlError(f"--layers {layers}: at most {COVERAGE_MAX_LAYERS:,} layers")
    if layers * length > MAX_LISTED:
        raise FibctlError(f"--layers {layers} x --length {length:,}: coverage lists every layer's distances, "
                          f"at most {MAX_LISTED:,} in all")
    # the preset's model, trained at --length: its window bound is queue add's at that length
    cfg = dataclasses.replace(model, schedule=schedule, base=base, window=window,
                              n_layers=layers, seq_len=check_length(length)).validate().check_window()
    per_layer, union = coverage_counts(attended_distances(base, schedule, window, layers, length, cfg.n_rungs))
    rows = [[str(l), str(n)] for l, n in enumerate(per_layer)]
    rows.append([Text("union over layers", "bold"), Text(str(union), "bold")])
    console.print(fitted_view(["layer", "distinct distances"], rows, whole=("layer",), right=("distinct distances",),
                              title=f"coverage: {attention_label(schedule, base, window)}; {layers} layers, "
                                    f"T={length_label(length)}"))
    _print_notes(schedule, layers)


bench_app = typer.Typer(help="Benchmarks that print ratios against a baseline measured in the same run.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _or_dash(x: float, spec: str) -> str:
    return "-" if x != x else format(x, spec)  # NaN: not measured


@bench_app.command("attention")
def bench_attention_cmd(
    length: Annotated[list[int], typer.Option("--length", help="Sequence length (repeatable).")] = [1024, 4096],
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed repeats; the median is reported.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls per path.")] = 2,
    threads: Annotated[int, typer.Option(help="torch threads (1: comparable across machines and loads).")] = 1,
    window: Window = 8,
    base: Base = "fib",
    device: Annotated[str | None, typer.Option(
        help="cpu, cuda, cuda:N; default: the first GPU if there is one, else the CPU.")] = None,
) -> None:
    """Time forward and forward+backward of the attention core (paper heads: 8 query, 2 kv, dim 64).

    Paths: dense causal SDPA, the boolean-mask SDPA path, the gather path with integer offsets,
    the gather path with fractional (learned) offsets, and FlexAttention with integer offsets
    where it runs (forward only on the CPU: - for fwd+bwd); on CUDA also learned-flex, the
    fractional offsets through FlexAttention. In the precision training gives the attention:
    bf16 on CUDA, fp32 on the CPU. Ratios are to dense in the same run.

    Example: fibctl bench attention --length 1024 --threads 1"""
    import torch

    from fibctl.device import check_threads, resolve_device
    from fibctl.flows.bench import bench_attention, check_counts

    for T in length:
        check_length(T)
    check_counts(batch=(batch, 1), repeats=(repeats, 1), warmup=(warmup, 0), threads=(threads, 1))
    resolved = resolve_device(device)
    torch.set_num_threads(check_threads(threads))  # more than the CPUs would only contend
    with on_interrupt(NOTHING_KEPT), console.status("benchmarking") as status:
        df = bench_attention(length, batch=batch, repeats=repeats, warmup=warmup, window=window, base=base,
                             device=resolved, progress=lambda msg: status.update(f"benchmarking {msg}"))
    first = df.iloc[0]
    dtypes = f"{first['dtype']}" + ("" if df.dtype.nunique() == 1 else ", learned in float32")
    headers = ["length", "path", "forward ms", "fwd+bwd ms", "fwd / dense", "fwd+bwd / dense"]
    rows = [[str(r.length), r.path, f"{r.forward_ms:.1f}", _or_dash(r.fwd_bwd_ms, ".1f"), f"{r.forward_vs_dense:.3f}",
             _or_dash(r.fwd_bwd_vs_dense, ".3f")] for r in df.itertuples()]
    # the path is a name: left-aligned, as bench train's schedule (right-aligned, it read as a number)
    console.print(fitted_view(headers, rows, right=[h for h in headers if h != "path"], title=(
        f"attention core, {dtypes}, batch {batch}, {first['device']}, median of {repeats}")))
    by = df.set_index(["length", "path"])
    for T in length:
        g, m, l = by.loc[(T, "gather")], by.loc[(T, "mask")], by.loc[(T, "learned")]
        console.print(f"T={T}: gather/mask forward {g.forward_ms / m.forward_ms:.3f}, "
                      f"learned/integer gather fwd+bwd {l.fwd_bwd_ms / g.fwd_bwd_ms:.3f}")


@bench_app.command("train")
def bench_train_cmd(
    preset: Annotated[str, typer.Option(help="Model and recipe preset: paper, tiny, probe or micro.")] = "tiny",
    schedule: Annotated[list[str], typer.Option(
        "--schedule", help="Schedule to time (repeatable); dense is always timed too, first, for the ratios.")]
        = ["dense", "fixed", "stagger", "learned"],
    seq_len: Annotated[int | None, typer.Option(
        "--seq-len", help="Train at this length instead of the preset's.")] = None,
    batch_size: Annotated[int | None, typer.Option(
        "--batch-size", help="Sequences per micro-batch (default: as many tokens per micro-batch as the preset's).")]
        = None,
    grad_accum: Annotated[int | None, typer.Option(
        "--grad-accum", help="Micro-batches per optimizer step (default: the preset's).")] = None,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps per schedule; the median is reported.")] = 20,
    warmup: Annotated[int, typer.Option(help="Untimed optimizer steps per schedule before the timed ones.")] = 3,
    device: Annotated[str | None, typer.Option(
        help="cpu, cuda, cuda:N; default: the first GPU if there is one, else the CPU.")] = None,
    threads: Annotated[int | None, typer.Option(
        help="CPU threads for torch (default 1 on CPU: comparable across machines and loads).")] = None,
    window: Window = 8,
    base: Base = "fib",
    compile: Annotated[bool, typer.Option(
        "--compile", help="Run the steps through torch.compile, as `fibctl train --compile` does "
                          "(the warm-up steps wait for compilation).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the measurement as one JSON record.")] = False,
) -> None:
    """Time whole training steps (forward, backward, clip, AdamW) of a preset's model per
    schedule, against dense measured in the same run, with each schedule's peak memory.

    Each schedule trains in a fresh process on random tokens, with the preset's grad_accum
    micro-batches per step, its precision (bf16 autocast on CUDA, fp32 on the CPU) and the
    attention path training uses there (auto on CUDA, gather on the CPU). Peak memory is
    CUDA's peak allocation on a GPU, else the process's peak RSS (torch included). TFLOP/s
    counts model FLOPs; MFU divides them by the GPU's peak (FIBCTL_PEAK_TFLOPS for a GPU fibctl
    does not know, or the CPU).

    Example: fibctl bench train --preset micro --steps 3 --schedule fixed"""
    import datetime
    import json

    from fibctl.flows.bench import bench_train, train_bench

    bench = train_bench(preset, seq_len, batch_size, steps, warmup, device, threads, window, base, grad_accum, compile)
    with on_interrupt(NOTHING_KEPT), console.status("benchmarking") as status:
        df = bench_train(bench, tuple(schedule), progress=lambda s: status.update(f"benchmarking {s}"))
    first = df.iloc[0]
    if as_json:
        record = {"benchmark": "train", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  **dataclasses.asdict(bench), "device": first.device, "torch_version": first.torch_version,
                  "tokens_per_step": bench.tokens_per_step,
                  "results": df.drop(columns=["device", "torch_version"]).to_dict(orient="records")}
        print(json.dumps(record, indent=2))
        return
    # MFU where the device's peak is known (a GPU of fibctl.flops's list, or FIBCTL_PEAK_TFLOPS)
    with_mfu = first.mfu is not None
    headers = ["schedule", "ms / step", "tokens/s", "vs dense", "TFLOP/s", *(["MFU"] if with_mfu else []),
               "peak MB", "above start MB", "peak / dense"]
    rows = [[r.schedule, f"{r.step_ms:.1f}", f"{r.tokens_per_s:,.0f}", f"{r.speed_vs_dense:.3f}", f"{r.tflops:.3g}",
             *([f"{r.mfu:.1%}"] if with_mfu else []), f"{r.peak_memory_mb:,.0f}",
             f"{r.peak_memory_mb - r.base_memory_mb:,.0f}", f"{r.memory_vs_dense:.3f}"] for r in df.itertuples()]
    title = (f"training, {preset} at T={bench.seq_len}, {split_label(bench.batch_size, bench.grad_accum)} sequences "
             f"({bench.tokens_per_step:,} tokens) per step, {first.device}{', compiled' if compile else ''}, "
             f"median of {steps}")
    console.print(fitted_view(headers, rows, optional=("above start MB", "peak / dense"), right=headers[1:],
                               title=title))
    if bench.device.startswith("cuda"):  # auto chose per layer setting: say what it chose
        console.print("attention paths: " + "; ".join(f"{r.schedule} {r.attention}" for r in df.itertuples()),
                      highlight=False)
    if first.optimizer != get_preset(preset).train.optimizer:
        console.print(f"optimizer: {first.optimizer} ({get_preset(preset).train.optimizer} is unavailable here)",
                      highlight=False)


@bench_app.command("probe")
def bench_probe_cmd(
    width: Annotated[float, typer.Option(help="Blur width w (the probe anneals it from 40 to 0.5).")] = 40.0,
    length: Annotated[int, typer.Option(help="Sequence length.")] = 512,
    batch: Annotated[int, typer.Option(help="Batch size.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed repeats; the median is reported.")] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls per path.")] = 1,
    threads: Annotated[int, typer.Option(help="torch threads (1: comparable across machines and loads).")] = 1,
) -> None:
    """Time forward+backward of the probe's blur attention (one probe layer: 4 query heads, 2 kv
    heads, dim 64, alpha 1) and its memory, reference against the fast path, each in a fresh
    process. Memory is the process's peak RSS growth over the calls. Ratios: fast / reference.

    Example: fibctl bench probe --length 128 --width 10 --repeats 1"""
    from fibctl.flows.bench import ProbeBench, bench_probe, check_counts

    check_length(length)
    if not 0 < width <= length:  # a wider blur is flat over every distance there is (and NaN fails both)
        raise ConfigError(f"--width {width:g} must be > 0 and at most --length {length:,}")
    check_counts(batch=(batch, 1), repeats=(repeats, 1), warmup=(warmup, 0), threads=(threads, 1))
    bench = ProbeBench(width, length, batch, repeats, warmup, threads)
    with on_interrupt(NOTHING_KEPT), console.status("benchmarking") as status:
        df = bench_probe(bench, progress=lambda impl: status.update(f"benchmarking {impl}"))
    headers = ["path", "fwd+bwd ms", "memory MB", "time / ref", "memory / ref"]
    rows = [[r.impl, f"{r.fwd_bwd_ms:,.1f}", f"{r.memory_mb:,.0f}", f"{r.time_vs_reference:.3f}",
             f"{r.memory_vs_reference:.3f}"] for r in df.itertuples()]
    console.print(fitted_view(headers, rows, right=headers[1:], title=(
        f"blur attention, w {width:g}, T={length}, batch {batch}, {df.rungs.iloc[0]} rungs, {threads} thread(s), "
        f"median of {repeats}")))


@bench_app.command("queue")
def bench_queue_cmd(
    db: Annotated[str | None, typer.Option(
        "--db", help="A PostgreSQL URL to benchmark on (a scratch database is created there and dropped); "
        "default: a temporary SQLite file.")] = None,
    processes: Annotated[int, typer.Option("--processes", help="Processes claiming at once (at most 256).")] = 8,
    runs: Annotated[int, typer.Option("--runs", help="Runs queued and claimed (at most 1,000,000).")] = 400,
) -> None:
    """Claims per second with several claiming processes, against a plain UPDATE ... RETURNING
    loop measured in the same run, and one claim against one `micro` training step.

    Example: fibctl bench queue --processes 4 --runs 100"""
    from fibctl.flows.bench_queue import bench_queue

    with on_interrupt(NOTHING_KEPT), console.status("benchmarking claims"):
        b = bench_queue(db, processes=processes, runs=runs)
    headers = ["processes", "claims/s", "plain UPDATE/s", "ratio", "ms per claim", "of a step"]
    # one process alone: what a claim costs; several: throughput, and the slowest one's wait
    rows = [["1", f"{1e3 / b.solo_claim_ms:,.0f}", f"{1e3 / b.solo_plain_ms:,.0f}", f"{b.solo_ratio:.2f}",
             f"{b.solo_claim_ms:.2f}", f"{100 * b.solo_vs_step:.1f} %"],
            [f"{b.processes}", f"{b.claims_per_s:,.0f}", f"{b.plain_per_s:,.0f}", f"{b.ratio:.2f}",
             f"{b.claim_ms:.2f}", f"{100 * b.claim_vs_step:.1f} %"]]
    console.print(fitted_view(headers, rows, right=headers, title=f"queue claims, {b.backend}, {b.runs} runs"))
    console.print(f"micro step: {b.step_ms:.1f} ms (timed as bench train does); "
                  "goal: a claim < 1 % of it", highlight=False)
