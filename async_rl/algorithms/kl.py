"""Per-token KL estimators (J. Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html).

With x sampled from the current policy and d = logp - logp_ref, each estimator's
expectation approximates KL(pi || pi_ref):
  k1 = d                     unbiased, high variance, can be negative
  k2 = d^2 / 2               biased, low variance, >= 0
  k3 = exp(-d) - 1 + d       unbiased, low variance, >= 0 (exp(y) >= 1 + y)
"""

from __future__ import annotations

import torch

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate, same shape as `logp` (`[B, T]`). Padded positions
    are not masked here; the caller aggregates with its mask."""
    d = logp - logp_ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.expm1(-d) + d  # expm1 keeps precision when d ~ 0
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
