"""Micro-batch shares add up to the global minibatch mean of every loss term, over
micro-batches and (simulated) ranks, and the world-size factor of the backward."""

from __future__ import annotations

import pytest
import torch
from reference_formulas import AGGS, D, batch, close

from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.corrections import correct
from async_rl.algorithms.gae import value_loss
from async_rl.algorithms.losses import LOSSES, LossInputs
from async_rl.algorithms.normalization import Shares, Units, backward_share, global_units
from async_rl.config import build_config

# Two ranks of whole groups (ids 30, -4 | 8, 11), each cut into micro-batches of whole groups.
ORDER = torch.tensor([0, 2, 6, 1, 5, 3, 7, 4])  # rows grouped: 30 30 30 -4 -4 8 8 11
RANKS = [(slice(0, 5), [slice(0, 3), slice(3, 5)]), (slice(5, 8), [slice(5, 7), slice(7, 8)])]  # (rows, micro-batches)


def regrouped(seed: int):
    x = batch(seed)
    for name in ("mask", "group", "logp", "prox", "behav", "adv_seq", "rewards", "kl", "values", "old_values",
                 "returns"):
        value = getattr(x, name)
        setattr(x, name, value.detach()[ORDER].requires_grad_(value.requires_grad))
    return x


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_shares_add_up_to_the_minibatch_mean(agg, loss):
    """policy (its own units), KL-like (train.agg units) and value (tokens) terms."""
    x = regrouped(0)
    train = build_config({"train": {"loss": loss, "agg": agg}}).train
    policy_loss = LOSSES[loss]

    def terms(rows) -> torch.Tensor:
        out = policy_loss(LossInputs(x.logp[rows], x.prox[rows], x.behav[rows], x.adv_seq[rows], x.mask[rows],
                                     x.rewards[rows], x.group[rows], train.loss, train.agg,
                                     correct(train.correction, x.prox[rows], x.behav[rows], x.mask[rows])))
        vloss, _ = value_loss(x.values[rows], x.old_values[rows], x.returns[rows], x.mask[rows])
        return torch.stack([out.loss, aggregate(x.kl[rows], x.mask[rows], agg), vloss]).detach()

    rank_units = [Units.of(policy_loss, x.mask[rows], x.group[rows], agg) for rows, _ in RANKS]
    tables = [torch.tensor([[u.policy, u.agg, u.tokens]], dtype=D) for u in rank_units]
    (minibatch,) = global_units(rank_units[:1], lambda v: sum(tables))  # rank 0's view of the all_reduce
    total = torch.zeros(3, dtype=D)
    for _, micros in RANKS:
        for rows in micros:
            s = Shares.of(Units.of(policy_loss, x.mask[rows], x.group[rows], agg), minibatch)
            total += terms(rows) * torch.tensor([s.policy, s.regularizer, s.value], dtype=D)
    close(total, terms(slice(None)))


def test_empty_minibatch_units_are_floored_so_shares_are_zero():
    empty = Units(0.0, 0.0, 0.0)
    (units,) = global_units([empty], lambda v: v)
    assert units == Units(1e-12, 1e-12, 1e-12)
    assert Shares.of(empty, units) == Shares(0.0, 0.0, 0.0)


def test_backward_share_scales_by_the_world_size():
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    backward_share((p * p).sum() * 0.25, world=4)
    close(p.grad, torch.tensor([2.0, 4.0]))  # 4 * 0.25 * 2p
