"""Responses cut at the length limit (DAPO, arXiv 2503.14476, section 3.4).

A truncated response gets a reward for an answer it never finished (usually 0), which
teaches the policy that reasoning at length is wrong rather than that it was cut.
DAPO offers two remedies, both keyed on the per-sample `truncated` flag the actors
send or on the response length:
- overlong filtering: truncated samples get no loss;
- soft overlong punishment: with L_max the length limit and L_cache a buffer,
  R_length(y) = 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to
  L_max, added to the task reward (scaled here by `penalty`, DAPO uses 1).
"""
from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """Per-sample reward term `[B]`: 0 up to `max_len - buffer` tokens, then falling
    linearly to `-penalty` at `max_len` (DAPO's soft overlong punishment)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer


def overlong_filter(loss_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """`loss_mask` `[B, T]` with the rows of truncated samples zeroed (DAPO's overlong filtering)."""
    return loss_mask * (1 - truncated.to(loss_mask.dtype))[:, None]
