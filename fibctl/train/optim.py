"""The optimizer of the recipe (SPEC section 4): AdamW, weight decay on 2+-dim tensors only,
linear warm-up then cosine decay to `min_lr_ratio` of the peak at the last step."""

from __future__ import annotations

import math

import torch

from fibctl.config import TrainConfig


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of step `step` (steps count from 1)."""
    if step <= tc.warmup_steps:
        return tc.lr * step / tc.warmup_steps
    floor = tc.lr * tc.min_lr_ratio
    span = tc.steps - tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / span) if span > 0 else 1.0
    return floor + (tc.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear weights, the tied embedding) decay; norm scales and theta do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    # lr is set before every step from lr_at; the value here is only the initial one
    return torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=lr_at(1, tc),
                             betas=(tc.beta1, tc.beta2))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
