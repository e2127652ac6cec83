"""The rollout-to-proximal corrections against values worked out by hand.

Two responses of two tokens and a pad: ratios (2, 2) and (1/2, 1), so the sequence
ratios are 4 and 1/2 and the geometric means 2 and sqrt(1/2) = 0.7071...
"""
import math

import pytest
import torch

from async_rl.algorithms.corrections import (
    geometric_log_ratio,
    geometric_mask,
    icepop,
    masked_shares,
    sequence_log_ratio,
    sequence_mask,
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


def test_a_product_past_float64_is_capped_not_infinite() -> None:
    huge = torch.full((1, 2000), 1.0)  # exp(2000) overflows float64
    c = truncated_sequence_is(huge, torch.ones_like(huge), cap=5.0)
    assert_values(c.weights, [[5.0] * 2000])


def test_sequence_mask_keeps_responses_whose_product_is_in_bounds() -> None:
    c = sequence_mask(LOG_RATIO, MASK, low=0.4, high=2.0)
    assert c.keep.tolist() == [[False, False, False], [True, True, False]]  # 4 > 2; 0.4 <= 1/2
    assert c.weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]


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
