"""What the token-level policy losses (PPO-clip, GSPO, CISPO) start from: one
micro-batch's tensors made safe to exponentiate, in one dtype.

Padding is replaced *before* any exp: torch.where after the fact would still
back-propagate 0 * inf = NaN through garbage positions. The ratio's log is clamped to
+-log_ratio_clamp before exp (verl clamps to 20): one token whose probability moved by
e^50 would otherwise give a loss and gradient of that size, or inf.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1))


class TokenTerms(NamedTuple):
    mask: torch.Tensor  # [B, T] bool
    logp: torch.Tensor  # with grad; 0 off the response
    log_ratio: torch.Tensor  # logp - logp_anchor, clamped; 0 off the response
    ratio: torch.Tensor  # exp(log_ratio), with grad
    advantages: torch.Tensor  # [B, T], detached
    weights: torch.Tensor  # [B, T] the correction's weights, detached (1 when none)

    @classmethod
    def of(cls, logp: torch.Tensor, logp_anchor: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
           weights: torch.Tensor | None, log_ratio_clamp: float) -> TokenTerms:
        if log_ratio_clamp <= 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp}")
        m = mask.bool()
        dtype = torch.promote_types(logp.dtype, torch.float32)
        zero = torch.zeros((), dtype=dtype, device=logp.device)

        def clean(x: torch.Tensor) -> torch.Tensor:
            return torch.where(m, x.to(dtype), zero)

        logp = clean(logp)
        log_ratio = (logp - clean(logp_anchor.detach())).clamp(-log_ratio_clamp, log_ratio_clamp)
        adv = advantages.detach().to(dtype)
        adv = clean(adv[:, None].expand_as(logp) if adv.dim() == 1 else adv)
        w = torch.ones_like(logp) if weights is None else clean(weights.detach())
        return cls(m, logp, log_ratio, torch.exp(log_ratio), adv, w)
