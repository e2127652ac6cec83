"""Corrections between the policy that generated a response and the proximal policy.

A response was sampled by the actor's policy (behavior: its log-probs travel with the
sample) and is trained against the learner's policy at the start of the step (proximal).
The two differ by staleness and by the numbers of two engines (bf16 kernels, another
backend). Each correction below reads the token log-ratios
d_t = logp_prox_t - logp_behav_t over the response mask m_t and gives, per token, an
importance weight and whether the token stays in the gradient (`Correction`); the policy
loss (losses.py) multiplies each token's term by the weight, 0 where it is masked, and
masked tokens stay in the loss's denominator (as in AReaL's rejection sampling, SkyRL,
TRL and slime; verl's rejection sampling and AReaL's M2PO remove them), so masking
scales a step down rather than re-weighting what is left, and the learner's global
denominators, counted before any forward, stay exact. All of it is float64: the
sequence ratios are sums over up to thousands of tokens. Each token's log-ratio is
clamped to +-20 first (`correct`; verl clamps the sequence sum instead).

Notation: S = sum_t m_t d_t is the log of the sequence ratio prod_t r_t (r_t = exp(d_t));
G = S / sum_t m_t is the log of its geometric mean, the per-token mean log-ratio.

- `token`: w_t = min(r_t, C) (truncated IS), or the token masked when r_t > C
  (AReaL, "Boosting LLM reasoning via decoupled PPO", 2025: its `behav_imp_weight_cap`,
  now its token-level rejection sampling).
- `none`: w_t = 1.
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
- M2PO: the tokens with the largest d_t^2 are masked until the second moment
  M2 = mean over the kept tokens of d_t^2 is below tau; a kept token is weighted by its
  ratio r_t, as AReaL applies its behavior importance weight after the mask (Zheng et
  al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
  LLMs?", 2025, arXiv:2510.01161, in AReaL's masking form: its `m2_threshold`). Chosen
  per micro-batch, as AReaL does: each micro-batch's kept tokens have M2 < tau, hence
  so do the batch's.
- KL rejection: a token (or a response, by its tokens' mean) is masked when a k1 or k3
  estimate of KL(behavior || proximal) exceeds a threshold, with k1_t = -d_t and
  k3_t = r_t - 1 - d_t (Schulman's estimators with samples from the behavior policy;
  verl's `rollout_rs="token_k1"`, `"seq_mean_k3"`, ...). k1 can be negative: a
  response is bounded on both sides, |mean k1| <= threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from async_rl.algorithms.config import CorrectionConfig


class Correction(NamedTuple):
    weights: torch.Tensor  # [B, T] float64: each token's weight as applied; 0 where masked and off the response
    keep: torch.Tensor  # [B, T] bool: the response tokens that stay in the gradient
    truncated: torch.Tensor  # [B, T] bool: the kept tokens whose weight was cut to a cap


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


def _kept(keep: torch.Tensor) -> Correction:
    """Weight 1 on the kept tokens, nothing truncated."""
    return Correction(keep.double(), keep, torch.zeros_like(keep))


def _kept_at_ratio(keep: torch.Tensor, log_ratio: torch.Tensor) -> Correction:
    """Weight r_t on the kept tokens, nothing truncated."""
    return Correction(torch.where(keep, torch.exp(log_ratio.double()), 0.0), keep, torch.zeros_like(keep))


def no_correction(log_ratio: torch.Tensor, mask: torch.Tensor) -> Correction:
    return _kept(mask.bool())


def token_is(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, mode: str = "truncate") -> Correction:
    """Each token weighted min(r_t, cap) (`truncate`), or masked when r_t > cap (`mask`)."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = mask.bool()
    d = log_ratio.double()
    over = m & (d > math.log(cap))
    if mode == "truncate":
        return Correction(torch.where(m, torch.exp(d.clamp(max=math.log(cap))), 0.0), m, over)
    if mode == "mask":
        keep = m & ~over
        return _kept_at_ratio(keep, d)
    raise ValueError(f"unknown mode {mode!r}; expected truncate or mask")


def truncated_sequence_is(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float) -> Correction:
    """Every token of a response weighted min(exp(S), cap); all response tokens kept."""
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = mask.bool()
    # exp(min(S, log cap)) equals min(exp(S), cap) and cannot overflow however long S's sum.
    log_weight = sequence_log_ratio(log_ratio, mask)
    weight = torch.exp(log_weight.clamp(max=math.log(cap)))
    return Correction(torch.where(m, _per_token(weight, m), 0.0), m, m & _per_token(log_weight > math.log(cap), m))


def sequence_mask(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float,
                  weight: str = "one") -> Correction:
    """A response kept only if low <= exp(S) <= high, weighted 1 (verl, SkyRL) or, with
    weight `ratio`, exp(S) on each of its tokens (TRL's `sequence_mask`: at most `high`)."""
    m = mask.bool()
    log_weight = sequence_log_ratio(log_ratio, mask)
    keep = m & _per_token(_within(log_weight, low, high), m)
    if weight == "one":
        return _kept(keep)
    if weight == "ratio":
        return Correction(torch.where(keep, _per_token(torch.exp(log_weight.clamp(max=math.log(high))), m), 0.0),
                          keep, torch.zeros_like(keep))
    raise ValueError(f"unknown weight {weight!r}; expected one or ratio")


def geometric_mask(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """A response kept (weight 1) only if low <= exp(G) <= high."""
    m = mask.bool()
    return _kept(m & _per_token(_within(geometric_log_ratio(log_ratio, mask), low, high), m))


def icepop(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> Correction:
    """A token kept, weighted by its ratio r_t, only if low <= r_t <= high."""
    d = log_ratio.double()
    keep = mask.bool() & _within(d, low, high)
    return _kept_at_ratio(keep, d)


def m2po(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> Correction:
    """Mask the tokens with the largest d_t^2 until the kept tokens' mean d_t^2 < threshold
    (strictly, as AReaL's `_get_m2po_loss_mask`), and weight the kept ones by r_t. If even
    the smallest is not under it, none is kept (AReaL keeps that one token)."""
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    m = mask.bool()
    squared = log_ratio.double().square()[m]
    order = torch.argsort(squared)  # ascending: the kept tokens are a prefix of it
    prefix_mean = torch.cumsum(squared[order], 0) / torch.arange(1, squared.numel() + 1, dtype=torch.float64)
    # The prefix mean never decreases, so the kept prefix is every position where it is in bounds.
    kept = int((prefix_mean < threshold).sum())
    flat_keep = torch.zeros_like(squared, dtype=torch.bool)
    flat_keep[order[:kept]] = True
    keep = torch.zeros_like(m)
    keep[m] = flat_keep
    return _kept_at_ratio(keep, log_ratio)


def kl_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, estimator: str, level: str,
                 threshold: float, weight: str = "one") -> Correction:
    """Mask tokens (level `token`) or responses (`sequence`, their tokens' mean) whose
    estimate of KL(behavior || proximal) exceeds `threshold`; k1 is bounded on both sides.
    A kept token weighs 1 (verl), or with weight `ratio` its r_t (AReaL)."""
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    m = mask.bool()
    d = torch.where(m, log_ratio.double(), 0.0)
    if estimator == "k1":
        estimate = -d
    elif estimator == "k3":
        estimate = torch.expm1(d) - d
    else:
        raise ValueError(f"unknown estimator {estimator!r}; expected k1 or k3")
    if level == "sequence":
        estimate = _per_token(estimate.sum(-1) / m.sum(-1).clamp(min=1), m)
    elif level != "token":
        raise ValueError(f"unknown level {level!r}; expected token or sequence")
    bounded = estimate.abs() if estimator == "k1" else estimate
    keep = m & (bounded <= threshold)
    if weight == "one":
        return _kept(keep)
    if weight == "ratio":
        return _kept_at_ratio(keep, d)
    raise ValueError(f"unknown weight {weight!r}; expected one or ratio")


def masked_shares(correction: Correction, mask: torch.Tensor) -> tuple[float, float]:
    """(share of response tokens masked, share of non-empty responses with any token masked)."""
    m = mask.bool()
    dropped = m & ~correction.keep
    tokens = max(int(m.sum()), 1)
    responses = max(int(m.any(dim=-1).sum()), 1)
    return int(dropped.sum()) / tokens, int(dropped.any(dim=-1).sum()) / responses


# Token log-ratios are clamped to +-this first, as verl's SAFETY_BOUND: one token the two
# engines disagree on by e^50 must not make every weight of its response inf or 0.
LOG_RATIO_BOUND = 20.0

# train.correction.name -> the rule, given the section; a test keeps it in step with the config's variants.
CORRECTIONS: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], Correction]] = {
    "token": lambda c, d, m: token_is(d, m, c.cap, c.mode),
    "none": lambda c, d, m: no_correction(d, m),
    "sequence_is": lambda c, d, m: truncated_sequence_is(d, m, c.cap),
    "sequence_mask": lambda c, d, m: sequence_mask(d, m, c.low, c.high, c.weight),
    "geometric_mask": lambda c, d, m: geometric_mask(d, m, c.low, c.high),
    "icepop": lambda c, d, m: icepop(d, m, c.low, c.high),
    "m2po": lambda c, d, m: m2po(d, m, c.threshold),
    "kl_reject": lambda c, d, m: kl_rejection(d, m, c.estimator, c.level, c.threshold, c.weight),
}


def correct(config: CorrectionConfig, logp_prox: torch.Tensor, logp_behav: torch.Tensor,
            mask: torch.Tensor) -> Correction:
    """`train.correction`'s weights and mask for one micro-batch `[B, T]`."""
    m = mask.bool()
    log_ratio = torch.where(m, logp_prox.detach().double() - logp_behav.detach().double(), 0.0)
    return CORRECTIONS[config.name](config, log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), m)
