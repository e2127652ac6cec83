"""GSPO: PPO's clip on a sequence-level ratio (Zheng et al., "Group Sequence Policy
Optimization", Qwen team, 2025, arXiv:2507.18071).

Each response's ratio is the length-normalized product of its token ratios to the
proximal policy, s_i = exp((1/|y_i|) sum_t (logp_t - logp_prox_t)), clipped as a whole:
a response moves together or not at all. In the token form of the paper (GSPO-token),
which accepts per-token advantages and whose gradient equals GSPO's when the advantage
is the response's,

    s_it   = sg[s_i] * pi_t / sg[pi_t]                (value s_i, gradient of log pi_t)
    loss_t = -w_t * min(s_it * A_t, clip(s_it, 1 - eps_low, 1 + eps_high) * A_t)

aggregated as a mean over responses of their token means (the paper's 1/|y_i|
normalization; verl's GSPO uses `seq-mean-token-mean` too), whatever `train.agg` says.
The ranges are small because s_i is a per-token geometric mean: the paper's 3e-4 and
4e-4. w_t is `train.correction`'s weight; the sequence ratio is taken over the tokens
the correction keeps (a masked token's ratio is the one not to trust). The log of s_it
is clamped to +-log_ratio_clamp (10) before exp; verl clamps it above at 10.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.surrogate import TokenTerms

AGG = "seq-mean-token-mean"


def gspo_loss(logp: torch.Tensor, logp_prox: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              weights: torch.Tensor | None = None, keep: torch.Tensor | None = None, eps_low: float = 3e-4,
              eps_high: float = 4e-4, log_ratio_clamp: float = 10.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token tensors are `[B, T]`, `advantages` `[B]` or `[B, T]`; `keep` the tokens the
    correction keeps (None = every response token). Returns (scalar loss with grad,
    {metric key: mean over the response tokens})."""
    x = TokenTerms.of(logp, logp_prox, advantages, mask, weights, log_ratio_clamp)
    m = x.mask
    kept = m if keep is None else m & keep.bool()
    token_log_ratio = x.logp - logp_prox.detach().to(x.logp.dtype)
    sequence = (torch.where(kept, token_log_ratio, 0.0).sum(-1) / kept.sum(-1).clamp(min=1)).detach()
    log_s = (x.logp - x.logp.detach() + sequence[:, None]).clamp(-log_ratio_clamp, log_ratio_clamp)
    s = torch.exp(log_s)
    surr = s * x.advantages
    surr_clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high) * x.advantages
    loss = aggregate(-x.weights * torch.minimum(surr, surr_clipped), m, AGG)
    with torch.no_grad():
        clipped = m & (surr_clipped < surr)
        n = m.sum().clamp(min=1)
        stats = {"is/clip_frac": float(clipped.sum() / n),
                 "is/clip_frac_low": float((clipped & (s < 1.0)).sum() / n),
                 "is/clip_frac_high": float((clipped & (s > 1.0)).sum() / n),
                 "is/dual_clip_frac": 0.0,
                 "is/ratio_mean": float(torch.where(m, s, 0.0).sum() / n)}
    return loss, stats
