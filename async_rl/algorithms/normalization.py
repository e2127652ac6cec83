"""Each micro-batch's share of the global minibatch loss, and the world-size factor.

An optimizer step trains on one minibatch, split over the learner ranks (whole prompt
groups each) and, on every rank, into micro-batches forwarded and backwarded one at a
time. Every loss term is a mean over some unit of the *whole* minibatch:

    term                unit (its denominator)
    policy loss         the loss's own `units`: `train.agg` units for PPO (response
                        tokens, or non-empty responses), prompt groups for OPMD
    KL, entropy bonus   `train.agg` units
    value loss          response tokens

A micro-batch computes each term as a mean over its own d units; times d / D, with D
the units of the whole minibatch summed over every rank, it becomes the micro-batch's
share, and the shares of all micro-batches on all ranks add up to the minibatch mean.
Units depend on masks and group ids only, so every D is known before the first forward
(`global_units`, one all_reduce per learner step).

FSDP2, like DDP, averages gradients over ranks: its reduce-scatter divides the summed
gradients by the world size. Each rank therefore back-propagates `world` times its
shares (`backward_share`), so that the average is the gradient of the sum of all shares,
the minibatch mean: the gradient of one process training on the whole minibatch
(tests/integration/test_fsdp.py checks it in float64, up to float32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from async_rl.algorithms.aggregation import agg_denominator

# Sums a tensor over all learner ranks (an all_reduce), so that statistics are those
# of the global batch, not of one rank's shard.
ReduceSum = Callable[[torch.Tensor], torch.Tensor]


class CountsUnits(Protocol):
    """A policy loss, as far as normalization needs it (losses.PolicyLoss)."""

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float: ...


@dataclass(frozen=True)
class Units:
    """What each loss term of a batch is a mean over, as float counts."""

    policy: float  # the policy loss's own units
    agg: float  # train.agg units: KL and entropy terms
    tokens: float  # response tokens: the value loss

    @classmethod
    def of(cls, policy_loss: CountsUnits, mask: torch.Tensor, group: torch.Tensor, agg: str) -> Units:
        return cls(policy_loss.units(mask, group, agg), agg_denominator(mask, agg), float(mask.sum()))


def global_units(local: list[Units], reduce_sum: ReduceSum, device: torch.device | str = "cpu") -> list[Units]:
    """Each minibatch's units summed over the ranks (one reduction for all minibatches)."""
    table = torch.tensor([[u.policy, u.agg, u.tokens] for u in local], dtype=torch.float64, device=device)
    # At least 1e-12: a minibatch whose every sample was filtered out has no units, and
    # its micro-batch shares (0 / D) must be 0, not NaN.
    return [Units(*row) for row in reduce_sum(table).cpu().clamp(min=1e-12).tolist()]


@dataclass(frozen=True)
class Shares:
    """Factors turning a micro-batch's per-term means into its shares of the minibatch mean."""

    policy: float
    regularizer: float  # KL and entropy terms
    value: float

    @classmethod
    def of(cls, micro: Units, minibatch: Units) -> Shares:
        return cls(micro.policy / minibatch.policy, micro.agg / minibatch.agg, micro.tokens / minibatch.tokens)


def backward_share(loss: torch.Tensor, world: int) -> None:
    """Back-propagate this rank's share of a minibatch loss, times the world size that
    FSDP2's gradient averaging divides by."""
    (loss * world).backward()
