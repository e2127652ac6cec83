"""Per-token entropy of the policy's next-token distribution, H = -sum_v p_v log p_v.

Used as a diagnostic every step (a collapsing entropy warns of a policy that stopped
exploring) and, with train.entropy_coef > 0, as a bonus in the loss (Williams &
Peng 1991; Mnih et al., A3C, arXiv 1602.01783).
"""

from __future__ import annotations

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`[..., V]` logits -> `[...]` entropies in nats; differentiable."""
    return entropy_of_logp(torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1))


def entropy_of_logp(logp: torch.Tensor) -> torch.Tensor:
    """`[..., V]` log-probabilities (a log_softmax the caller already has) -> `[...]`
    entropies; differentiable. Tokens with zero probability contribute 0: their -inf is
    clamped to the dtype's lowest finite value before the product, so neither 0 * -inf
    nor its backward makes a NaN (the clamp's gradient there is 0, and so is p's)."""
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(dim=-1)
