"""The model: published parameter counts, length-free weights, chunked long-sequence loss."""

import dataclasses
import re

import pytest
import torch

from fibctl.config import BASES, SCHEDULES, ConfigError, ModelConfig, get_preset
from fibctl.model import FibLM

torch.set_num_threads(1)


def paper(schedule):
    return dataclasses.replace(get_preset("paper").model, schedule=schedule)


@pytest.mark.parametrize("schedule,total", [("fixed", 60_850_688), ("stagger", 60_850_688),
                                            ("dense", 60_850_688), ("learned", 60_850_704)])
def test_paper_parameter_counts(schedule, total):
    counts = FibLM(paper(schedule)).param_counts()
    assert counts["total"] == total
    assert counts["non_embedding"] == total - 16_777_216


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("base", BASES)
def test_weights_saved_at_one_length_load_at_another(schedule, base, tmp_path):
    cfg = dataclasses.replace(get_preset("micro").model, schedule=schedule, base=base, seq_len=64)
    torch.manual_seed(0)
    model = FibLM(cfg)
    if schedule == "learned":
        with torch.no_grad():
            for b in model.blocks:
                b.attn.theta.fill_(0.3)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    long = FibLM(cfg.with_length(256))
    long.load_state_dict(torch.load(tmp_path / "w.pt"))  # strict: same keys, no length tensors
    assert long.alphas() == model.alphas()
    idx = torch.randint(0, cfg.vocab_size, (1, 256))
    if base == "fib":  # pow2 gains rungs at the longer length: a different function by design
        with torch.no_grad():
            torch.testing.assert_close(long(idx)[:, :64], model(idx[:, :64]))
    assert all("rope" not in k and "alpha" not in k for k in model.state_dict())


def test_token_losses_match_full_logits_and_chunking(monkeypatch):
    cfg = dataclasses.replace(get_preset("micro").model, schedule="stagger")
    model = FibLM(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 300))
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(idx[:, :-1]).transpose(1, 2), idx[:, 1:], reduction="none")
        monkeypatch.setattr("fibctl.model.LOSS_TOKENS", 128)
        monkeypatch.setattr("fibctl.attention.GATHER_CHUNK", 50)
        chunked = model.token_losses(idx[:, :-1], idx[:, 1:])
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    assert model(idx[:, :-1], idx[:, 1:]).item() == pytest.approx(full.mean().item(), rel=1e-5)


def test_a_float64_models_loss_is_the_float64_cross_entropy_of_its_logits():
    """As the study's code computed it in float64 (its autocast's float32 loss is a widening,
    never a narrowing): the float64 tests hold fibctl's trainer to the study's loop there, and
    a loss of float32-rounded logits put 6 steps' losses up to 8e-7 apart."""
    torch.manual_seed(0)
    model = FibLM(get_preset("micro").model).double()
    tokens = torch.randint(0, 512, (2, 65))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        logits = model(x)
        loss, per_token = model(x, y), model.token_losses(x, y)
    assert loss.dtype == per_token.dtype == torch.float64
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    assert torch.equal(per_token, torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none"))


def test_sparse_model_evaluates_far_past_training_length():
    """A long sequence in chunks: memory linear in length (the figure for 65,536 is in the README)."""
    cfg = dataclasses.replace(get_preset("micro").model, schedule="fixed")
    model = FibLM(cfg.with_length(8192)).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 8193))
    with torch.no_grad():
        losses = model.token_losses(idx[:, :-1], idx[:, 1:])
    assert losses.shape == (1, 8192) and torch.isfinite(losses).all()


@pytest.mark.parametrize("change,needle", [
    (dict(schedule="sliding"), "unknown schedule 'sliding'; allowed: dense, fixed"),
    (dict(base="fib3"), "unknown base 'fib3' (did you mean 'fib'?); allowed: fib, pow2"),
    (dict(window=-1), "window W=-1 must be >= 0"),
    (dict(n_heads=5), "n_heads=5 does not divide d_model=64"),
    (dict(n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=4"),
])
def test_bad_config_names_the_value(change, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        dataclasses.replace(ModelConfig(d_model=64, n_heads=4), **change).validate()
