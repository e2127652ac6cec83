"""Critic-based advantages for classic PPO: GAE and the clipped value loss.

GAE (Schulman et al., "High-dimensional continuous control using generalized
advantage estimation", arXiv 1506.02438), per response token t with values V_t of
the state before token t is emitted:

    delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last token = 0)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                          (the critic's regression target)

Clipped value loss (PPO2 in OpenAI Baselines; studied in Andrychowicz et al.,
"What matters in on-policy RL", arXiv 2006.05990), with V_old the values the
advantages were computed from:

    V_clip = V_old + clip(V - V_old, -c, c)
    loss_t = 1/2 * max((V - R_t)^2, (V_clip - R_t)^2)
"""

from __future__ import annotations

import torch

from async_rl.algorithms.aggregation import aggregate


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both `[B, T]` and 0 on padding. Response tokens of a row
    must be contiguous (prompt, response, padding), as every batch here is."""
    m = mask.bool()
    r = token_rewards.detach()
    v = torch.where(m, values.detach().to(r.dtype), torch.zeros((), dtype=r.dtype, device=r.device))
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):  # loop over time, not over samples
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
        # Padding to the right of a response resets the recursion: V and A after the end are 0.
        next_value = torch.where(m[:, t], v[:, t], torch.zeros_like(a))
        next_adv = adv[:, t]
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    return adv, returns


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar critic loss with gradient through `values` (`[B, T]`), and {metric key:
    mean over the response tokens}; clip=None is the plain squared error."""
    m = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(m, values, zero)
    old = torch.where(m, old_values.detach().to(values.dtype), zero)
    target = torch.where(m, returns.detach().to(values.dtype), zero)
    err = (v - target).square()
    if clip is not None:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - target).square()
        # Count only real clipping: old + (v - old) can differ from v by one ulp.
        clipped = m & ((v - old).abs() > clip) & (err_clip > err)
        err = torch.maximum(err, err_clip)
    else:
        clipped = torch.zeros_like(m)
    loss = aggregate(0.5 * err, m, agg)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        stats = {"critic/clip_frac": float(clipped.sum() / n), "critic/value_mean": float(v.sum() / n)}
    return loss, stats
