"""PPO-clip with the `token` correction, composed as the learner composes them
(corrections.correct with `token`, then ppo.ppo_clip_loss), in the call shape the PPO references
take: the tests of decoupled and naive PPO read one function."""

from __future__ import annotations

import torch

from async_rl.algorithms.config import TokenCorrection
from async_rl.algorithms.corrections import correct
from async_rl.algorithms.ppo import ppo_clip_loss


def ppo_with_token_is(logp, prox, behav, adv, mask, *, is_cap: float = 2.0, is_mode: str = "truncate",
                      decoupled: bool = True, **ppo) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss, PPO's stats plus `is/capped_frac`: the tokens truncated or masked by the cap,
    and `is/weight_mean`: the weights as applied)."""
    m = mask.bool()
    n = max(int(m.sum()), 1)
    if not decoupled:
        loss, stats = ppo_clip_loss(logp, behav, adv, mask, **ppo)
        return loss, {**stats, "is/capped_frac": 0.0, "is/weight_mean": 1.0 if m.any() else 0.0}
    correction = correct(TokenCorrection.model_construct(cap=is_cap, mode=is_mode), prox, behav, mask)
    loss, stats = ppo_clip_loss(logp, prox, adv, mask, weights=correction.weights, **ppo)
    capped = (m & (correction.truncated | ~correction.keep)).sum()
    return loss, {**stats, "is/capped_frac": float(capped) / n,
                  "is/weight_mean": float(torch.where(m, correction.weights, 0.0).sum()) / n}
