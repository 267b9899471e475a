"""`fibctl model`, `fibctl coverage`, `fibctl bench attention`, `fibctl bench train`, and bad input on them."""

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fibctl.cli import app

runner = CliRunner()


def test_help_lists_every_command_with_text():
    out = runner.invoke(app, ["--help"]).output
    for command in ("model", "coverage", "bench"):
        assert command in out
    assert "attention core" in runner.invoke(app, ["bench", "attention", "--help"]).output.replace("\n", " ")


def test_model_prints_paper_breakdown_and_layers():
    r = runner.invoke(app, ["model", "--preset", "paper", "--schedule", "stagger", "--window", "12"])
    assert r.exit_code == 0, r.output
    assert "60,850,688" in r.output and "44,073,472" in r.output
    assert "0.5000" in r.output and "1.5000" in r.output  # the stagger ramp
    assert "60,850,704" in runner.invoke(app, ["model", "--schedule", "learned"]).output


def test_model_per_layer_numbers_are_right_aligned():
    """The per-layer table's alpha and distance count stood left-aligned, as words do, below
    the parameter counts, which are right-aligned: a count of 9 would sit under 15's first digit."""
    import re

    r = runner.invoke(app, ["model", "--preset", "tiny", "--schedule", "stagger", "--window", "8", "--length", "512"],
                      env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    [header] = [line for line in r.output.splitlines() if "window + rungs" in line]
    rows = [line for line in r.output.splitlines() if re.match(r"│ [0-3] ", line)]
    assert len(rows) == 4, r.output
    for name in ("alpha", "distances"):  # each number's last digit under its header's last letter
        end = header.index(name) + len(name)
        assert all(row[end - 1].isdigit() and row[end] == " " for row in rows), (name, r.output)


def test_the_model_line_says_its_heads_in_words_within_80_columns():
    """It said `heads 8/2`, a ratio to decode: now the query heads and the key/value heads
    they share, on one line at 80 columns for the paper's widest shape (coprime pow2 W=12);
    a model whose every head has its own key/value says no more than its heads."""
    from fibctl.cli.common import model_line
    from fibctl.config import ModelConfig

    r = runner.invoke(app, ["model", "--preset", "paper", "--schedule", "coprime", "--base", "pow2", "--window", "12"],
                      env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == \
        "paper: coprime pow2 W=12; 16 layers, d 512, 8 heads (2 kv), vocab 32,768, T=1024"
    assert ", 4 heads, vocab" in model_line(ModelConfig(n_heads=4, n_kv_heads=4))


def test_a_window_that_reaches_the_length_shows_no_rungs_after_it():
    # micro trains at T=64 with W=8; built at 9, its window reaches T - 1
    r = runner.invoke(app, ["model", "--preset", "micro", "--window", "8", "--length", "9"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "0..8 " in r.output and "0..8 +" not in r.output  # it printed '0..8 +' and nothing after
    assert "0..8 + 13, 21" in runner.invoke(app, ["model", "--preset", "micro", "--window", "8"],
                                            env={"COLUMNS": "120"}).output


def test_dense_coverage_counts_every_distance_and_a_window_shows_capped_at_the_length():
    r = runner.invoke(app, ["coverage", "--schedule", "dense", "--layers", "2", "--length", "3000"])
    assert r.exit_code == 0 and r.output.strip().splitlines()[-2].split("│")[-2].strip() == "3000"
    r = runner.invoke(app, ["model", "--preset", "micro", "--window", "8", "--length", "5"])
    assert r.exit_code == 0 and "│         5 │ 0..4  " in r.output and "0..8" not in r.output


def test_dense_shows_no_window_and_takes_any():
    for command in (["model", "--preset", "micro"], ["coverage", "--layers", "2", "--length", "64"]):
        r = runner.invoke(app, [*command, "--schedule", "dense", "--window", "99999999999999999999"])
        assert r.exit_code == 0 and "W=" not in r.output, r.output


def test_coverage_fixed_fib_w8_is_19():
    r = runner.invoke(app, ["coverage", "--base", "fib", "--schedule", "fixed", "--window", "8", "--length", "1024"])
    assert r.exit_code == 0
    assert r.output.strip().splitlines()[-2].split("│")[-2].strip() == "19"


def test_coverage_takes_a_preset_as_model_and_figure_coverage_do():
    """`fibctl coverage --preset tiny` was 'No such option', while `model --preset tiny` and
    `figure coverage --preset tiny` take it: the preset gives layers and length, the options
    override them, and the paper's stays the default."""
    tiny = runner.invoke(app, ["coverage", "--schedule", "stagger", "--preset", "tiny"], env={"COLUMNS": "80"})
    assert tiny.exit_code == 0, tiny.output
    assert tiny.output.splitlines()[0] == "coverage: stagger fib W=8; 4 layers, T=128"
    assert tiny.output == runner.invoke(app, ["coverage", "--schedule", "stagger", "--layers", "4", "--length", "128"],
                                        env={"COLUMNS": "80"}).output
    assert runner.invoke(app, ["coverage", "--preset", "tiny", "--length", "64"]).output.startswith(
        "coverage: fixed fib W=8; 4 layers, T=64")
    assert runner.invoke(app, ["coverage"]).output.startswith("coverage: fixed fib W=8; 16 layers, T=1024")


def test_bench_attention_prints_ratios_to_dense():
    r = runner.invoke(app, ["bench", "attention", "--length", "64", "--repeats", "1", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    for path in ("dense", "mask", "gather", "learned"):
        assert path in r.output
    assert "1.000" in r.output and "gather/mask forward" in r.output
    assert "float32" in r.output and "cpu (1 thread)" in r.output  # the precision and device timed


def test_bench_attention_and_probe_tables_left_align_the_path_and_fit_80_columns(monkeypatch):
    """Their path column (a name) was right-aligned like the numbers; and at CUDA's paths
    (learned-flex, 4096) the attention table was wider than 80 columns."""
    import pandas as pd

    import fibctl.flows.bench as bench

    paths = ["dense", "mask", "gather", "learned", "flex", "learned-flex"]
    rows = [dict(length=4096, path=p, forward_ms=12345.6, fwd_bwd_ms=23456.7, forward_vs_dense=1.5,
                 fwd_bwd_vs_dense=2.5, dtype="bfloat16", device="cuda:0 (NVIDIA H100 80GB HBM3)") for p in paths]
    monkeypatch.setattr(bench, "bench_attention", lambda *a, **k: pd.DataFrame(rows))
    r = runner.invoke(app, ["bench", "attention", "--length", "4096"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "│ dense        │" in r.output and "│ learned-flex │" in r.output, r.output
    assert "…" not in r.output and all(len(line) <= 80 for line in r.output.splitlines()), r.output
    probe = [dict(impl=i, fwd_bwd_ms=9.1, memory_mb=10.0, time_vs_reference=1.0, memory_vs_reference=1.0, rungs=5)
             for i in ("reference", "fast")]
    monkeypatch.setattr(bench, "bench_probe", lambda *a, **k: pd.DataFrame(probe))
    r = runner.invoke(app, ["bench", "probe", "--length", "128", "--width", "10"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "│ fast      │" in r.output, r.output


def test_bench_attention_times_learned_offsets_through_flex():
    """`learned-flex` (listed on CUDA) times the learned layer through FlexAttention over its
    blended copies; on the CPU, flex has a forward only, so its forward+backward is NaN."""
    from fibctl.attention import flex_unavailable
    from fibctl.flows.bench import attention_paths, bench_attention

    if flex_unavailable("cpu", backward=False):
        pytest.skip(f"flex does not run on this CPU: {flex_unavailable('cpu', backward=False)}")
    assert "learned-flex" not in attention_paths("cpu")
    df = bench_attention([64], paths=("dense", "learned", "learned-flex"), repeats=1, warmup=0)
    df = df.set_index("path")
    assert df.loc["learned-flex"].forward_ms > 0 and math.isnan(df.loc["learned-flex"].fwd_bwd_ms)
    assert df.loc["learned"].fwd_bwd_ms > 0


def test_bench_train_json_times_dense_first_and_gives_ratios_and_memory():
    # fixed and learned asked for: dense is timed too, first, in the same run; T 32 halves the
    # preset's T 64, so a micro-batch holds twice the sequences (same tokens per step)
    r = runner.invoke(app, ["bench", "train", "--preset", "micro", "--seq-len", "32", "--steps", "2", "--warmup", "1",
                            "--schedule", "learned", "--schedule", "fixed", "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.output)
    assert (record["benchmark"], record["preset"], record["seq_len"], record["batch_size"], record["grad_accum"],
            record["steps"], record["warmup"], record["tokens_per_step"]) == ("train", "micro", 32, 8, 2, 2, 1, 512)
    assert record["device"].startswith("cpu") and record["torch_version"] and record["date"]
    rows = {row["schedule"]: row for row in record["results"]}
    assert [row["schedule"] for row in record["results"]] == ["dense", "learned", "fixed"]
    dense = rows["dense"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and math.isfinite(row["loss"]) and row["optimizer"] == "adamw"
        assert row["tokens_per_s"] == pytest.approx(512 / (row["step_ms"] / 1e3))
        assert row["speed_vs_dense"] == pytest.approx(row["tokens_per_s"] / dense["tokens_per_s"])
        assert row["memory_vs_dense"] == pytest.approx(row["peak_memory_mb"] / dense["peak_memory_mb"])
        assert row["peak_memory_mb"] >= row["base_memory_mb"] > 0
    assert dense["speed_vs_dense"] == 1.0 and rows["learned"]["params"] == dense["params"] + 2  # theta per layer
    # the paths training takes on the CPU: SDPA for dense, gather for the sparse schedules
    assert (dense["attention"], rows["fixed"]["attention"], rows["learned"]["attention"]) == ("sdpa", "gather", "gather")


def test_bench_train_grad_accum_sets_the_micro_batches_per_step():
    r = runner.invoke(app, ["bench", "train", "--preset", "micro", "--batch-size", "8", "--grad-accum", "1",
                            "--steps", "1", "--warmup", "0", "--schedule", "dense", "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.output)
    assert (record["batch_size"], record["grad_accum"], record["tokens_per_step"]) == (8, 1, 8 * 64)


def test_bench_train_prints_a_table_against_dense():
    r = runner.invoke(app, ["bench", "train", "--preset", "micro", "--steps", "1", "--warmup", "0",
                            "--schedule", "stagger"])
    assert r.exit_code == 0, r.output
    assert "micro at T=64" in r.output and "512 tokens" in r.output
    rows = [line.split("│")[1:-1] for line in r.output.splitlines() if line.startswith("│")]
    assert [cells[0].strip() for cells in rows] == ["dense", "stagger"]
    assert rows[0][3].strip() == "1.000" and rows[0][-1].strip() == "1.000"  # speed and memory ratios
    assert float(rows[1][3]) > 0 and float(rows[1][-1]) > 0 and float(rows[1][4]) > 0  # and TFLOP/s


def test_bench_train_keeps_the_tokens_of_a_micro_batch_at_other_lengths():
    from fibctl.flows.bench import train_bench

    assert train_bench("tiny", seq_len=1024).batch_size == 2  # 16 x 128 tokens
    assert train_bench("tiny").batch_size == 16 and train_bench("tiny", seq_len=4096).batch_size == 1
    assert train_bench("paper", seq_len=512, batch_size=3).tokens_per_step == 3 * 4 * 512


def test_bench_train_compiled_times_compiled_steps_of_every_schedule():
    """`--compile` on the CPU (inductor's C++ kernels): the steps train and the record says so."""
    r = runner.invoke(app, ["bench", "train", "--preset", "micro", "--steps", "1", "--warmup", "1",
                            "--schedule", "learned", "--compile", "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.output)
    assert record["compile"] is True
    assert [row["schedule"] for row in record["results"]] == ["dense", "learned"]
    assert all(row["tokens_per_s"] > 0 and math.isfinite(row["loss"]) for row in record["results"])


def test_a_measurement_whose_process_dies_is_one_error():
    """A measuring process killed (out of memory, say) is said, not a BrokenProcessPool."""
    import os

    from fibctl.errors import FibctlError
    from fibctl.flows.bench import in_fresh_process

    with pytest.raises(FibctlError, match=r"^the measurement: its process died \(out of memory\?\)$"):
        in_fresh_process(os.abort, what="the measurement")


@pytest.mark.parametrize("args,needle", [
    (["bench", "train", "--steps", "0"], "--steps 0 must be >= 1"),
    (["bench", "train", "--warmup", "-1"], "--warmup -1 must be >= 0"),
    (["bench", "train", "--seq-len", "1"], "--seq-len 1 must be from 2 to 1,048,576"),
    # bench attention's bound (an unbounded one grew the measuring child to gigabytes)
    (["bench", "train", "--preset", "micro", "--seq-len", "99999999"], "--seq-len 99,999,999 must be from 2 to"),
    (["bench", "train", "--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["bench", "train", "--grad-accum", "0"], "--grad-accum 0 must be >= 1"),
    (["bench", "attention", "--device", "tpu"], "unknown device 'tpu'"),
    (["bench", "train", "--schedule", "sliding"], "unknown schedule 'sliding'"),
    (["bench", "train", "--preset", "huge"], "unknown preset 'huge'"),
    (["bench", "train", "--base", "fib3"], "unknown base 'fib3'"),
    (["bench", "train", "--threads", "0"], "--threads must be from 1 to this machine's"),
    (["bench", "train", "--threads", "999999"], "CPUs, got 999999"),
    (["bench", "attention", "--window", "-1"], "window W=-1 must be >= 0"),
    # queue add's window bound, at each --length (a huge one built its distances for ever)
    (["bench", "attention", "--length", "64", "--window", "99999999999999999999"],
     "window W=99999999999999999999 is too large: at most T - 2 = 62 at the training length T=64"),
    (["bench", "attention", "--length", "1024", "--length", "64", "--window", "63"], "at most T - 2 = 62"),
    (["bench", "train", "--preset", "micro", "--window", "63", "--schedule", "fixed"], "at most T - 2 = 62"),
    (["bench", "train", "--preset", "micro", "--seq-len", "32", "--window", "31"], "at most T - 2 = 30"),
    # counts past torch's shapes: one line, not a traceback (nor a list of batches never done)
    (["bench", "attention", "--batch", "99999999999999999999"],
     "--batch 99,999,999,999,999,999,999 is too large: at most 2,147,483,647"),
    (["bench", "attention", "--repeats", "2147483648"], "--repeats 2,147,483,648 is too large"),
    (["bench", "probe", "--batch", "99999999999999999999"], "--batch 99,999,999,999,999,999,999 is too large"),
    (["bench", "train", "--batch-size", "99999999999999999999"], "--batch-size 99,999,999,999,999,999,999 is too"),
    (["bench", "train", "--grad-accum", "99999999999999999999"], "--grad-accum 99,999,999,999,999,999,999 is too"),
    (["bench", "train", "--steps", "99999999999999999999"], "--steps 99,999,999,999,999,999,999 is too large"),
    (["bench", "train", "--warmup", "2147483648"], "--warmup 2,147,483,648 is too large"),
    (["bench", "train", "--device", "cuda"], "device 'cuda' requested but CUDA is not available"),
    # sizes past the machine: one line, not a traceback of the allocator (or a blur that never ends)
    (["bench", "attention", "--length", "99999999999"], "--length 99,999,999,999 must be from 2 to 1,048,576"),
    (["bench", "attention", "--length", "1000000", "--batch", "100000"],
     "bench attention: T=1000000, batch 100000 is out of memory on cpu"),
    (["bench", "train", "--preset", "micro", "--batch-size", "100000000", "--steps", "1", "--warmup", "0"],
     "bench train: dense at seq-len 64, batch 100,000,000 on cpu: out of memory"),
    (["bench", "probe", "--width", "inf"], "--width inf must be > 0 and at most --length 512"),
    (["bench", "probe", "--width", "nan"], "--width nan must be > 0 and at most --length 512"),
    (["bench", "probe", "--length", "2000000"], "--length 2,000,000 must be from 2 to 1,048,576"),
    (["bench", "probe", "--batch", "100000000", "--repeats", "1", "--warmup", "0"],
     "bench probe: reference at width 40, length 512, batch 100,000,000: out of memory"),
    (["model", "--schedule", "sliding"], "unknown schedule 'sliding'; allowed: dense, fixed, learned, stagger, coprime"),
    (["model", "--base", "fib3"], "unknown base 'fib3' (did you mean 'fib'?); allowed: fib, pow2"),
    (["model", "--schedule", "stager"],
     "unknown schedule 'stager' (did you mean 'stagger'?); allowed: dense, fixed, learned, stagger, coprime"),
    (["coverage", "--window", "-2"], "window W=-2 must be >= 0"),
    # queue add's bound: a sparse window leaves T - 1 to a rung (it printed W=99999999999999999999)
    (["model", "--window", "99999999999999999999"], "window W=99999999999999999999 is too large: at most "
                                                     "T - 2 = 1022 at the training length T=1024"),
    (["model", "--preset", "micro", "--window", "63", "--length", "1000"], "at most T - 2 = 62"),
    (["coverage", "--window", "99999999999999999999"], "at most T - 2 = 1022"),
    (["coverage", "--schedule", "stagger", "--window", "63", "--length", "64"], "at most T - 2 = 62"),
    (["coverage", "--layers", "0"], "--layers 0 must be >= 1"),
    # every layer's distances are listed: a mistyped length is one line, not gigabytes
    (["coverage", "--schedule", "dense", "--layers", "1024", "--length", "100000"],
     "--layers 1024 x --length 100,000: coverage lists every layer's distances, at most 16,777,216"),
    (["coverage", "--layers", "1", "--length", "2000000"], "length 2,000,000 must be from 2 to 1,048,576"),
    (["model", "--preset", "micro", "--length", "100000000"], "length 100,000,000 must be from 2 to 1,048,576"),
    (["figure", "coverage", "--schedule", "dense", "--length", "1000000", "-o", "/tmp/never.png"],
     "the coverage figure draws at most 2,097,152 dots a panel (got 16 layers x 1,000,000 distances)"),
    (["figure", "coverage", "--layers", "0", "--length", "1", "-o", "/tmp/never.png"],
     "coverage needs --layers >= 1 (got 0) and --length >= 2 (got 1)"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, monkeypatch, capsys):
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:  # fibctl's main in this process: no new Python to start
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_table_s_title_is_a_left_aligned_line_as_the_report_tables_have_theirs(monkeypatch):
    """`model`, `coverage` and `bench ...` centred their titles and wrapped them at the
    table's width ('   tiny: d=192 L=4 heads=6/2 T=128   ' over two lines), while the report
    tables print theirs as a line of its own: one style now (render.title_line)."""
    from fibctl.flows import bench_queue

    fake = bench_queue.QueueBench("sqlite", 2, 20, 1.0, 0.5, 900.0, 1800.0, 2.0, 100.0)
    monkeypatch.setattr(bench_queue, "bench_queue", lambda *a, **k: fake)
    # model and coverage say the model as queue show does (model said V=4096 beside its vocab 4,096)
    for command, title in ((["model", "--preset", "tiny"],
                            "tiny: fixed fib W=8; 4 layers, d 192, 6 heads (2 kv), vocab 4,096, T=128"),
                           (["coverage", "--layers", "2", "--length", "64"], "coverage: fixed fib W=8; 2 layers, T=64"),
                           (["bench", "queue"], "queue claims, sqlite, 20 runs"),
                           (["report", "table1", "--db", str(Path(__file__).parent.parent / "results.db.example")],
                            "Table 1: final perplexity at the training length (seed 42)")):
        r = runner.invoke(app, command, env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[0] == title, r.output


@pytest.mark.parametrize("command", [["model", "--preset", "micro"], ["coverage", "--preset", "micro"]])
def test_schedules_that_are_the_same_model_at_this_depth_are_said_to_be(command):
    """At 2 layers coprime's slots are stagger's: a micro coprime run and a stagger run gave
    identical alphas and evaluations, which read as a bug. model and coverage say so; at the
    paper's depth, or for a schedule no other equals there, nothing is said."""
    from fibctl.schedules import SCHEDULES, coinciding, layer_alphas

    said = "coprime and stagger give every layer the same alpha: their runs train the same model"
    r = runner.invoke(app, [*command, "--schedule", "coprime"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert f"note: at 2 layers, {said}" in r.output
    for quiet in (["--schedule", "fixed"], ["--schedule", "coprime", "--preset", "paper"]):
        r = runner.invoke(app, [*command, *quiet], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "same model" not in r.output, r.output
    # the note's rule is the alphas' equality, which decides the attended distances
    for L in range(1, 17):
        for schedule in SCHEDULES:
            for other in coinciding(schedule, L):
                assert layer_alphas(other, L) == layer_alphas(schedule, L)
    assert coinciding("stagger", 1) == ["fixed", "coprime"] and coinciding("learned", 2) == []
