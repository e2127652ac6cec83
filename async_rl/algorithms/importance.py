"""How far the training data is from the policy: the behavior -> proximal diagnostics.

For every response token, d_t = logp_prox - logp_behav and r_t = exp(d_t), raw (before
any correction), whichever loss and correction are trained; per response, S = sum_t d_t
(the log of the sequence ratio). Every figure is of the whole batch (all ranks, all
minibatches):

- `is/ess`, the effective sample size of the token weights r_t (Kish, "Survey Sampling",
  1965) normalized by the number of tokens N:  ESS = (sum_t r_t)^2 / (N * sum_t r_t^2),
  in (0, 1]: 1 when every weight is equal (on-policy data gives r = 1), near 1/N when
  one token carries all the weight. The sums are float64: the ESS is a ratio of sums
  over the whole batch, and float32 rounding can push it past 1.
- `is/mismatch_kl` and `is/mismatch_k1`: the mean over tokens of Schulman's k3 and k1
  estimates of KL(behavior || proximal) (kl.py), k3_t = r_t - 1 - d_t and k1_t = -d_t:
  the tokens were sampled by the behavior policy. k3 is >= 0 per token; k1 is unbiased
  and can be negative on a batch.
- `is/ratio_{min,q01,q50,q99,max}`: r_t's distribution over the tokens;
  `is/seq_log_ratio_{min,q01,q50,q99,max}`: S's over the responses (a log: the product
  of hundreds of ratios overflows). Quantiles are exact to half a bin (of width 0.005
  in d, 0.02 in S, one centred on 0; step_metrics.Quantile), min and max exact.
- What the correction did (`train.correction`): `is/masked_frac` (response tokens out of
  the gradient), `is/masked_seq_frac` (responses with any token out), `is/truncated_frac`
  (kept tokens whose weight was cut to a cap), `is/weight_mean` (the weights as applied,
  0 where masked).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from async_rl.algorithms.corrections import Correction, sequence_log_ratio
from async_rl.algorithms.kl import kl_estimate
from async_rl.algorithms.step_metrics import Figure, Max, Mean, Quantile

QUANTILES = {"q01": 0.01, "q50": 0.5, "q99": 0.99}
TOKEN_BINS = (5.0, 0.005)  # d_t: (half range, bin width)
SEQUENCE_BINS = (20.0, 0.02)  # S


class EffectiveSampleSize(NamedTuple):
    weight_sum: float
    weight_sq_sum: float
    tokens: float

    def value(self) -> float:
        return self.weight_sum * self.weight_sum / max(self.tokens * self.weight_sq_sum, 1e-12)


def importance_weights(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Raw weights exp(logp_prox - logp_behav) `[B, T]`, float64; 1 off the response."""
    return torch.exp(torch.where(mask.bool(), logp_prox.double() - logp_behav.double(), 0.0))


def _ratio(log_ratio: float) -> float:
    return math.exp(min(log_ratio, 700.0))  # a float64 overflow shows as e^700


def _distribution(prefix: str, values: torch.Tensor, bins: tuple[float, float], transform=None
                  ) -> dict[str, Figure]:
    half_range, width = bins
    n = 2 * round(half_range / width) + 1  # 0 is a bin's middle: on-policy data reads exactly 1
    low, high = -width * n / 2, width * n / 2
    shown = transform or (lambda x: x)
    counts = Quantile.counts(values, low, high, n)
    figures: dict[str, Figure] = {f"{prefix}_{name}": Quantile(counts, q, low, high, transform)
                                  for name, q in QUANTILES.items()}
    largest = float(values.max()) if values.numel() else -math.inf
    smallest = float(values.min()) if values.numel() else math.inf
    figures[f"{prefix}_max"] = Max(shown(largest) if values.numel() else -math.inf)
    # The smallest value is the largest of the negated values.
    figures[f"{prefix}_min"] = _NegatedMax(-shown(smallest) if values.numel() else -math.inf)
    return figures


class _NegatedMax(Max):
    """A minimum carried as the maximum of the negated values."""

    def value(self) -> float:
        return -super().value()


def off_policy_figures(logp_prox: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor,
                       correction: Correction | None = None) -> tuple[torch.Tensor, dict[str, Figure]]:
    """(raw weights `[B, T]`, the figures above for this micro-batch). Without
    `correction`, only the raw ones (no masked or truncated shares)."""
    m = mask.bool()
    w = importance_weights(logp_prox, logp_behav, mask)
    d = torch.where(m, logp_prox.double() - logp_behav.double(), 0.0)
    tokens = float(m.sum())
    responses = m.any(-1)
    n_responses = float(responses.sum())

    def token_mean(x: torch.Tensor) -> Mean:
        return Mean(float(torch.where(m, x, 0.0).sum()), tokens)

    figures: dict[str, Figure] = {
        "is/ess": EffectiveSampleSize(float(torch.where(m, w, 0.0).sum()),
                                      float(torch.where(m, w.square(), 0.0).sum()), tokens),
        "is/mismatch_kl": token_mean(kl_estimate(logp_behav.double(), logp_prox.double(), "k3")),
        "is/mismatch_k1": token_mean(-d),
        **_distribution("is/ratio", d[m], TOKEN_BINS, _ratio),
        **_distribution("is/seq_log_ratio", sequence_log_ratio(d, m)[responses], SEQUENCE_BINS),
    }
    if correction is not None:
        dropped = m & ~correction.keep
        figures.update({
            "is/masked_frac": Mean(float(dropped.sum()), tokens),
            "is/masked_seq_frac": Mean(float(dropped.any(-1).sum()), n_responses),
            "is/truncated_frac": Mean(float((m & correction.truncated).sum()), tokens),
            "is/weight_mean": token_mean(correction.weights),
        })
    return w, figures
