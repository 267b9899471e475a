"""Model FLOPs per trained token, and the share of a GPU's peak a training speed reaches (MFU).

The count is PaLM's (Chowdhery et al. 2022, appendix B), which nanoGPT prints as `mfu`: matrix
multiplications only, 2 FLOPs per multiply-add, a backward pass twice the forward. Each weight
matrix (the tied head included) costs 6 FLOPs per weight per token; attention costs 12 x head_dim
per head for each (query, key) pair the layer scores. PaLM counts every key of a dense layer
(T per query); fibctl counts the pairs the model scores, which is what makes a sparse schedule's
count comparable: a dense causal layer scores (T + 1) / 2 keys per query on average, a sparse one
the distances its attended set keeps (a learned layer: the window and one interpolated row per
kept rung). What the count leaves out (norms, softmax, RoPE, a learned layer's blending of two
rows) is what no convention counts.
"""

from __future__ import annotations

import math
import os

import torch

from fibctl.errors import FibctlError
from fibctl.model import FibLM

PEAK_ENV = "FIBCTL_PEAK_TFLOPS"
PEAK_RANGE = (1e-6, 1e9)  # TFLOP/s: a megaFLOP/s up to a million H200s

# Dense bf16 tensor-core peaks from the vendors' data sheets (TFLOP/s; not the "with sparsity"
# figures). Matched in order against torch.cuda.get_device_name(): the first name it contains.
PEAK_BF16_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM (HBM3)
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX 4090", 165.2),  # with fp32 accumulation, as autocast accumulates
    ("RTX 3090", 71.0),  # idem; the study's GPU
)


def attended_pairs(per_layer: list[list[int]], seq_len: int) -> int:
    """(query, key) pairs scored in one window of `seq_len` tokens, over all layers: a distance d
    is scored by the queries at positions d and later."""
    return sum(seq_len - d for dists in per_layer for d in set(dists) if 0 <= d < seq_len)


def training_flops_per_token(model: FibLM, seq_len: int) -> float:
    """Forward and backward FLOPs per token of training `model` on windows of `seq_len` (module
    docstring), at its alphas now."""
    cfg = model.cfg
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    weights += model.embed.weight.numel()  # the tied head is a matrix multiplication; the lookup is not
    with torch.no_grad():  # a learned layer's rungs come from alpha: no graph for a count
        pairs = attended_pairs(model.attended(seq_len), seq_len)
    return 6 * weights + 12 * cfg.n_heads * cfg.head_dim * pairs / seq_len


def peak_flops(device: torch.device) -> float | None:
    """This device's peak FLOP/s in training's precision (bf16 on CUDA): FIBCTL_PEAK_TFLOPS if
    set, else the data-sheet figure for a GPU fibctl knows; None for a CPU or an unknown GPU."""
    given = os.environ.get(PEAK_ENV)
    if given is not None:
        try:
            value = float(given)
        except ValueError:
            value = math.nan
        # 1e308 made the peak infinite (MFU 0 %), 1e-320 every MFU infinite ("inf%", stored so)
        if not PEAK_RANGE[0] <= value <= PEAK_RANGE[1]:
            raise FibctlError(f"{PEAK_ENV}={given!r} must be a positive number of TFLOP/s, from "
                              f"{PEAK_RANGE[0]:g} to {PEAK_RANGE[1]:,.0f}")
        return value * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: the FLOP/s the tokens imply over the peak of `devices` devices."""
    if peak is None or not math.isfinite(tokens_per_s):
        return None
    return flops_per_token * tokens_per_s / (peak * devices)
