"""Every command in the README and docs/ runs as written. Blocks fenced ```bash need no
network, GPU or the study's data, and run here against a `fibctl demo --quick` folder (with
results.db.example beside it); blocks that need those are fenced ```sh and only parsed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced(path: Path, language: str) -> list[str]:
    """The commands of every ```language block: continuation lines and quoted strings that
    span lines joined, comments dropped."""
    out = []
    for block in re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S):
        buffer = ""
        for line in block.splitlines():
            buffer = f"{buffer}\n{line}" if buffer else line
            if buffer.endswith("\\"):
                buffer = buffer[:-1]
                continue
            try:
                words = shlex.split(buffer, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if words:
                out.append(buffer.strip())
            buffer = ""
        assert not buffer, f"{path.name}: unterminated command {buffer!r}"
    return out


RUNNABLE = [(p.name, c) for p in PAGES for c in fenced(p, "bash")]


def test_the_docs_hold_runnable_and_parsed_commands():
    assert len(RUNNABLE) >= 10
    shown = [c for p in PAGES for c in fenced(p, "sh")]
    assert any("--gpus" in c for c in shown) and any("data prepare paper" in c for c in shown)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, quick_demo) -> tuple[Path, dict]:
    """A folder with a copy of the session's finished quick demo (as fibctl-demo/, which the
    commands change) and results.db.example."""
    root = tmp_path_factory.mktemp("docs")
    env = {**os.environ, "COLUMNS": "100", "HF_HUB_OFFLINE": "1"}
    shutil.copytree(quick_demo[0], root / "fibctl-demo")
    shutil.copy(ROOT / "results.db.example", root / "results.db.example")
    env |= {"FIBCTL_DB": "fibctl-demo/results.db", "FIBCTL_DATA": "fibctl-demo/data",
            "FIBCTL_RUNS_DIR": "fibctl-demo/runs",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return root, env


@pytest.mark.parametrize("page,command", RUNNABLE, ids=[f"{p}:{c[:40]}" for p, c in RUNNABLE])
def test_command_runs_as_written(sandbox, page, command):
    root, env = sandbox
    if not shutil.which("fibctl", path=env["PATH"]):
        pytest.skip("the fibctl entry point is not installed (pip install -e .)")
    done = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{page}: {command}\n{done.stderr[-2000:]}"
    assert "Traceback" not in done.stderr
