"""How far the training data is from the policy: behavior -> proximal importance weights.

For every response token, w_t = exp(logp_prox - logp_behav), raw (before any cap),
whichever loss is trained (PPO caps or drops large weights, OPMD uses none). Two
figures summarize them over the response tokens of the whole batch (all ranks, all
minibatches):

- `is/ess`, the effective sample size of the weights (Kish, "Survey Sampling", 1965)
  normalized by the number of tokens N:  ESS = (sum_t w_t)^2 / (N * sum_t w_t^2),
  in (0, 1]: 1 when every weight is equal (on-policy data gives w = 1), near 1/N when
  one token carries all the weight. The sums are float64: the ESS is a ratio of sums
  over the whole batch, and float32 rounding can push it past 1.
- `is/mismatch_kl`, the mean over tokens of Schulman's k3 estimate of
  KL(behavior || proximal) (kl.py): the tokens were sampled by the behavior policy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from async_rl.algorithms.kl import kl_estimate
from async_rl.algorithms.step_metrics import Figure, Mean


class EffectiveSampleSize(NamedTuple):
    weight_sum: float
    weight_sq_sum: float
    tokens: float

    def value(self) -> float:
        return self.weight_sum * self.weight_sum / max(self.tokens * self.weight_sq_sum, 1e-12)


def importance_weights(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Raw weights exp(logp_prox - logp_behav) `[B, T]`, float64; 1 off the response."""
    return torch.exp(torch.where(mask.bool(), logp_prox - logp_behav, 0.0).double())


def off_policy_figures(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, Figure]]:
    """(raw weights `[B, T]`, {"is/ess", "is/mismatch_kl"} figures of this batch)."""
    m = mask.bool()
    w = importance_weights(logp_prox, logp_behav, mask)
    tokens = float(mask.sum())
    mismatch = torch.where(m, kl_estimate(logp_behav, logp_prox, "k3"), 0.0)
    return w, {
        "is/ess": EffectiveSampleSize(float(torch.where(m, w, 0.0).sum()),
                                      float(torch.where(m, w.square(), 0.0).sum()), tokens),
        "is/mismatch_kl": Mean(float(mismatch.sum()), tokens),
    }
