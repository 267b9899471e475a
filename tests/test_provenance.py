"""Where things ran: a worker records on the run's row the host, process, device, fibctl
version and commit, torch and CUDA versions, its command line and the data's hashes."""

from __future__ import annotations

import re

import torch
from sqlalchemy import text

import fibctl
from fibctl.data.streams import load_manifest
from fibctl.flows.worker import WorkerOptions, work
from fibctl.provenance import git_commit
from train_helpers import Quiet, micro_run, queued_db, write_data


def test_a_claimed_run_records_where_and_with_what_it_trained(tmp_path):
    data = write_data(tmp_path / "data")
    engine = queued_db(tmp_path / "r.db", micro_run("a", steps=2, eval_interval=2, checkpoint_interval=2))
    work(engine, WorkerOptions(data_dir=data, runs_dir=tmp_path / "runs", device="cpu"), Quiet())
    with engine.connect() as conn:
        row = conn.execute(text("SELECT host, pid, device, fibctl_version, git_commit, torch_version, cuda_version, "
                                "command_line, data_hash, tokenizer_hash FROM runs")).one()
    manifest = load_manifest(data)
    assert row.host and isinstance(row.pid, int) and row.device.startswith("cpu")
    assert row.fibctl_version == fibctl.__version__ and row.torch_version == torch.__version__
    assert row.cuda_version == torch.version.cuda  # None on a CPU build
    assert row.git_commit == git_commit()  # this checkout's commit (None for an installed package)
    if row.git_commit:
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", row.git_commit)
    assert row.command_line
    assert (row.data_hash, row.tokenizer_hash) == (manifest.data_hash, manifest.tokenizer_hash)


def test_the_recorded_cpu_device_names_its_threads():
    import torch

    from fibctl.device import describe

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert describe(torch.device("cpu")) == "cpu (1 thread)"
        torch.set_num_threads(2)
        assert describe(torch.device("cpu")) == "cpu (2 threads)"
    finally:
        torch.set_num_threads(before)
