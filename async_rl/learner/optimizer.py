"""The learner's optimizers and learning-rate schedule, built together.

AdamW for the policy's trained parameters (LoRA: the adapters alone) and for the GAE
critic, and one schedule on the policy's: linear warmup over
train.lr_schedule.warmup_steps, then constant, cosine or linear decay to
train.lr_schedule.min_ratio of train.lr at train.max_steps.
"""
from __future__ import annotations

import math

import torch


def adamw(params, *, lr: float, weight_decay: float, eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one pass over each parameter's state instead of
    the foreach implementation's several), on CPU and CUDA alike; the same update rule."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps, fused=True)


def lr_factor(schedule, max_steps: int, step: int) -> float:
    """Multiplier of train.lr at learner step `step` (0-based) under `schedule` (the
    train.lr_schedule section): warmup, then decay over the run's `max_steps`."""
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.name == "cosine" else 1 - progress
    return schedule.min_ratio + (1 - schedule.min_ratio) * shape


def build_optimizers(train, policy: torch.nn.Module, critic: torch.nn.Module | None):
    """(policy optimizer, its learning-rate scheduler, critic optimizer or None) for the
    `train` section."""
    trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters alone
    optimizer = adamw(trained, lr=train.lr, weight_decay=train.weight_decay, eps=train.adam_eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(train.lr_schedule, train.max_steps, step))
    critic_optimizer = None if critic is None else adamw(critic.parameters(), lr=train.advantage.critic_lr,
                                                          weight_decay=train.weight_decay, eps=train.adam_eps)
    return optimizer, scheduler, critic_optimizer
