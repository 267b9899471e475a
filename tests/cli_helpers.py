"""Running fibctl's CLI inside the test process, for tests about what a command says and
leaves behind rather than about the process boundary (a new Python for each costs seconds of
importing torch)."""

from __future__ import annotations

import sys

import pytest


def refused(monkeypatch, capsys, *args: str) -> str:
    """`fibctl ARGS` by its main, as the entry point calls it: exit 2 with one line and no
    traceback; that line."""
    from fibctl.cli import main

    monkeypatch.setattr(sys, "argv", ["fibctl", *args])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    assert done.value.code == 2 and "Traceback" not in out.err + out.out, out
    assert len(out.err.strip().splitlines()) == 1, out.err
    return out.err
