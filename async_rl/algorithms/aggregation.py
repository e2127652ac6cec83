"""Reduce per-token losses to a scalar.

Three conventions are in use in the LLM-RL literature and they are *not*
equivalent: token-mean weights every token equally (long answers dominate),
seq-mean-token-mean weights every sequence equally (the original GRPO), and
seq-mean-token-sum is Dr.GRPO's fix for the length bias of dividing by each
sequence's own length ("Understanding R1-Zero-like training", arXiv 2503.20783).

Sequences with no response tokens take no part in the seq-* means: they have
no loss to contribute and counting them would silently shrink the loss.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.config import AGG_MODES


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {', '.join(AGG_MODES)}")


def agg_denominator(mask: torch.Tensor, agg: str) -> float:
    """What `aggregate(..., mask, agg)` divides by: response tokens for token-mean,
    non-empty sequences for the seq-* modes. May be 0.0 for an empty micro-batch.

    The learner uses it to turn micro-batch means into one global-batch mean:
    global = sum_micro(loss_micro * denom_micro) / denom_global (normalization.py).
    """
    _check_agg(agg)
    m = mask.bool()
    if agg == "token-mean":
        return float(m.sum().item())
    return float(m.any(dim=-1).sum().item())


def aggregate(loss_tokens: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Scalar loss from `[B, T]` per-token losses; padded positions are ignored
    (selected away with `torch.where`, so inf/NaN there cannot leak in).
    An all-padding batch gives 0 rather than 0/0."""
    _check_agg(agg)
    m = mask.bool()
    masked = torch.where(m, loss_tokens, torch.zeros_like(loss_tokens))
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp(min=1)
    tokens_per_seq = m.sum(dim=-1)
    per_seq = masked.sum(dim=-1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1)
    n_seqs = (tokens_per_seq > 0).sum().clamp(min=1)
    return per_seq.sum() / n_seqs
