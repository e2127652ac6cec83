"""PPO clipped surrogate, with AReaL's decoupled objective for stale samples.

Decoupled PPO ("Boosting LLM reasoning via decoupled PPO", AReaL, arXiv 2505.24298):
the trust region is centred on the recent proximal policy pi_prox instead of the old
behavior policy that sampled the token, and the gap between the two is corrected by a
weight w_t (no gradient) that `train.correction` computes (corrections.py: by default
min(exp(logp_prox - logp_behav), 2), 0 for a masked token):

    r_t    = exp(logp - logp_prox)
    loss_t = -w_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

Naive PPO on stale data (`decoupled=false`) passes logp_behav as the anchor and w = 1.
Asymmetric eps_low/eps_high allow DAPO-style "clip-higher" (arXiv 2503.14476).
Dual clip (Ye et al., "Mastering complex control in MOBA games", arXiv 1912.09729):
for A_t < 0 the surrogate is also bounded below by dual_clip * A_t (dual_clip > 1),
so a huge ratio on a bad token cannot produce an unbounded update:

    loss_t = -w_t * max(min(r_t A_t, clip(r_t) A_t), dual_clip * A_t)      (A_t < 0)

The log-ratio is clamped to [-log_ratio_clamp, log_ratio_clamp] (default 20) before
exp, as verl's `compute_policy_loss` clamps `negative_approx_kl` to [-20, 20]
(verl/trainer/ppo/core_algos.py): one token whose probability moved by e^50 would
otherwise give a loss and gradient of that size (or inf). Outside the range the
gradient through the ratio is 0, as in verl.

A token masked by the correction (w = 0) stays in the aggregation's denominator (AReaL
divides by the count of the original loss mask), so masking scales the loss down
instead of re-weighting the kept tokens; it also keeps the learner's global
denominators, computed before any forward, exact.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.surrogate import TokenTerms, masked_mean


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_anchor: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    agg: str = "token-mean",
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token tensors are `[B, T]`; `advantages` is `[B]` (broadcast over tokens) or
    `[B, T]`; `logp_anchor` is the proximal policy's (decoupled) or the behavior
    policy's (naive); `weights` the correction's (None = 1). Returns (scalar loss with
    grad, {metric key: mean over the response tokens}); the correction's own figures
    are importance.py's."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    x = TokenTerms.of(logp, logp_anchor, advantages, mask, weights, log_ratio_clamp)
    m, adv, ratio, w = x.mask, x.advantages, x.ratio, x.weights

    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    objective = torch.minimum(surr, surr_clipped)
    dual_active = torch.zeros_like(m)
    if dual_clip is not None:
        floor = dual_clip * adv
        dual_active = m & (adv < 0) & (floor > objective)
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    loss_tokens = -w * objective
    loss = aggregate(loss_tokens, m, agg)

    with torch.no_grad():
        # The clipped branch is active (zero gradient) only where it is strictly smaller.
        clipped = m & (surr_clipped < surr)
        n = m.sum().clamp(min=1)
        stats = {
            "is/clip_frac": float(clipped.sum() / n),
            "is/clip_frac_low": float((clipped & (ratio < 1.0)).sum() / n),
            "is/clip_frac_high": float((clipped & (ratio > 1.0)).sum() / n),
            "is/dual_clip_frac": float(dual_active.sum() / n),
            "is/ratio_mean": masked_mean(ratio, m),
        }
    return loss, stats
