"""Where and with what a run trained: the facts a worker records on the run's row when it
claims it, so that a shared database says which host, GPU, code and data produced a number."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import fibctl


def git_commit() -> str | None:
    """The commit of the fibctl code when it runs from a git checkout (`+dirty` when it has
    uncommitted changes); None for an installed package."""
    root = Path(fibctl.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def provenance(manifest=None) -> dict:
    """Columns of the `runs` row: host, pid, fibctl version and commit, torch and CUDA
    versions, the command line, and the data's and tokenizer's hashes."""
    import torch

    facts = dict(host=socket.gethostname(), pid=os.getpid(), fibctl_version=fibctl.__version__,
                 git_commit=git_commit(), torch_version=torch.__version__, cuda_version=torch.version.cuda,
                 command_line=shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])[:2000])
    if manifest is not None:
        facts.update(data_hash=manifest.data_hash, tokenizer_hash=manifest.tokenizer_hash)
    return facts
