"""Per-token entropy of the policy's next-token distribution, H = -sum_v p_v log p_v.

Used as a diagnostic every step (a collapsing entropy warns of a policy that stopped
exploring) and, with train.entropy_coef > 0, as a bonus in the loss (Williams &
Peng 1991; Mnih et al., A3C, arXiv 1602.01783).
"""

from __future__ import annotations

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`[..., V]` logits -> `[...]` entropies in nats; differentiable."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    # Tokens with zero probability contribute 0. Replace their -inf *before* the
    # product: masking 0 * -inf afterwards would still send NaN through the backward.
    safe_logp = torch.where(logp.isfinite(), logp, torch.zeros_like(logp))
    return -(logp.exp() * safe_logp).sum(dim=-1)
