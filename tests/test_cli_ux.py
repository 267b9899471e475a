"""What a user sees of the command line: start-up without the heavy libraries, flags shown
as flags, option names that agree across commands, tables that fit 80 columns."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV80 = {**os.environ, "COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}


def fibctl(*args, env=ENV80, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fibctl", *args], capture_output=True, text=True, env=env,
                          timeout=120, **kwargs)


def test_the_command_line_starts_without_torch_or_matplotlib():
    """`fibctl --help`, `queue ls`, `report`, `sql` import fibctl.cli only: torch and
    matplotlib load inside the commands that train, evaluate or draw."""
    probe = ("import sys, time; t = time.perf_counter(); import fibctl.cli; "
             "print(time.perf_counter() - t); print(' '.join(sorted(m for m in ('torch', 'matplotlib', "
             "'tensorboard', 'wandb', 'tokenizers', 'datasets') if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seconds, loaded = done.stdout.splitlines()
    assert loaded == "", f"fibctl.cli imported {loaded} ({float(seconds):.2f} s)"


def test_flags_show_as_flags_and_help_paragraphs_wrap():
    done = fibctl("demo", "--help")
    assert done.returncode == 0, done.stderr
    assert "<bool>" not in done.stdout and "--quick" in done.stdout and "--plain" in done.stdout
    assert all(len(line) <= 80 for line in done.stdout.splitlines())
    for command in (["worker"], ["sql"], ["eval"], ["data", "prepare"], ["queue", "rm"]):
        out = fibctl(*command, "--help").stdout
        assert "<bool>" not in out and "--help" in out, command
