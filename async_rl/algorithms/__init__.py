"""Loss functions and advantage estimators (see DESIGN.md, "Losses (notation)")."""

from .advantages import ADVANTAGE_METHODS, group_advantages, reinforce_pp_advantages, remax_advantages
from .aggregation import AGG_MODES, agg_denominator, aggregate
from .kl import KL_KINDS, kl_estimate
from .opmd import opmd_loss
from .ppo import ppo_clip_loss

__all__ = [
    "ADVANTAGE_METHODS",
    "AGG_MODES",
    "KL_KINDS",
    "agg_denominator",
    "aggregate",
    "group_advantages",
    "kl_estimate",
    "opmd_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "remax_advantages",
]
