"""GSPO and CISPO against values worked out by hand: the loss, its gradient, and the
clip fractions."""

import math

import pytest
import torch

from async_rl.algorithms.cispo import cispo_loss
from async_rl.algorithms.gspo import gspo_loss

D = torch.float64


def grad(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, x)[0]


def test_gspo_clips_the_length_normalized_sequence_ratio_as_a_whole() -> None:
    # response 0: log-ratios 0.1 and 0.3, s = e^0.2 = 1.2214, A = 1: inside eps_high 0.3, unclipped
    # response 1: log-ratio -0.5, s = e^-0.5 = 0.6065, A = -1: below 1 - 0.2, min(sA, 0.8 A) = -0.8, clipped
    prox = torch.zeros(2, 3, dtype=D)
    logp = torch.tensor([[0.1, 0.3, 7.0], [-0.5, 7.0, 7.0]], dtype=D, requires_grad=True)  # 7s are padding
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = gspo_loss(logp, prox, torch.tensor([1.0, -1.0], dtype=D), mask, eps_low=0.2, eps_high=0.3)
    s = math.exp(0.2)
    assert loss.item() == pytest.approx((-s + 0.8) / 2, rel=1e-12)  # a mean over responses of token means
    # d(-s_it)/dlogp_t = -s: each of response 0's two tokens, / 2 tokens, / 2 responses; response 1 clipped
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]], dtype=D))
    assert stats["is/clip_frac"] == pytest.approx(1 / 3) and stats["is/clip_frac_low"] == pytest.approx(1 / 3)


def test_gspo_weights_tokens_and_reads_the_ratio_of_the_kept_tokens_only() -> None:
    prox = torch.zeros(1, 2, dtype=D)
    logp = torch.tensor([[0.1, 5.0]], dtype=D, requires_grad=True)
    mask = torch.ones(1, 2)
    keep = torch.tensor([[True, False]])
    weights = torch.tensor([[2.0, 0.0]], dtype=D)
    loss, _ = gspo_loss(logp, prox, torch.tensor([1.0], dtype=D), mask, weights=weights, keep=keep, eps_low=0.5,
                        eps_high=0.5)
    s = math.exp(0.1)  # the masked token's log-ratio 5 takes no part in s
    assert loss.item() == pytest.approx(-2.0 * s / 2, rel=1e-12)  # its token keeps the denominator
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[-s, 0.0]], dtype=D))


def test_cispo_keeps_every_gradient_and_caps_its_weight() -> None:
    # ratios e^0.1 = 1.1052 and 6 (capped to 1 + 4 = 5); A = 1; log-probs -1 and -2 + ln 6
    prox = torch.tensor([[-1.1, -2.0]], dtype=D)
    logp = torch.tensor([[-1.0, -2.0 + math.log(6.0)]], dtype=D, requires_grad=True)
    mask = torch.ones(1, 2)
    loss, stats = cispo_loss(logp, prox, torch.tensor([1.0], dtype=D), mask, eps_high=4.0)
    r0 = math.exp(0.1)
    expected = (-r0 * -1.0 - 5.0 * (-2.0 + math.log(6.0))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # the capped token still has a gradient: -sg(5) * A / N
    torch.testing.assert_close(grad(loss, logp), torch.tensor([[-r0 / 2, -5.0 / 2]], dtype=D))
    assert stats["is/clip_frac"] == 0.5 and stats["is/clip_frac_high"] == 0.5 and stats["is/clip_frac_low"] == 0.0
    # a lower bound, when given; and the correction's weights multiply each term
    loss, stats = cispo_loss(logp, prox + 1.0, torch.tensor([1.0], dtype=D), mask, eps_low=0.5, eps_high=4.0,
                             weights=torch.tensor([[3.0, 0.0]], dtype=D))
    # ratios e^-0.9 = 0.41 -> 0.5, and 6/e = 2.2 (uncapped); the second token's weight is 0
    assert loss.item() == pytest.approx(-3.0 * 0.5 * -1.0 / 2, rel=1e-12)
    assert stats["is/clip_frac_low"] == 0.5


def test_with_one_optimizer_step_cispo_is_reinforce_with_the_weights() -> None:
    logp = torch.tensor([[-0.7, -1.3]], dtype=D, requires_grad=True)
    adv = torch.tensor([0.5], dtype=D)
    weights = torch.tensor([[1.5, 0.25]], dtype=D)
    loss, _ = cispo_loss(logp, logp.detach(), adv, torch.ones(1, 2), weights=weights)
    torch.testing.assert_close(grad(loss, logp), -weights * 0.5 / 2)
