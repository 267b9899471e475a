"""The optimizer of the recipe (docs/method.md, "Training"): AdamW with betas (0.9, 0.95) and
eps 1e-8, weight decay on 2+-dim tensors only, linear warm-up then cosine decay to
`min_lr_ratio` of the peak at the last step.

`adamw8bit` is bitsandbytes' 8-bit AdamW, which the study's published runs used; it needs CUDA
and the `gpu` extra. Where it cannot run, `build_optimizer` falls back to torch's AdamW and
says so, and the caller records the optimizer actually used on the run.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass

import torch

from fibctl.config import TrainConfig
from fibctl.model import FibLM

EPS = 1e-8


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of step `step` (steps count from 1)."""
    # the warm-up's last step is the cosine's first, as in the study: lr * 1.0 is the peak
    # exactly, where lr * step / step may not be (3e-3 * 3 / 3 is 0.0030000000000000005)
    if step < tc.warmup_steps:
        return tc.lr * step / tc.warmup_steps
    # at most 1 past the last step (bench); a run that ends with its warm-up ends at the peak
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
    # the study's expression, operation for operation: another grouping of the same value
    # (floor + (peak - floor) * ...) differs in the last bit at about half the steps
    r = tc.min_lr_ratio
    return tc.lr * (r + (1 - r) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, the tied embedding) decay; norm scales and theta do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def marks_writes(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer`, made to bump the version of every weight after each step. torch's fused
    AdamW and bitsandbytes' kernels write the weights in place without doing so, and a
    learned layer reads its rungs again only when theta's version changes
    (fibctl.model.Attention._rungs): else lo would stay where alpha began."""

    def bump(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                torch.autograd.graph.increment_version(p)

    optimizer.register_step_post_hook(bump)
    return optimizer


@dataclass
class BuiltOptimizer:
    optimizer: torch.optim.Optimizer
    name: str  # the optimizer actually used: one of config.OPTIMIZERS
    warning: str | None  # why it differs from the one the run asked for
    fused: bool = False  # torch's AdamW in one fused CUDA kernel: the same update, fewer launches


def adamw_kwargs(device: torch.device) -> dict:
    """torch.optim.AdamW's `fused=True` on CUDA where this torch has it; nothing elsewhere (its
    CPU kernel is not the default path, and the CPU tests pin that path)."""
    if device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        return {"fused": True}
    return {}


def eight_bit_unavailable(device: torch.device) -> str | None:
    """Why bitsandbytes' 8-bit AdamW cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"it needs CUDA and this run trains on {device.type}"
    try:
        importlib.import_module("bitsandbytes")
    except Exception as e:  # ImportError, or a broken CUDA setup raising at import
        return f"bitsandbytes is not importable ({type(e).__name__}); install it with pip install -e '.[gpu]'"
    return None


def build_optimizer(model: torch.nn.Module, tc: TrainConfig,
                    device: torch.device = torch.device("cpu")) -> BuiltOptimizer:
    # lr is set before every step from lr_at; the value here is only the initial one
    groups, lr, betas = param_groups(model, tc.weight_decay), lr_at(1, tc), (tc.beta1, tc.beta2)
    warning = None
    if tc.optimizer == "adamw8bit":
        why = eight_bit_unavailable(device)
        if why is None:
            bnb = importlib.import_module("bitsandbytes")
            return BuiltOptimizer(marks_writes(bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=EPS)),
                                  "adamw8bit", None)
        warning = f"optimizer adamw8bit unavailable: {why}; training with adamw (full-precision state) instead"
    extra = adamw_kwargs(device)
    # fused or not, the state is the same: a checkpoint resumes on either device
    return BuiltOptimizer(marks_writes(torch.optim.AdamW(groups, lr=lr, betas=betas, eps=EPS, **extra)), "adamw",
                          warning, fused=bool(extra))


def gradient_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The total 2-norm of the gradients of `params`, summed in their order, as
    clip_grad_norm_ computes it (torch.nn.utils.get_total_norm, torch 2.6+)."""
    grads = [p.grad for p in params if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    # torch 2.4 and 2.5: clip_grad_norm_'s own sum, the per-tensor norms stacked in order
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def clip_gradients(model: FibLM, bound: float) -> torch.Tensor:
    """The gradient norm before clipping, the gradients scaled to at most `bound`, as the
    study's loop clipped: torch's clip_grad_norm_ with its defaults (foreach on CUDA and on
    the CPU alike), over the parameters in the study's order (FibLM.study_order).

    An infinite bound (grad_clip 0, the probe's recipe) only measures: the study's probe
    never clipped, and clip_grad_norm_ would scale every gradient by inf / inf = NaN when
    the norm is not finite, where the probe left the finite ones as they were."""
    if math.isinf(bound):
        return gradient_norm(model.study_order())
    return torch.nn.utils.clip_grad_norm_(model.study_order(), bound)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
