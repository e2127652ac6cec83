"""The learning-rate schedule: linear warmup over train.warmup_steps, then constant,
cosine or linear decay to train.lr_min_ratio of train.lr at train.max_steps."""
from __future__ import annotations

import math


def lr_factor(cfg, step: int) -> float:
    """Multiplier of train.lr at learner step `step` (0-based): warmup, then decay."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
    return t.lr_min_ratio + (1 - t.lr_min_ratio) * shape
