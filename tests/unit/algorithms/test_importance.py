"""The behavior->proximal diagnostics of the whole batch: ESS, mismatch KL (k3, k1), the
token ratio's and sequence log-ratio's distribution, and what the correction did."""

from __future__ import annotations

import math

import pytest
import torch
from reference_formulas import INF, NAN, D, batch, ref_off_policy

from async_rl.algorithms.corrections import icepop
from async_rl.algorithms.importance import EffectiveSampleSize, importance_weights, off_policy_figures
from async_rl.algorithms.step_metrics import Mean, StepMetrics

WEIGHT_FIGURES = ("is/ess", "is/mismatch_kl")


def values(figures, keys=WEIGHT_FIGURES) -> dict[str, float]:
    return {key: figures[key].value() for key in keys}


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
    # k1 = mean of -d; the token ratios are 3, 1/2, 1; the sequence log-ratios ln 1.5 and 0
    assert figures["is/mismatch_k1"].value() == pytest.approx(-math.log(1.5) / 3, rel=1e-12)
    distribution = {key: figures[key].value() for key in figures if "ratio_" in key}
    exact = {"is/ratio_min": 0.5, "is/ratio_max": 3.0, "is/ratio_q50": 1.0,
             "is/seq_log_ratio_min": 0.0, "is/seq_log_ratio_max": math.log(1.5), "is/seq_log_ratio_q01": 0.0,
             "is/seq_log_ratio_q50": 0.0}
    assert {k: distribution[k] for k in exact} == pytest.approx(exact, rel=1e-12, abs=1e-15)
    # quantiles are bin middles: within half a bin (0.0025 in d, 0.01 in S) of the value
    assert math.log(distribution["is/ratio_q01"]) == pytest.approx(math.log(0.5), abs=0.0025)
    assert math.log(distribution["is/ratio_q99"]) == pytest.approx(math.log(3.0), abs=0.0025)
    assert distribution["is/seq_log_ratio_q99"] == pytest.approx(math.log(1.5), abs=0.01)


def test_what_the_correction_did():
    # IcePop in [0.75, 2]: the 3 and the 1/2 of the first response are masked, the 1 kept
    prox = torch.tensor([[math.log(3.0), math.log(0.5)], [0.0, 0.0]], dtype=D)
    behav = torch.zeros(2, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    correction = icepop(prox - behav, mask, 0.75, 2.0)
    figures = off_policy_figures(prox, behav, mask, correction)[1]
    assert values(figures, ("is/masked_frac", "is/masked_seq_frac", "is/truncated_frac", "is/weight_mean")) == {
        "is/masked_frac": 2 / 3, "is/masked_seq_frac": 0.5, "is/truncated_frac": 0.0, "is/weight_mean": 1 / 3}
    assert "is/masked_frac" not in off_policy_figures(prox, behav, mask)[1]


def test_extremes_are_of_the_whole_batch_over_micro_batches_and_ranks():
    metrics = StepMetrics()
    mask = torch.ones(1, 2)
    for d in ([0.1, -0.2], [0.3, 0.0], [-0.05, 0.05]):  # three micro-batches
        metrics.update(off_policy_figures(torch.tensor([d], dtype=D), torch.zeros(1, 2, dtype=D), mask)[1])
    two_ranks = metrics.reduce(lambda v: 2 * v, reduce_max=lambda v: v)  # the other rank saw the same
    assert two_ranks["is/ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-12)
    assert two_ranks["is/ratio_min"] == pytest.approx(math.exp(-0.2), rel=1e-12)
    assert two_ranks["is/seq_log_ratio_max"] == pytest.approx(0.3, rel=1e-12)
    assert two_ranks["is/seq_log_ratio_min"] == pytest.approx(-0.1, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_and_sums_over_micro_batches(seed):
    """Micro-batches (and ranks) add their sums; the figure is the whole batch's."""
    x = batch(seed)
    metrics = StepMetrics()
    for rows in (slice(0, 2), slice(2, 5), slice(5, 8)):
        metrics.update(off_policy_figures(x.prox[rows], x.behav[rows], x.mask[rows])[1])
    got = metrics.reduce(lambda v: v)
    assert values_of(got) == pytest.approx(ref_off_policy(x.prox, x.behav, x.mask), rel=1e-12)
    whole = off_policy_figures(x.prox, x.behav, x.mask)[1]
    assert got == pytest.approx({key: figure.value() for key, figure in whole.items()}, rel=1e-12)


def values_of(reduced: dict[str, float]) -> dict[str, float]:
    return {key: reduced[key] for key in WEIGHT_FIGURES}


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
