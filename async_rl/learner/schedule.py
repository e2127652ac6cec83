"""The learning-rate schedule: linear warmup over train.lr_schedule.warmup_steps, then
constant, cosine or linear decay to train.lr_schedule.min_ratio of train.lr at
train.max_steps."""
from __future__ import annotations

import math


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
