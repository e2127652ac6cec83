"""CISPO: the clipped ratio as a stop-gradient weight on the log-probability (MiniMax,
"MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", 2025,
arXiv:2506.13585, section 3.1).

PPO's clip zeroes the gradient of a token whose ratio left the trust region, and the
rare tokens that carry a reasoning turn ("However", "Recheck") are the ones that leave
it first. CISPO keeps every token's gradient and bounds its weight instead:

    r_t    = exp(logp_t - logp_prox_t)
    loss_t = -w_t * sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * logp_t

(the paper sets no lower bound: eps_low = null; eps_high = 4, a cap of 5, is ScaleRL's
and SkyRL's), aggregated by `train.agg` (the paper's is a token mean). w_t is
`train.correction`'s weight. With one optimizer step per batch r_t = 1 and CISPO is
REINFORCE with the correction's weights.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.surrogate import TokenTerms


def cispo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
               weights: torch.Tensor | None = None, eps_low: float | None = None, eps_high: float = 4.0,
               agg: str = "token-mean", log_ratio_clamp: float = 20.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token tensors are `[B, T]`, `advantages` `[B]` or `[B, T]`. Returns (scalar loss
    with grad, {metric key: mean over the response tokens})."""
    x = TokenTerms.of(logp, logp_prox, advantages, mask, weights, log_ratio_clamp)
    m, ratio = x.mask, x.ratio.detach()
    low = None if eps_low is None else 1.0 - eps_low
    clipped_ratio = ratio.clamp(min=low, max=1.0 + eps_high)
    loss = aggregate(-x.weights * clipped_ratio * x.advantages * x.logp, m, agg)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        low_hit = m & (ratio < low) if low is not None else torch.zeros_like(m)
        high_hit = m & (ratio > 1.0 + eps_high)
        stats = {"is/clip_frac": float((low_hit | high_hit).sum() / n),
                 "is/clip_frac_low": float(low_hit.sum() / n),
                 "is/clip_frac_high": float(high_hit.sum() / n),
                 "is/dual_clip_frac": 0.0,
                 "is/ratio_mean": float(torch.where(m, ratio, 0.0).sum() / n)}
    return loss, stats
