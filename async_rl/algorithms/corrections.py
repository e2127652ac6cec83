"""Corrections between the policy that generated a response and the proximal policy.

A response was sampled by the actor's policy (behavior: its log-probs travel with the
sample) and is trained against the learner's policy at the start of the step (proximal).
The two differ by staleness and by the numbers of two engines (bf16 kernels, another
backend). Each correction below reads the token log-ratios
d_t = logp_prox_t - logp_behav_t over the response mask m_t and gives, per token, an
importance weight and whether the token stays in the gradient (`Correction`). All of it
is float64: the sequence ratios are sums over up to thousands of tokens.

Notation: S = sum_t m_t d_t is the log of the sequence ratio prod_t r_t (r_t = exp(d_t));
G = S / sum_t m_t is the log of its geometric mean, the per-token mean log-ratio.

- Sequence-level truncated IS: every token of a response weighted min(exp(S), C).
  The off-policy policy gradient with a product of ratios, truncated to bound its
  variance (Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse from
  the Training-Inference Mismatch", 2025; verl's `rollout_is="sequence"`).
- Sequence-level masking: a response is dropped unless lo <= exp(S) <= hi (the same
  source's rejection sampling, verl's `rollout_rs="sequence"`).
- Geometric-mean sequence mask: a response is dropped unless lo <= exp(G) <= hi. Its
  bounds do not move with the response's length, so they can be tight (the same source;
  verl's `rollout_rs="geometric"`; SkyRL's default off-policy correction).
- IcePop: a token whose ratio r_t leaves [lo, hi] is masked out of the gradient; one
  inside is weighted by r_t (Ling Team, "Every Step Evolves: Scaling Reinforcement
  Learning for Trillion-Scale Thinking Model", 2025, arXiv:2510.18855).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Correction(NamedTuple):
    weights: torch.Tensor  # [B, T] float64: each response token's importance weight; 0 off the response
    keep: torch.Tensor  # [B, T] bool: the response tokens that stay in the gradient


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """S per response `[B]`: the sum of its tokens' log-ratios."""
    return torch.where(mask.bool(), log_ratio.double(), 0.0).sum(dim=-1)


def geometric_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G per response `[B]`: the mean of its tokens' log-ratios (0 for an empty response)."""
    return sequence_log_ratio(log_ratio, mask) / mask.sum(dim=-1).clamp(min=1).double()


def _per_token(per_response: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_response.unsqueeze(-1).expand(mask.shape)


def _within(log_value: torch.Tensor, low: float, high: float) -> torch.Tensor:
    if not 0 < low <= high:
        raise ValueError(f"bounds must satisfy 0 < low <= high, got [{low}, {high}]")
    return (log_value >= math.log(low)) & (log_value <= math.log(high))


def truncated_sequence_is(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> Correction:
    """Every token of a response weighted min(exp(S), cap); all response tokens kept."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = mask.bool()
    # exp(min(S, log cap)) equals min(exp(S), cap) and cannot overflow however long S's sum.
    weight = torch.exp(sequence_log_ratio(log_ratio, mask).clamp(max=math.log(cap)))
    return Correction(torch.where(m, _per_token(weight, m), 0.0), m)


def sequence_mask(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """A response kept (weight 1) only if low <= exp(S) <= high."""
    m = mask.bool()
    keep = m & _per_token(_within(sequence_log_ratio(log_ratio, mask), low, high), m)
    return Correction(keep.double(), keep)


def geometric_mask(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """A response kept (weight 1) only if low <= exp(G) <= high."""
    m = mask.bool()
    keep = m & _per_token(_within(geometric_log_ratio(log_ratio, mask), low, high), m)
    return Correction(keep.double(), keep)


def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """A token kept, weighted by its ratio r_t, only if low <= r_t <= high."""
    d = log_ratio.double()
    keep = mask.bool() & _within(d, low, high)
    return Correction(torch.where(keep, torch.exp(d), 0.0), keep)


def masked_shares(correction: Correction, mask: torch.Tensor) -> tuple[float, float]:
    """(share of response tokens masked, share of non-empty responses with any token masked)."""
    m = mask.bool()
    dropped = m & ~correction.keep
    tokens = max(int(m.sum()), 1)
    responses = max(int(m.any(dim=-1).sum()), 1)
    return int(dropped.sum()) / tokens, int(dropped.any(dim=-1).sum()) / responses
