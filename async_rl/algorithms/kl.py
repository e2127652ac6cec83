"""Per-token KL estimators (J. Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html).

With x sampled from the current policy and d = logp - logp_ref, each estimator's
expectation approximates KL(pi || pi_ref):
  k1 = d                     unbiased, high variance, can be negative
  k2 = d^2 / 2               biased, low variance, >= 0
  k3 = exp(-d) - 1 + d       unbiased, low variance, >= 0 (exp(y) >= 1 + y)

`clamp` bounds the estimate to [-clamp, clamp], as verl's `kl_penalty` bounds its
k3 ("low_var_kl") to [-10, 10] (verl/trainer/ppo/core_algos.py) and OpenRLHF's
`compute_approx_kl` bounds k1/k2/k3 alike (openrlhf/models/utils.py): k3 grows like
exp(-d), so one token the policy has moved far from the reference would otherwise
dominate the penalty and its gradient. Outside the bound the gradient is 0.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.config import KL_KINDS

# verl also clamps d to [-20, 20] before k3's exp. Bounding only the exponent keeps every
# clamped estimate unchanged (k3(-20) = e^20 - 21 exceeds any sensible clamp), and makes
# the clamped-away gradient 0 rather than 0 * exp(inf) = NaN.
_K3_MAX_EXPONENT = 20.0


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: str, clamp: float | None = None) -> torch.Tensor:
    """Elementwise KL estimate, same shape as `logp` (`[B, T]`), bounded to
    [-clamp, clamp] when `clamp` is given. Padded positions are not masked here;
    the caller aggregates with its mask."""
    if clamp is not None and clamp <= 0:
        raise ValueError(f"KL clamp must be > 0, got {clamp}")
    d = logp - logp_ref
    if kind == "k1":
        est = d
    elif kind == "k2":
        est = 0.5 * d.square()
    elif kind == "k3":
        exponent = -d if clamp is None else (-d).clamp(max=_K3_MAX_EXPONENT)
        est = torch.expm1(exponent) + d  # expm1 keeps precision when d ~ 0
    else:
        raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
    return est if clamp is None else est.clamp(-clamp, clamp)
