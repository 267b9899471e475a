"""Two `fibctl data prepare` runs into one folder: the second refuses and touches nothing of the
first's; a killed prepare's lock does not outlive it, and the next prepare tidies after it."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fibctl.cli import app
from fibctl.data.prepare import lock_path, prepare
from fibctl.data.recipe import load_recipe
from fibctl.errors import FibctlError

GENERATED = """
name = "gen"
vocab_size = 300
train_tokens = {train_tokens}
tokenizer_sample_chars = 20000

[[sources]]
name = "stories"
kind = "generated"
documents = 400
share = 1
heldout = "stories_val"
heldout_fraction = 0.5
"""

# the hub source stops the build at its first request, to a socket the test holds unanswered
HUB = """
name = "hubmix"
vocab_size = 300
train_tokens = 4000
tokenizer_sample_chars = 20000

[[sources]]
name = "local"
kind = "generated"
documents = 400
share = 0.5
heldout = "local_val"

[[sources]]
name = "stories"
kind = "hub"
dataset = "roneneldan/TinyStories"
share = 0.5
"""


def _generated(root: Path, train_tokens: int) -> Path:
    path = root / "gen.toml"
    path.write_text(GENERATED.format(train_tokens=train_tokens))
    return path


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `root`, hidden ones too: (size, modification time)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _fibctl(*args: str, cwd: Path, env: dict | None = None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "fibctl", *args], cwd=cwd, env=env or os.environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_held_lock_refuses_a_second_prepare_then_a_dead_holder_does_not(tmp_path):
    """The test holds the lock as a running prepare does, beside its half-built folder."""
    out = tmp_path / "d"
    prepare(load_recipe(_generated(tmp_path, 2000)), out)
    rebuild = load_recipe(_generated(tmp_path, 3000))
    work = tmp_path / ".d.partial-999999"  # the holder's work so far
    (work / "scratch").mkdir(parents=True)
    (work / "tokenizer.json").write_text("{}")
    with open(lock_path(out), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        before = _snapshot(tmp_path)
        with pytest.raises(FibctlError, match=f"^{re.escape(str(out))}: another `fibctl data prepare` "
                                              "is building it now"):
            prepare(rebuild, out)
        assert _snapshot(tmp_path) == before
    # the holder gone without cleaning up: its lock file and work folder stay, its lock does not
    assert lock_path(out).exists() and work.is_dir()
    result = prepare(rebuild, out)
    assert not result.reused and result.manifest.tokens["train"] == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "gen.toml"]


def test_concurrent_cli_prepares_then_sigkill(tmp_path):
    """Real processes: a prepare held mid-build (waiting on the hub) and a second one into the
    same folder; then SIGKILL of the first, a third prepare, and `data show`, which locks
    nothing."""
    prepare(load_recipe(_generated(tmp_path, 2000)), tmp_path / "d")  # a finished folder to replace
    _generated(tmp_path, 3000)  # the recipe the second and third prepares ask for: a rebuild
    (tmp_path / "hub.toml").write_text(HUB)
    hub = socket.create_server(("127.0.0.1", 0))
    hub.settimeout(1)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}", HF_HUB_ETAG_TIMEOUT="600")
    first = _fibctl("data", "prepare", "hub.toml", "--data", "d", "-q", cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:  # the first prepare's hub request: it holds the lock and has begun building
            try:
                request, _ = hub.accept()
                break
            except TimeoutError:
                assert first.poll() is None, first.communicate()
                assert time.monotonic() < deadline, "the first prepare never asked the hub"
        work = tmp_path / f".d.partial-{first.pid}"
        assert work.is_dir() and lock_path(tmp_path / "d").exists()
        before = _snapshot(tmp_path)

        second = _fibctl("data", "prepare", "gen.toml", "--data", "d", "-q", cwd=tmp_path)
        stdout, stderr = second.communicate(timeout=300)
        assert second.returncode == 2, stderr
        [line] = stderr.strip().splitlines()
        assert line.startswith("error: d: another `fibctl data prepare` is building it now")
        assert _snapshot(tmp_path) == before and first.poll() is None
    finally:
        first.kill()  # SIGKILL: no chance to clean up or unlock
        first.wait(timeout=60)
        hub.close()
    request.close()

    # killed mid-build: its work folder and lock file stay, but nothing holds the lock
    assert work.is_dir() and lock_path(tmp_path / "d").exists()
    result = prepare(load_recipe(tmp_path / "gen.toml"), tmp_path / "d")
    assert not result.reused and result.manifest.tokens["train"] == 3000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "gen.toml", "hub.toml"]

    shown = CliRunner().invoke(app, ["data", "show", str(tmp_path / "d")])
    assert shown.exit_code == 0 and "3,000" in shown.output, shown.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "gen.toml", "hub.toml"]
