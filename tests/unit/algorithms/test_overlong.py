"""DAPO's overlong treatments against hand values (arXiv 2503.14476, section 3.4)."""
import torch

from async_rl.algorithms.overlong import overlong_filter, overlong_penalty


def test_soft_overlong_punishment_hand_values():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4 down to -1 at 10.
    lengths = torch.tensor([1, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, penalty=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 5


def test_overlong_filter_zeroes_the_rows_of_truncated_samples():
    mask = torch.tensor([[0.0, 1, 1], [1, 1, 1], [0, 0, 1]])
    out = overlong_filter(mask, torch.tensor([0, 1, 0]))
    assert out.tolist() == [[0, 1, 1], [0, 0, 0], [0, 0, 1]]
