"""`fibctl model`, `fibctl coverage`, `fibctl bench attention`, and bad input on them."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fibctl.cli import app

runner = CliRunner()


def fibctl(*args):
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True)


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


def test_coverage_fixed_fib_w8_is_19():
    r = runner.invoke(app, ["coverage", "--base", "fib", "--schedule", "fixed", "--window", "8", "--length", "1024"])
    assert r.exit_code == 0
    assert r.output.strip().splitlines()[-2].split("│")[-2].strip() == "19"


def test_bench_attention_prints_ratios_to_dense():
    r = runner.invoke(app, ["bench", "attention", "--length", "64", "--repeats", "1", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    for path in ("dense", "mask", "gather", "learned"):
        assert path in r.output
    assert "1.000" in r.output and "gather/mask forward" in r.output


@pytest.mark.parametrize("args,needle", [
    (["model", "--schedule", "sliding"], "unknown schedule 'sliding'; allowed: dense, fixed, learned, stagger, coprime"),
    (["model", "--base", "fib3"], "unknown base 'fib3'; allowed: fib, pow2"),
    (["coverage", "--window", "-2"], "window W=-2 must be >= 0"),
    (["coverage", "--layers", "0"], "n_layers=0 must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = fibctl(*args)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
