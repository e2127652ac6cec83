"""The algorithm's sections: the policy loss, the off-policy correction and the advantage
estimator (each a choice among variants with knobs of their own), the KL penalty and
DAPO's overlong remedies. The names here are the registries' keys (losses.LOSSES,
corrections.CORRECTIONS, advantages.ADVANTAGES); a test keeps them in step."""
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


def _log_ratio_clamp():
    return Field(20.0, gt=0.0, description="Log-ratios are clamped to +-this before exp (verl: 20).")


class PPOLoss(Section):
    name: Literal["ppo"] = "ppo"
    eps_low: float = Field(0.2, ge=0.0, description="Clip range below 1.")
    eps_high: float = Field(0.2, ge=0.0, description="Clip range above 1 (above eps_low: clip-higher).")
    decoupled: bool = Field(True, description="Decoupled PPO: the ratio to the proximal policy, corrected by train.correction (AReaL); false = naive PPO, the ratio to the behavior policy.")
    log_ratio_clamp: float = _log_ratio_clamp()
    dual_clip: float | None = Field(None, gt=1.0, description="Dual clip c > 1: negative advantages bounded below by c*A (null = off).")


class GSPOLoss(Section):
    name: Literal["gspo"] = "gspo"
    eps_low: float = Field(3e-4, ge=0.0, description="Clip range below 1 of the sequence ratio (GSPO: 3e-4).")
    eps_high: float = Field(4e-4, ge=0.0, description="Clip range above 1 of the sequence ratio (GSPO: 4e-4).")
    log_ratio_clamp: float = Field(10.0, gt=0.0, description="The sequence log-ratio is clamped to +-this before exp (verl: 10).")


class CISPOLoss(Section):
    name: Literal["cispo"] = "cispo"
    eps_low: float | None = Field(None, ge=0.0, description="Lower clip of the IS weight, 1 - eps_low (null = none, MiniMax-M1).")
    eps_high: float = Field(4.0, ge=0.0, description="Upper clip of the IS weight, 1 + eps_high (ScaleRL, SkyRL: 4).")
    log_ratio_clamp: float = _log_ratio_clamp()


class OPMDLoss(Section):
    name: Literal["opmd"] = "opmd"
    tau: float = Field(1.0, gt=0.0, description="Regularization strength of Kimi k1.5's squared-loss mirror descent.")
    length_norm: bool = Field(False, description="Divide each sequence's log-ratio by its length.")


class TokenCorrection(Section):
    name: Literal["token"] = "token"
    cap: float = Field(2.0, gt=0.0, description="Cap on each token's weight exp(logp_prox - logp_behav).")
    mode: ISMode = Field("truncate", description="A weight over the cap: `truncate` it to the cap, or `mask` the token (AReaL).")


class NoCorrection(Section):
    name: Literal["none"] = "none"


class SequenceISCorrection(Section):
    name: Literal["sequence_is"] = "sequence_is"
    cap: float = Field(2.0, gt=0.0, description="Cap on the sequence weight, the product of the token ratios.")


class BandCorrection(Section):
    """A ratio band [low, high]: what it bounds is the variant's."""

    low: float = Field(0.5, gt=0.0, le=1.0, description="Lower bound of the ratio band.")
    high: float = Field(2.0, ge=1.0, description="Upper bound of the ratio band.")


class SequenceMaskCorrection(BandCorrection):
    name: Literal["sequence_mask"] = "sequence_mask"
    weight: Literal["one", "ratio"] = Field("one", description="A kept response's weight: 1, or its sequence ratio exp(S) (TRL's `sequence_mask`).")


class GeometricMaskCorrection(BandCorrection):
    name: Literal["geometric_mask"] = "geometric_mask"
    low: float = Field(0.99, gt=0.0, le=1.0, description="Lower bound of the geometric-mean ratio.")
    high: float = Field(1.01, ge=1.0, description="Upper bound of the geometric-mean ratio.")


class IcePopCorrection(BandCorrection):
    name: Literal["icepop"] = "icepop"
    low: float = Field(0.5, gt=0.0, le=1.0, description="Tokens with a ratio below this are masked.")
    high: float = Field(5.0, ge=1.0, description="Tokens with a ratio above this are masked.")


class M2POCorrection(Section):
    name: Literal["m2po"] = "m2po"
    threshold: float = Field(0.04, gt=0.0, description="Largest second moment of the token log-ratios left after masking.")


class KLRejectCorrection(Section):
    name: Literal["kl_reject"] = "kl_reject"
    estimator: Literal["k1", "k3"] = Field("k3", description="Estimate of KL(behavior || proximal) per token.")
    level: Literal["token", "sequence"] = Field("sequence", description="Mask each token, or each response by its tokens' mean estimate.")
    threshold: float = Field(0.01, gt=0.0, description="Largest estimate kept.")
    weight: Literal["one", "ratio"] = Field("one", description="A kept token's weight: 1 (verl), or its ratio r_t (AReaL).")


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
    critic_init: str | None = Field(None, description="A reward model directory (one output, the policy's vocabulary): the critic's trunk and value head start from it (InstructGPT's recipe); null = the policy's trunk, a zero head.")


LossConfig = choice(PPOLoss, GSPOLoss, CISPOLoss, OPMDLoss, default=PPOLoss)
CorrectionConfig = choice(TokenCorrection, NoCorrection, SequenceISCorrection, SequenceMaskCorrection,
                          GeometricMaskCorrection, IcePopCorrection, M2POCorrection, KLRejectCorrection,
                          default=TokenCorrection)
AdvantageConfig = choice(GroupAdvantage, ReMaxAdvantage, ReinforcePPAdvantage, GAEAdvantage, default=GroupAdvantage)
LOSS_VARIANTS = (PPOLoss, GSPOLoss, CISPOLoss, OPMDLoss)
CORRECTION_VARIANTS = (TokenCorrection, NoCorrection, SequenceISCorrection, SequenceMaskCorrection,
                       GeometricMaskCorrection, IcePopCorrection, M2POCorrection, KLRejectCorrection)
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
