"""The algorithm's sections: the policy loss and the advantage estimator (each a choice
among variants with knobs of their own), the KL penalty and DAPO's overlong remedies.
The names here are the registries' keys (losses.LOSSES, advantages.ADVANTAGES); a test
keeps the two in step."""
from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from async_rl.config.section import Section, choice

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]
ISMode = Literal["truncate", "mask"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)
KL_KINDS: tuple[str, ...] = get_args(KLKind)
IS_MODES: tuple[str, ...] = get_args(ISMode)


class PPOLoss(Section):
    name: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, ge=0.0, description="Clip range below 1.")
    eps_high: float = Field(0.2, ge=0.0, description="Clip range above 1 (above eps_low: clip-higher).")
    decoupled: bool = Field(True, description="Decoupled PPO (a proximal policy and an IS weight, AReaL); false = naive PPO.")
    is_cap: float = Field(2.0, gt=0.0, description="Cap on the behavior importance weight exp(logp_prox - logp_behav).")
    is_mode: ISMode = Field("truncate", description="A weight over is_cap: `truncate` to the cap, or `mask` the token (AReaL).")
    log_ratio_clamp: float = Field(20.0, gt=0.0, description="Log-ratios are clamped to +-this before exp (verl: 20).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual clip c > 1: negative advantages bounded below by c*A (null = off).")


class OPMDLoss(Section):
    name: Literal["opmd"] = "opmd"
    tau: float = Field(1.0, gt=0.0, description="Regularization strength of Kimi k1.5's squared-loss mirror descent.")
    length_norm: bool = Field(False, description="Divide each sequence's log-ratio by its length.")


class GroupAdvantage(Section):
    name: Literal["grpo", "drgrpo", "rloo", "grpo_process"] = "grpo"


class ReMaxAdvantage(Section):
    name: Literal["remax"] = "remax"


class ReinforcePPAdvantage(Section):
    name: Literal["reinforce_pp"] = "reinforce_pp"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over response tokens.")


class GAEAdvantage(Section):
    name: Literal["gae"] = "gae"
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount over response tokens.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    critic_lr: float = Field(1e-3, gt=0.0, description="AdamW learning rate of the critic (the policy trunk plus a value head).")
    value_clip: float | None = Field(0.2, gt=0.0, description="Clip of the value update around the old values (null = off).")


LossConfig = choice(PPOLoss, OPMDLoss, default=PPOLoss)
AdvantageConfig = choice(GroupAdvantage, ReMaxAdvantage, ReinforcePPAdvantage, GAEAdvantage, default=GroupAdvantage)
LOSS_VARIANTS = (PPOLoss, OPMDLoss)
ADVANTAGE_VARIANTS = (GroupAdvantage, ReMaxAdvantage, ReinforcePPAdvantage, GAEAdvantage)


class KLConfig(Section):
    coef: float = Field(0.0, ge=0.0, description="Weight of the KL to the frozen initial policy; 0 = no reference model.")
    estimator: KLKind = Field("k3", description="Schulman's per-token KL estimator.")
    mode: Literal["loss", "reward"] = Field("loss", description="`loss`: coef*KL in the loss (GRPO); `reward`: -coef*KL per token in the reward.")
    clamp: float | None = Field(10.0, gt=0.0, description="Per-token estimates are clamped to +-this (verl, OpenRLHF: 10); null = unclamped.")


class OverlongConfig(Section):
    filter: bool = Field(False, description="DAPO overlong filtering: responses cut at the length limit get no loss.")
    penalty_tokens: int = Field(0, ge=0, description="DAPO soft punishment over the last this many tokens before the limit (0 = off).")
    penalty: float = Field(1.0, ge=0.0, description="Largest overlong penalty, reached at the length limit.")
