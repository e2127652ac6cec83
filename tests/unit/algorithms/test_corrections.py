"""The rollout-to-proximal corrections against values worked out by hand.

Two responses of two tokens and a pad: ratios (2, 2) and (1/2, 1), so the sequence
ratios are 4 and 1/2 and the geometric means 2 and sqrt(1/2) = 0.7071...
"""
import math

import pytest
import torch

from async_rl.algorithms.config import IcePopCorrection, TokenCorrection
from async_rl.algorithms.corrections import (
    correct,
    geometric_log_ratio,
    geometric_mask,
    icepop,
    kl_rejection,
    m2po,
    masked_shares,
    no_correction,
    sequence_log_ratio,
    sequence_mask,
    token_is,
    truncated_sequence_is,
)

# The pads' log-ratios (7, -7) must count nowhere.
LOG_RATIO = torch.tensor([[math.log(2), math.log(2), 7.0], [math.log(0.5), 0.0, -7.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def assert_values(actual: torch.Tensor, expected) -> None:
    """Up to float64 rounding of the logs and exps above."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0.0)


def test_sequence_and_geometric_log_ratios() -> None:
    assert_values(torch.exp(sequence_log_ratio(LOG_RATIO, MASK)), [4.0, 0.5])
    assert_values(torch.exp(geometric_log_ratio(LOG_RATIO, MASK)), [2.0, 0.5 ** 0.5])
    assert geometric_log_ratio(LOG_RATIO, torch.zeros_like(MASK)).tolist() == [0.0, 0.0]


def test_truncated_sequence_is_weights_every_token_by_the_capped_product() -> None:
    c = truncated_sequence_is(LOG_RATIO, MASK, cap=3.0)
    assert c.weights.dtype == torch.float64
    assert_values(c.weights, [[3.0, 3.0, 0.0], [0.5, 0.5, 0.0]])
    assert c.keep.tolist() == [[True, True, False], [True, True, False]]
    assert c.truncated.tolist() == [[True, True, False], [False, False, False]]  # 4 was cut to 3


def test_token_is_truncates_or_masks_each_token_over_the_cap() -> None:
    c = token_is(LOG_RATIO, MASK, cap=1.5)  # token ratios 2, 2 | 1/2, 1
    assert_values(c.weights, [[1.5, 1.5, 0.0], [0.5, 1.0, 0.0]])
    assert c.truncated.tolist() == [[True, True, False], [False, False, False]]
    c = token_is(LOG_RATIO, MASK, cap=1.5, mode="mask")
    assert_values(c.weights, [[0.0, 0.0, 0.0], [0.5, 1.0, 0.0]])
    assert c.keep.tolist() == [[False, False, False], [True, True, False]] and not c.truncated.any()
    none = no_correction(LOG_RATIO, MASK)
    assert none.weights.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]] and none.keep.tolist() == MASK.bool().tolist()


def test_a_product_past_float64_is_capped_not_infinite() -> None:
    huge = torch.full((1, 2000), 1.0)  # exp(2000) overflows float64
    c = truncated_sequence_is(huge, torch.ones_like(huge), cap=5.0)
    assert_values(c.weights, [[5.0] * 2000])


def test_sequence_mask_keeps_responses_whose_product_is_in_bounds() -> None:
    c = sequence_mask(LOG_RATIO, MASK, low=0.4, high=2.0)
    assert c.keep.tolist() == [[False, False, False], [True, True, False]]  # 4 > 2; 0.4 <= 1/2
    assert c.weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


def test_a_kept_response_weighs_its_sequence_ratio_as_trls_sequence_mask() -> None:
    """TRL's sequence_mask: exp(S) inside [low, high], 0 outside (grpo_trainer.py,
    vllm_importance_sampling_mode)."""
    c = sequence_mask(LOG_RATIO, MASK, low=0.4, high=5.0, weight="ratio")  # exp(S) = 4 and 1/2: both kept
    assert_values(c.weights, [[4.0, 4.0, 0.0], [0.5, 0.5, 0.0]])
    assert not c.truncated.any()
    c = sequence_mask(LOG_RATIO, MASK, low=0.4, high=2.0, weight="ratio")
    assert_values(c.weights, [[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="weight"):
        sequence_mask(LOG_RATIO, MASK, low=0.4, high=2.0, weight="clip")


def test_geometric_mask_reads_the_per_token_mean() -> None:
    assert geometric_mask(LOG_RATIO, MASK, low=0.75, high=1.5).keep.tolist() == [[False] * 3, [False] * 3]
    assert geometric_mask(LOG_RATIO, MASK, low=0.7, high=2.0).keep.tolist() == [[True, True, False],
                                                                                 [True, True, False]]


def test_icepop_masks_tokens_outside_the_band_and_weights_the_rest_by_their_ratio() -> None:
    c = icepop(LOG_RATIO, MASK, low=0.4, high=1.5)
    assert c.keep.tolist() == [[False, False, False], [True, True, False]]
    assert_values(c.weights, [[0.0, 0.0, 0.0], [0.5, 1.0, 0.0]])


def test_masked_shares_count_tokens_and_responses() -> None:
    c = icepop(LOG_RATIO, MASK, low=0.75, high=1.5)  # masks both tokens of the first, the 1/2 of the second
    assert masked_shares(c, MASK) == (0.75, 1.0)
    assert masked_shares(truncated_sequence_is(LOG_RATIO, MASK, cap=3.0), MASK) == (0.0, 0.0)


@pytest.mark.parametrize("low, high", [(0.0, 1.0), (2.0, 1.0), (-1.0, 2.0)])
def test_bounds_that_select_nothing_sensible_are_refused(low, high) -> None:
    with pytest.raises(ValueError, match="0 < low <= high"):
        sequence_mask(LOG_RATIO, MASK, low, high)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_is_under_the_threshold() -> None:
    # d^2 = 0.01, 0.09, 0.25, 0: the kept prefix of the sorted squares has means 0, 0.005, 0.0333, 0.0875
    d = torch.tensor([[0.1, -0.3, 0.5, 0.0, 9.0]], dtype=torch.float64)  # the pad's 9 counts nowhere
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert m2po(d, mask, 0.04).keep.tolist() == [[True, True, False, True, False]]
    assert m2po(d, mask, 0.03).keep.tolist() == [[True, False, False, True, False]]
    assert m2po(d, mask, 0.1).keep.tolist() == [[True, True, True, True, False]]  # M2 = 0.0875 < 0.1
    # strictly below, as AReaL: an M2 equal to the threshold is masked down
    assert m2po(torch.tensor([[0.2, 0.2]], dtype=torch.float64), torch.ones(1, 2), 0.04).keep.sum() == 0
    # kept tokens are weighted by their ratio; the second moment of the kept ones is under the threshold
    c = m2po(d, mask, 0.04)
    assert_values(c.weights, [[math.exp(0.1), math.exp(-0.3), 0.0, 1.0, 0.0]])
    assert float(d[c.keep].square().mean()) < 0.04


def test_kl_rejection_by_token_and_by_response() -> None:
    # response 0: r = 2 and 1, so k3 = 2 - 1 - ln 2 = 0.3069 and 0, k1 = -ln 2 and 0; response 1: r = 1, 1
    d = torch.tensor([[math.log(2.0), 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    assert kl_rejection(d, mask, "k3", "token", 0.3).keep.tolist() == [[False, True], [True, True]]
    assert kl_rejection(d, mask, "k3", "token", 0.31).keep.all()
    # sequence mean k3 = 0.1534
    assert kl_rejection(d, mask, "k3", "sequence", 0.2).keep.all()
    assert kl_rejection(d, mask, "k3", "sequence", 0.15).keep.tolist() == [[False, False], [True, True]]
    # k1 is bounded on both sides: |mean k1| = ln(2) / 2 = 0.3466
    assert kl_rejection(d, mask, "k1", "sequence", 0.34).keep.tolist() == [[False, False], [True, True]]
    assert kl_rejection(-d, mask, "k1", "sequence", 0.34).keep.tolist() == [[False, False], [True, True]]
    assert kl_rejection(d, mask, "k1", "sequence", 0.35).keep.all()
    with pytest.raises(ValueError, match="estimator"):
        kl_rejection(d, mask, "k2", "token", 0.1)


def test_kl_rejection_keeps_the_ratio_on_kept_tokens_as_areal_does() -> None:
    d = torch.tensor([[math.log(2.0), 0.0], [math.log(0.9), 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    c = kl_rejection(d, mask, "k3", "token", 0.31, weight="ratio")  # k3 of r = 2: 0.3069, kept
    assert_values(c.weights, [[2.0, 1.0], [0.9, 1.0]])
    c = kl_rejection(d, mask, "k3", "token", 0.3, weight="ratio")
    assert_values(c.weights, [[0.0, 1.0], [0.9, 1.0]])
    assert_values(kl_rejection(d, mask, "k3", "token", 0.31).weights, [[1.0, 1.0], [1.0, 1.0]])  # verl: 1


def test_correct_reads_the_config_and_clamps_each_log_ratio_first() -> None:
    prox = torch.tensor([[0.0, 0.0, float("nan")]], dtype=torch.float64)  # the pad is garbage
    behav = torch.tensor([[-math.log(3.0), -50.0, float("inf")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    c = correct(TokenCorrection(cap=float("inf")), prox, behav, mask)
    assert_values(c.weights, [[3.0, math.exp(20.0), 0.0]])  # +-20, as verl's SAFETY_BOUND
    c = correct(IcePopCorrection(low=0.5, high=5.0), prox, behav, mask)
    assert c.keep.tolist() == [[True, False, False]]
    assert_values(c.weights, [[3.0, 0.0, 0.0]])
