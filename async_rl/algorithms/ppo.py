"""PPO clipped surrogate, with AReaL's decoupled objective for stale samples.

Decoupled PPO ("Boosting LLM reasoning via decoupled PPO", AReaL, arXiv 2505.24298):
samples from an old behavior policy are corrected by an importance weight
w = pi_prox / pi_behav (truncated at `is_cap`, no gradient), while the trust
region is centred on the recent proximal policy pi_prox instead of pi_behav:

    r_t    = exp(logp - logp_prox)
    w_t    = min(exp(logp_prox - logp_behav), is_cap)          (detached)
    loss_t = -w_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t)

decoupled=False is naive PPO on stale data: r_t = exp(logp - logp_behav), w_t = 1.
Asymmetric eps_low/eps_high allow DAPO-style "clip-higher" (arXiv 2503.14476).
Dual clip (Ye et al., "Mastering complex control in MOBA games", arXiv 1912.09729):
for A_t < 0 the surrogate is also bounded below by dual_clip * A_t (dual_clip > 1),
so a huge ratio on a bad token cannot produce an unbounded update:

    loss_t = -w_t * max(min(r_t A_t, clip(r_t) A_t), dual_clip * A_t)      (A_t < 0)

Both log-ratios are clamped to [-log_ratio_clamp, log_ratio_clamp] (default 20) before
exp, as verl's `compute_policy_loss` clamps `negative_approx_kl` to [-20, 20]
(verl/trainer/ppo/core_algos.py): one token whose probability moved by e^50 would
otherwise give a loss and gradient of that size (or inf). Outside the range the
gradient through the ratio is 0, as in verl.

is_mode="mask" drops tokens whose raw weight exceeds is_cap instead of truncating
it (w_t = 0), AReaL's `behav_imp_weight_cap` (areal/utils/functional.py
`ppo_actor_loss_fn`). As there, dropped tokens stay in the normalization
denominator (AReaL divides by the count of the original loss mask), so dropping
scales the loss down instead of re-weighting the kept tokens; it also keeps the
learner's global denominators, computed before any forward, exact.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.config import IS_MODES


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1))


def ppo_clip_loss(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    is_cap: float = 2.0,
    decoupled: bool = True,
    agg: str = "token-mean",
    dual_clip: float | None = None,
    is_mode: str = "truncate",
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token tensors are `[B, T]`; `advantages` is `[B]` (broadcast over tokens)
    or `[B, T]`. Returns (scalar loss with grad, {metric key: mean over the response
    tokens}); the importance weights' ESS and mismatch KL, which do not depend on the
    loss, are importance.py's."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {is_mode!r}; expected one of {', '.join(IS_MODES)}")
    if log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp}")
    m = mask.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    # Replace padding *before* any exp: torch.where after the fact would still
    # back-propagate 0 * inf = NaN through garbage positions.
    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.to(dtype), zero)

    logp = clean(logp)
    logp_prox = clean(logp_prox.detach())
    logp_behav = clean(logp_behav.detach())
    adv = advantages.detach().to(dtype)
    adv = clean(adv[:, None].expand_as(logp) if adv.dim() == 1 else adv)

    def exp_clamped(log_ratio: torch.Tensor) -> torch.Tensor:
        return torch.exp(log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp))

    if decoupled:
        ratio = exp_clamped(logp - logp_prox)
        raw_w = exp_clamped(logp_prox - logp_behav)
        w = torch.where(raw_w > is_cap, zero, raw_w) if is_mode == "mask" else raw_w.clamp(max=is_cap)
    else:
        ratio = exp_clamped(logp - logp_behav)
        raw_w = w = torch.ones_like(ratio)

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
            # Truncated tokens under is_mode="truncate", dropped ones under "mask".
            "is/capped_frac": float((m & (raw_w > is_cap)).sum() / n),
            "is/weight_mean": _masked_mean(w, m),  # the weights applied: after the cap, 0 where dropped
            "is/ratio_mean": _masked_mean(ratio, m),
        }
    return loss, stats
