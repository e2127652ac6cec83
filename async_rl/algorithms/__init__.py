"""Loss functions and advantage estimators (see DESIGN.md, "Losses (notation)")."""

from .advantages import (ADVANTAGE_METHODS, discounted_returns, group_advantages, masked_whiten,
                         reinforce_pp_advantages, remax_advantages, token_rewards)
from .aggregation import AGG_MODES, agg_denominator, aggregate
from .entropy import token_entropy
from .gae import gae_advantages, value_loss
from .kl import KL_KINDS, kl_estimate
from .opmd import opmd_loss
from .overlong import overlong_filter, overlong_penalty
from .ppo import IS_MODES, ppo_clip_loss

__all__ = [
    "ADVANTAGE_METHODS",
    "AGG_MODES",
    "IS_MODES",
    "KL_KINDS",
    "agg_denominator",
    "aggregate",
    "discounted_returns",
    "gae_advantages",
    "group_advantages",
    "kl_estimate",
    "masked_whiten",
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
