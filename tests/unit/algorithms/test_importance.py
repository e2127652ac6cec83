"""is/ess and is/mismatch_kl: the raw behavior->proximal importance weights of the whole batch."""

from __future__ import annotations

import math

import pytest
import torch
from reference_formulas import INF, NAN, D, batch, ref_off_policy

from async_rl.algorithms.importance import EffectiveSampleSize, importance_weights, off_policy_figures
from async_rl.algorithms.step_metrics import Mean, StepMetrics


def values(figures) -> dict[str, float]:
    return {key: figure.value() for key, figure in figures.items()}


def test_hand_values_and_garbage_padding():
    # raw weights 3, 0.5 and 1 (prox == behav); padding is garbage and takes no part
    prox = torch.tensor([[math.log(3.0), math.log(0.5), NAN], [0.2, INF, -INF]], dtype=D)
    behav = torch.tensor([[0.0, 0.0, INF], [0.2, NAN, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w, figures = off_policy_figures(prox, behav, mask)
    assert w.dtype == torch.float64 and w[mask == 0].tolist() == [1.0] * 3
    torch.testing.assert_close(w[mask == 1], torch.tensor([3.0, 0.5, 1.0], dtype=D))
    # ESS = (3 + 0.5 + 1)^2 / (3 * (9 + 0.25 + 1)); mismatch k3(d = -ln w) = w - 1 - ln w
    expected = {"is/ess": 4.5**2 / (3 * 10.25),
                "is/mismatch_kl": sum(v - 1 - math.log(v) for v in (3.0, 0.5, 1.0)) / 3}
    assert values(figures) == pytest.approx(expected, rel=1e-12)
    assert isinstance(figures["is/ess"], EffectiveSampleSize) and figures["is/mismatch_kl"].weight == 3.0


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_and_sums_over_micro_batches(seed):
    """Micro-batches (and ranks) add their sums; the figure is the whole batch's."""
    x = batch(seed)
    metrics = StepMetrics()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 8)):
        metrics.update(off_policy_figures(x.prox[rows], x.behav[rows], x.mask[rows])[1])
    got = metrics.reduce(lambda v: v)
    assert got == pytest.approx(ref_off_policy(x.prox, x.behav, x.mask), rel=1e-12)
    assert got == pytest.approx(values(off_policy_figures(x.prox, x.behav, x.mask)[1]), rel=1e-12)


def test_on_policy_is_one_and_float32_stays_at_most_one():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, 300, generator=g)  # float32, as the learner's log-probs
    mask = torch.ones(64, 300)
    assert values(off_policy_figures(logp, logp, mask)[1]) == {"is/ess": 1.0, "is/mismatch_kl": 0.0}
    near = logp + 1e-3 * torch.randn(64, 300, generator=g)
    ess = values(off_policy_figures(near, logp, mask)[1])["is/ess"]
    assert 0.999 < ess <= 1.0
    assert importance_weights(near, logp, mask).dtype == torch.float64


def test_an_empty_batch_gives_zero_not_nan():
    z = torch.zeros(2, 3)
    figures = off_policy_figures(z, z, torch.zeros(2, 3))[1]
    assert values(figures) == {"is/ess": 0.0, "is/mismatch_kl": 0.0}
    assert figures["is/mismatch_kl"] == Mean(0.0, 0.0)
