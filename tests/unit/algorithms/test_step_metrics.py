"""Step diagnostics: figures add over micro-batches, sum over ranks in one reduction,
and only then become values."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms.importance import EffectiveSampleSize
from async_rl.algorithms.step_metrics import Count, Mean, StepMetrics


def ranks(*metrics: StepMetrics) -> list[dict[str, float]]:
    """reduce() on every simulated rank, with reduce_sum = the sum of all ranks' vectors."""
    vectors = []
    for m in metrics:  # first pass: each rank's flat vector
        m.reduce(lambda v: vectors.append(v.clone()) or v)
    total = sum(vectors)
    return [m.reduce(lambda v: total.clone()) for m in metrics]


def test_figures_are_global_not_means_of_means():
    a, b = StepMetrics(), StepMetrics()
    a.add("policy/entropy", Mean.of(2.0, 3.0))  # 3 tokens, mean 2
    a.add("policy/entropy", Mean.of(1.0, 1.0))
    b.add("policy/entropy", Mean.of(6.0, 4.0))
    for m, skipped in ((a, 0.5), (b, 0.5)):
        m.add("learner/skipped_steps", Count(skipped))
        m.add("learner/skipped_steps", Count(0.0))
        m.add("is/ess", EffectiveSampleSize(2.0, 4.0, 2.0))
    out_a, out_b = ranks(a, b)
    assert out_a == out_b
    assert out_a["policy/entropy"] == pytest.approx((6 + 1 + 24) / 8)
    assert out_a["learner/skipped_steps"] == 1
    assert out_a["is/ess"] == pytest.approx(16 / (4 * 8))


def test_a_mean_over_nothing_is_zero():
    m = StepMetrics()
    m.add("policy/kl_ref", Mean(0.0, 0.0))
    assert m.reduce(lambda v: v) == {"policy/kl_ref": 0.0}


def test_reduce_is_one_call_over_one_float64_vector():
    m = StepMetrics()
    m.update({"loss/total": Mean(1.5, 1.0), "is/ess": EffectiveSampleSize(1.0, 1.0, 1.0)})
    calls = []
    out = m.reduce(lambda v: calls.append(v) or v)
    assert len(calls) == 1 and calls[0].dtype == torch.float64 and calls[0].numel() == 5
    assert out == {"is/ess": 1.0, "loss/total": 1.5}
