"""The policy losses `train.loss` can name: one call shape for all of them.

A loss gets one micro-batch as `LossInputs` and returns `LossOutput`: the loss, a mean
over the micro-batch's own `units` (the learner turns it into a share of the global
minibatch mean, normalization.py), and its diagnostics under their final metric keys
(step_metrics.py). Adding an entry to `LOSSES` adds a valid `train.loss` value.

The loss is one axis (current vs proximal policy); `train.correction` is the other
(behavior vs proximal, corrections.py): its weights and mask reach every loss in
`LossInputs.correction`, so every correction works with every loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from async_rl.algorithms import gspo
from async_rl.algorithms.aggregation import agg_denominator
from async_rl.algorithms.cispo import cispo_loss
from async_rl.algorithms.corrections import Correction
from async_rl.algorithms.gspo import gspo_loss
from async_rl.algorithms.opmd import learning_group_count, opmd_loss
from async_rl.algorithms.ppo import ppo_clip_loss
from async_rl.algorithms.step_metrics import Figure, Mean

if TYPE_CHECKING:
    from async_rl.algorithms.config import CISPOLoss, GSPOLoss, OPMDLoss, PPOLoss

# Logged on every step line whatever the loss (the run directory contract lists is/clip_frac).
CLIP_FRACTIONS: tuple[str, ...] = ("is/clip_frac", "is/clip_frac_low", "is/clip_frac_high", "is/dual_clip_frac")


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
    config: PPOLoss | GSPOLoss | CISPOLoss | OPMDLoss  # the loss's own section: train.loss
    agg: str  # train.agg
    correction: Correction  # train.correction's weights and mask (behavior -> proximal)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar with grad: a mean over the micro-batch's `units`
    metrics: dict[str, Figure]


class PolicyLoss(Protocol):
    def __call__(self, x: LossInputs) -> LossOutput: ...

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        """What the loss of a batch with this mask and these groups is a mean over."""
        ...


def _token_means(loss: torch.Tensor, stats: dict[str, float], mask: torch.Tensor) -> LossOutput:
    tokens = float(mask.sum())
    return LossOutput(loss, {key: Mean.of(value, tokens) for key, value in stats.items()})


class AggMean:
    """A loss that is a `train.agg` mean of its token terms."""

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        return agg_denominator(mask, agg)


class PPOClip(AggMean):
    """Decoupled PPO-clip (AReaL) or naive PPO-clip (ppo.py): a `train.agg` mean. Naive
    PPO's ratio is to the behavior policy, so no correction applies (its config's
    correction is `none`)."""

    def __call__(self, x: LossInputs) -> LossOutput:
        p = x.config
        anchor, weights = (x.logp_prox, x.correction.weights) if p.decoupled else (x.logp_behav, None)
        loss, stats = ppo_clip_loss(x.logp, anchor, x.advantages, x.mask, weights=weights, eps_low=p.eps_low,
                                    eps_high=p.eps_high, agg=x.agg, dual_clip=p.dual_clip,
                                    log_ratio_clamp=p.log_ratio_clamp)
        return _token_means(loss, stats, x.mask)


class GSPO:
    """GSPO's sequence-ratio clip (gspo.py): a mean over responses, whatever `train.agg`."""

    def __call__(self, x: LossInputs) -> LossOutput:
        g = x.config
        loss, stats = gspo_loss(x.logp, x.logp_prox, x.advantages, x.mask, weights=x.correction.weights,
                                keep=x.correction.keep, eps_low=g.eps_low, eps_high=g.eps_high,
                                log_ratio_clamp=g.log_ratio_clamp)
        return _token_means(loss, stats, x.mask)

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        return agg_denominator(mask, gspo.AGG)


class CISPO(AggMean):
    """CISPO's clipped stop-gradient weight (cispo.py): a `train.agg` mean."""

    def __call__(self, x: LossInputs) -> LossOutput:
        c = x.config
        loss, stats = cispo_loss(x.logp, x.logp_prox, x.advantages, x.mask, weights=x.correction.weights,
                                 eps_low=c.eps_low, eps_high=c.eps_high, agg=x.agg,
                                 log_ratio_clamp=c.log_ratio_clamp)
        return _token_means(loss, stats, x.mask)


class OPMD:
    """Kimi k1.5's squared-loss policy mirror descent (opmd.py): a mean over prompt groups."""

    def __call__(self, x: LossInputs) -> LossOutput:
        o = x.config
        loss, stats = opmd_loss(x.logp, x.logp_behav, x.mask, x.rewards, x.group, tau=o.tau,
                                length_norm=o.length_norm, weights=x.correction.weights, keep=x.correction.keep)
        samples, tokens = x.mask.shape[0], float(x.mask.sum())
        metrics = {key: Mean.of(value, samples) for key, value in stats.items()}
        # No ratio to clip, no importance weight to cap: every fraction is 0.
        metrics.update({key: Mean(0.0, tokens) for key in CLIP_FRACTIONS})
        return LossOutput(loss, metrics)

    def units(self, mask: torch.Tensor, group: torch.Tensor, agg: str) -> float:
        return float(learning_group_count(mask, group))


LOSSES: dict[str, PolicyLoss] = {"ppo": PPOClip(), "gspo": GSPO(), "cispo": CISPO(), "opmd": OPMD()}
