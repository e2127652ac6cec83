"""The policy losses `train.loss` can name: one call shape for all of them.

A loss gets one micro-batch as `LossInputs` and returns `LossOutput`: the loss, a mean
over the micro-batch's own `units` (the learner turns it into a share of the global
minibatch mean, normalization.py), and its diagnostics under their final metric keys
(step_metrics.py). Adding an entry to `LOSSES` adds a valid `train.loss` value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from async_rl.algorithms.aggregation import agg_denominator
from async_rl.algorithms.opmd import opmd_loss
from async_rl.algorithms.ppo import ppo_clip_loss
from async_rl.algorithms.step_metrics import Figure, Mean

if TYPE_CHECKING:
    from async_rl.algorithms.config import OPMDLoss, PPOLoss

# Logged on every step line whatever the loss (the run directory contract lists is/clip_frac).
CLIP_FRACTIONS: tuple[str, ...] = (
    "is/clip_frac", "is/clip_frac_low", "is/clip_frac_high", "is/dual_clip_frac", "is/capped_frac")


@dataclass
class LossInputs:
    """One micro-batch; token tensors are `[B, T]`, per-response ones `[B]`."""

    logp: torch.Tensor  # current policy, with grad
    logp_prox: torch.Tensor  # proximal policy: the policy at the start of this optimizer step
    logp_behav: torch.Tensor  # behavior policy: the actors' sampling log-probs
    advantages: torch.Tensor  # [B] or [B, T]
    mask: torch.Tensor  # response tokens
    rewards: torch.Tensor  # [B], with any KL-in-reward penalty
    group: torch.Tensor  # [B] prompt group ids
    config: PPOLoss | OPMDLoss  # the loss's own section: train.loss
    agg: str  # train.agg


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar with grad: a mean over the micro-batch's `units`
    metrics: dict[str, Figure]


class PolicyLoss(Protocol):
    def __call__(self, x: LossInputs) -> LossOutput: ...

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        """What the loss of a batch with this mask and these groups is a mean over."""
        ...


class PPOClip:
    """Decoupled PPO-clip (AReaL) or naive PPO-clip (ppo.py): a `train.agg` mean."""

    def __call__(self, x: LossInputs) -> LossOutput:
        p = x.config
        loss, stats = ppo_clip_loss(
            x.logp, x.logp_prox, x.logp_behav, x.advantages, x.mask, eps_low=p.eps_low, eps_high=p.eps_high,
            is_cap=p.is_cap, decoupled=p.decoupled, agg=x.agg, dual_clip=p.dual_clip, is_mode=p.is_mode,
            log_ratio_clamp=p.log_ratio_clamp)
        tokens = float(x.mask.sum())
        return LossOutput(loss, {key: Mean.of(value, tokens) for key, value in stats.items()})

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        return agg_denominator(mask, agg)


class OPMD:
    """Kimi k1.5's squared-loss policy mirror descent (opmd.py): a mean over prompt groups."""

    def __call__(self, x: LossInputs) -> LossOutput:
        o = x.config
        loss, stats = opmd_loss(x.logp, x.logp_behav, x.mask, x.rewards, x.group, tau=o.tau,
                                length_norm=o.length_norm)
        samples, tokens = x.mask.shape[0], float(x.mask.sum())
        metrics = {key: Mean.of(value, samples) for key, value in stats.items()}
        # No ratio to clip, no importance weight to cap: every fraction is 0.
        metrics.update({key: Mean(0.0, tokens) for key in CLIP_FRACTIONS})
        return LossOutput(loss, metrics)

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        return float(torch.unique(group).numel())


LOSSES: dict[str, PolicyLoss] = {"ppo": PPOClip(), "opmd": OPMD()}
