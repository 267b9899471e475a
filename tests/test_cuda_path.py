"""The CUDA fast path's decisions (fused AdamW, pinned non-blocking batch copies), decided by
small functions that the CPU tests cover; the CUDA tests run where there is a GPU."""

from __future__ import annotations

import ctypes
import dataclasses
import sys
import types

import numpy as np
import pytest
import torch

from fibctl.config import get_preset
from fibctl.model import FibLM, rope_tables
from fibctl.schedules import base_sequence, fractional_rungs
from fibctl.train import optim as optim_module
from fibctl.train.optim import adamw_kwargs, build_optimizer
from fibctl.train.sampler import WindowSampler, pinned_copy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_fused_adamw_and_pinned_copies_are_for_cuda_only():
    assert adamw_kwargs(torch.device("cpu")) == {}
    assert adamw_kwargs(torch.device("cuda", 0)) == {"fused": True}  # torch >= 2.0 has it; a decision, no GPU
    assert pinned_copy("cuda:1") and pinned_copy(torch.device("cuda"))
    assert not pinned_copy("cpu") and not pinned_copy(torch.device("cpu"))


def test_the_cpu_optimizer_is_plain_adamw_and_batches_are_unpinned():
    model = FibLM(get_preset("micro").model)
    built = build_optimizer(model, get_preset("micro").train, torch.device("cpu"))
    assert (built.name, built.fused) == ("adamw", False)
    assert not built.optimizer.defaults.get("fused")
    x, y = WindowSampler(np.arange(1000, dtype=np.uint16), 16, 2, seed=0).next_batch("cpu")
    assert not x.is_pinned() and torch.equal(x[:, 1:], y[:, :-1])


def test_bench_train_copies_its_batches_as_training_does(monkeypatch):
    """On CUDA training pins each batch and copies it without blocking; `bench train` copied
    from pageable memory, timing another copy than training's. Both go through `batch_to`:
    here it is told to pin (as on CUDA) and every pin is noted (a CPU has none to make)."""
    from fibctl.flows.bench import TrainBench, _measure_train
    from fibctl.train import sampler as sampler_module

    pinned = []
    monkeypatch.setattr(sampler_module, "pinned_copy", lambda device: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(tuple(t.shape)) or t)
    WindowSampler(np.arange(1000, dtype=np.uint16), 16, 2, seed=0).next_batch("cpu")  # the trainer's
    assert pinned == [(2, 17)]
    bench = TrainBench("micro", seq_len=16, batch_size=2, grad_accum=2, steps=1, warmup=0)
    assert _measure_train(bench, "fixed")["step_ms"] > 0
    assert pinned == [(2, 17)] * 3  # and each of the bench's micro-batches


@needs_cuda
def test_on_cuda_adamw_is_fused_and_batches_arrive_equal_to_the_cpu_ones():
    model = FibLM(get_preset("micro").model).cuda()
    built = build_optimizer(model, get_preset("micro").train, torch.device("cuda"))
    assert built.fused and built.optimizer.defaults["fused"] is True
    stream = np.arange(5000, dtype=np.uint16) % get_preset("micro").model.vocab_size  # token ids, not past the vocab
    x, y = WindowSampler(stream, 32, 4, seed=3).next_batch("cuda")
    cx, cy = WindowSampler(stream, 32, 4, seed=3).next_batch("cpu")
    assert x.is_cuda and torch.equal(x.cpu(), cx) and torch.equal(y.cpu(), cy)
    model.train()
    loss = model(x, y)
    loss.backward()
    built.optimizer.step()  # the fused kernel runs
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_of_a_node_s_gpus_resumes_on_a_worker_that_sees_one(monkeypatch):
    # rank 0 of an 8-GPU DDP group (or an unpinned worker) saves 8 CUDA RNG states; a worker
    # pinned to one GPU (--gpus) resuming it failed the run: set_rng_state_all(8 states) indexed
    # devices 1-7, which it does not have (IndexError, as torch.cuda.default_generators[7])
    from fibctl.train import checkpoint

    visible, restored = 1, {}

    def set_rng_state(state, device="cuda"):
        index = device if isinstance(device, int) else torch.device(device).index
        if index >= visible:
            raise IndexError("tuple index out of range")
        restored[index] = state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": __import__("random").getstate(),
              "cuda": [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]}
    checkpoint.restore_rng_states(states)
    assert list(restored) == [0] and torch.equal(restored[0], states["cuda"][0])


def micro(schedule: str, impl: str = "gather") -> FibLM:
    return FibLM(dataclasses.replace(get_preset("micro").model, schedule=schedule), impl)


def test_learned_rungs_are_read_from_the_device_once_per_value_of_theta(monkeypatch):
    """The kept rungs of a learned layer (a read of alpha on the host, a wait for the GPU on
    CUDA) are read once per value of theta, not once per layer call, and a new value (an
    optimizer step, a write, a cast) is read again."""
    import fibctl.model as model_module

    reads = []
    real = model_module.fractional_rungs
    monkeypatch.setattr(model_module, "fractional_rungs", lambda *a: reads.append(1) or real(*a))
    model = micro("learned")
    L, T = model.cfg.n_layers, 40
    x = torch.randint(0, model.cfg.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # three micro-batches of one step
        model(x[:, :-1], x[:, 1:]).backward()
    assert len(reads) == L
    torch.optim.AdamW(model.parameters(), lr=0.5).step()
    model(x[:, :-1], x[:, 1:])
    assert len(reads) == 2 * L
    model(x[:, :8], x[:, 1:9])  # another length
    assert len(reads) == 3 * L
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.theta.fill_(1.3)  # alpha 0.5 + sigmoid(1.3) = 1.286: every rung moves
    fresh = real((attn.alpha.detach() * torch.tensor([float(b) for b in base_sequence(
        model.cfg.base, T, model.cfg.n_rungs)])).tolist(), model.cfg.window, T)
    assert attn.columns(T).lo == [lo for _, lo in fresh]
    model.double()  # a cast: new storage, the rungs read again in float64
    before = len(reads)
    attn.columns(T)
    assert len(reads) == before + 1


class _PointerAdamW8bit(torch.optim.Optimizer):
    """Stands in for bitsandbytes' AdamW8bit where it matters here: its kernels write each
    weight through the weight's raw pointer, which leaves the tensor's version unchanged."""

    def __init__(self, params, lr, betas, eps):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                new = (p - group["lr"] * p.grad.sign()).contiguous()
                ctypes.memmove(p.data_ptr(), new.data_ptr(), p.numel() * p.element_size())


@pytest.mark.parametrize("optimizer", ["adamw fused", "adamw8bit"])
def test_learned_rungs_follow_theta_through_optimizers_that_write_in_place(optimizer, monkeypatch):
    """torch's fused AdamW (every CUDA run, the probe everywhere) and bitsandbytes' 8-bit AdamW
    (the `paper` preset) write theta without bumping its version: a learned layer must still
    read its rungs again after each step, or lo stays where alpha began and frac leaves [0, 1)."""
    if optimizer == "adamw8bit":
        monkeypatch.setattr(optim_module, "eight_bit_unavailable", lambda device: None)
        monkeypatch.setitem(sys.modules, "bitsandbytes", types.SimpleNamespace(
            optim=types.SimpleNamespace(AdamW8bit=_PointerAdamW8bit)))
    else:
        monkeypatch.setattr(optim_module, "adamw_kwargs", lambda device: {"fused": True})
    torch.manual_seed(0)
    model = micro("learned")
    tc = dataclasses.replace(get_preset("micro").train, optimizer=optimizer.split()[0])
    built = build_optimizer(model, tc, torch.device("cpu"))
    assert built.name == optimizer.split()[0]
    T = 64
    x = torch.randint(0, model.cfg.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        model(x[:, :-1], x[:, 1:]).backward()  # the rungs of the current theta are read and kept
        for block in model.blocks:
            # one direction every step: a real gradient's sign can flip and bring alpha back
            # to its start (a flaky test, not a test of the optimizers' writes)
            block.attn.theta.grad.fill_(-1.0)
        optim_module.set_lr(built.optimizer, 0.3)
        built.optimizer.step()
        built.optimizer.zero_grad()
    base = torch.tensor([float(b) for b in base_sequence(model.cfg.base, T, model.cfg.n_rungs)])
    for block in model.blocks:
        attn = block.attn
        assert float(attn.alpha.detach()) > 1.2  # theta 0 -> about 1.2: alpha 1 -> about 1.27
        cols = attn.columns(T)
        fresh = fractional_rungs((attn.alpha.detach() * base).tolist(), model.cfg.window, T)
        assert cols.lo == [lo for _, lo in fresh]
        assert ((cols.frac >= 0) & (cols.frac < 1)).all()


@needs_cuda
@pytest.mark.parametrize("schedule,impl", [(s, i) for s in ("fixed", "learned") for i in ("gather", "mask", "auto")])
def test_a_training_micro_batch_on_cuda_never_waits_for_the_gpu(schedule, impl):
    """After one warm-up step, forward and backward queue their kernels without a host-device
    synchronisation (CUDA's sync debug mode raises on one), so the host runs ahead of the GPU."""
    model = micro(schedule, impl).cuda()
    x = torch.randint(0, model.cfg.vocab_size, (2, 65), device="cuda")
    model(x[:, :-1], x[:, 1:]).backward()  # warm-up: auto measures, rungs are read
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x[:, :-1], x[:, 1:]).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_rope_tables_on_cuda_are_the_cpu_s_bit_for_bit():
    """The study built its RoPE tables on the CPU and moved them; a GPU's own cos and sin
    may differ in the last bit at long lengths."""
    cpu = rope_tables(16_384, 64, 10_000.0, "cpu")
    cuda = rope_tables(16_384, 64, 10_000.0, "cuda")
    assert all(c.device.type == "cuda" and torch.equal(c.cpu(), t) for c, t in zip(cuda, cpu))


def test_a_machine_without_glibc_or_dynamo_is_told_not_crashed(monkeypatch):
    """The CPU allocator's tuning needs glibc (musl has no mallopt: nothing to tune), and
    `--compile` needs dynamo for this Python: each absence is a decision, not a traceback."""
    from fibctl import device

    def no_glibc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(device.ctypes, "CDLL", no_glibc)
    device.keep_freed_memory()
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert device.compile_unavailable(torch.device("cpu")) == (
        f"torch {torch.__version__} has no torch.compile for Python {sys.version.split()[0]}")


def test_bench_says_which_attention_path_auto_chose_for_each_setting():
    """`bench train` on CUDA (where `auto` is the default) reports the paths `auto` measured and
    took; the same bookkeeping on the CPU: one choice per layer, named by path."""
    from fibctl import attention
    from fibctl.flows.bench import _paths_used

    cfg = dataclasses.replace(get_preset("micro").model, schedule="stagger", window=4)
    attention._chosen.clear()
    model = FibLM(cfg, impl="auto")
    assert _paths_used(model) == "auto"  # nothing measured yet
    model.choose_paths(2, cfg.seq_len, "cpu")
    used = _paths_used(model)
    counts = {impl: int(n) for impl, n in (part.split(" x") for part in used.split("; ")[0].split(", "))}
    assert set(counts) <= {"gather", "mask", "flex"} and sum(counts.values()) == cfg.n_layers, used
    assert _paths_used(FibLM(cfg, impl="gather")) == "gather"
    assert _paths_used(FibLM(dataclasses.replace(cfg, schedule="dense", window=0))) == "sdpa"


@needs_cuda
def test_on_cuda_each_timed_pass_is_timed_by_events_without_waiting_between_them(monkeypatch):
    """`eval --speed`'s spread: each pass timed by CUDA events in the stream, the host never
    waiting between the timed passes (the study's mean is of them back to back)."""
    from fibctl import metrics

    waits = []
    sync = torch.cuda.synchronize
    monkeypatch.setattr(metrics, "synchronize", lambda device: (waits.append(device), sync(device)))
    measured = metrics.inference_speed(micro("fixed").cuda(), 64, torch.device("cuda"))
    assert len(waits) == 2  # after the untimed passes, after the timed ones
    assert 0 < measured["tokens_per_s_min"] <= measured["tokens_per_s_max"]
    # the events' passes and the host's clock over them agree but for launch and wait overhead
    assert measured["tokens_per_s_min"] <= measured["tokens_per_s"] * 1.5
