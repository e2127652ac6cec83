"""Loss functions and advantage estimators (see DESIGN.md, "Losses (notation)"), the
registries the config names them by (`LOSSES`, `ADVANTAGES`), and how the learner
turns micro-batch means into global ones (normalization.py, step_metrics.py)."""

from async_rl.algorithms.advantages import (ADVANTAGES, GROUP_METHODS, AdvantageEstimator, AdvantageInputs, Advantages,
                         discounted_returns, group_advantages, masked_whiten, reinforce_pp_advantages,
                         remax_advantages, token_rewards)
from async_rl.algorithms.aggregation import AGG_MODES, agg_denominator, aggregate
from async_rl.algorithms.entropy import entropy_of_logp, token_entropy
from async_rl.algorithms.gae import gae_advantages, value_loss
from async_rl.algorithms.importance import EffectiveSampleSize, importance_weights, off_policy_figures
from async_rl.algorithms.kl import KL_KINDS, kl_estimate
from async_rl.algorithms.losses import CLIP_FRACTIONS, LOSSES, OPMD, LossInputs, LossOutput, PolicyLoss, PPOClip
from async_rl.algorithms.normalization import ReduceSum, Shares, Units, backward_share, global_units
from async_rl.algorithms.opmd import opmd_loss
from async_rl.algorithms.overlong import overlong_filter, overlong_penalty
from async_rl.algorithms.ppo import IS_MODES, ppo_clip_loss
from async_rl.algorithms.step_metrics import Count, Figure, Mean, StepMetrics
from async_rl.algorithms.token_logp import chosen_logp

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "CLIP_FRACTIONS",
    "GROUP_METHODS",
    "IS_MODES",
    "KL_KINDS",
    "LOSSES",
    "OPMD",
    "AdvantageEstimator",
    "AdvantageInputs",
    "Advantages",
    "Count",
    "EffectiveSampleSize",
    "Figure",
    "LossInputs",
    "LossOutput",
    "Mean",
    "PPOClip",
    "PolicyLoss",
    "ReduceSum",
    "Shares",
    "StepMetrics",
    "Units",
    "agg_denominator",
    "aggregate",
    "backward_share",
    "chosen_logp",
    "discounted_returns",
    "entropy_of_logp",
    "gae_advantages",
    "global_units",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "masked_whiten",
    "off_policy_figures",
    "opmd_loss",
    "overlong_filter",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "remax_advantages",
    "token_entropy",
    "token_rewards",
    "value_loss",
]
