"""The learner's sections: its processes and micro-batches (`learner`), the step and the
optimizer (`train`), and its checkpoints (`checkpoint`)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from async_rl.algorithms.config import (
    AdvantageConfig,
    AggMode,
    CorrectionConfig,
    GroupAdvantage,
    KLConfig,
    LossConfig,
    NoCorrection,
    OverlongConfig,
    PPOLoss,
    TokenCorrection,
)
from async_rl.config.section import Section, choice


class LearnerConfig(Section):
    ranks: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field("auto", description="Learner processes sharing the model with FSDP2; `auto` = one per GPU, one on CPU.")
    threads: int = Field(1, ge=1, description="torch intra-op threads per learner rank (CPU).")
    micro_batch_size: int = Field(256, ge=1, description="Sequences per forward/backward on one rank (gradient accumulation beyond).")
    micro_batch_tokens: int | None = Field(None, ge=1, description="Token budget per micro-batch instead of micro_batch_size (null = use micro_batch_size).")
    pack: bool = Field(True, description="Padding-free micro-batches (sequences end to end); false = right-padded rows.")
    share_prompt: bool = Field(True, description="With pack: each group's prompt computed once, its responses attending to it.")
    pack_row_tokens: int | None = Field(None, ge=1, description="With pack: packed row length (null = the micro-batch's longest sequence).")
    skip_zero_advantage: bool = Field(True, description="Leave groups whose every advantage is 0 out of forward and backward (same update).")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="FSDP2 mixed precision: bf16 compute with fp32 master weights, or fp32.")
    attention: Literal["sdpa", "eager"] | None = Field(None, description="The policy's attention kernel (null = the model's default).")
    dither_masters: bool = Field(True, description="Master weights loaded exactly on the 16-bit grid the policy runs in are spread inside their rounding intervals, so its 16-bit copies follow small updates.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in backward.")
    compile: bool = Field(False, description="torch.compile each transformer block (dynamic shapes); off by default: docs/performance.md has where it wins.")
    timeout_s: float = Field(600.0, gt=0.0, description="Timeout of learner collectives and of waiting for experience.")


class ConstantSchedule(Section):
    name: Literal["constant"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")


class DecaySchedule(Section):
    name: Literal["cosine", "linear"] = "cosine"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    min_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final learning rate as a fraction of the peak (train.lr, sft.lr).")


ScheduleConfig = choice(ConstantSchedule, DecaySchedule, default=ConstantSchedule)


class TrainConfig(Section):
    max_steps: int = Field(60, ge=1, description="Learner steps (= the final policy version).")
    batch_groups: int = Field(64, ge=1, description="Prompt groups consumed per learner step.")
    group_size: int = Field(8, ge=1, description="Responses sampled per prompt (G).")
    loss: LossConfig = Field(default_factory=PPOLoss, description="Policy loss, current to proximal policy: `ppo` (PPO-clip), `gspo`, `cispo` or `opmd` (Kimi k1.5).")
    correction: CorrectionConfig = Field(default_factory=TokenCorrection, description="Behavior-to-proximal correction (`none` by default for opmd and naive ppo).")
    advantage: AdvantageConfig = Field(default_factory=GroupAdvantage, description="Advantage estimator (for ppo; opmd uses the rewards).")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per learner step, on disjoint slices of the batch.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (entropy is logged either way).")
    agg: AggMode = Field("token-mean", description="Loss aggregation over tokens.")
    lr: float = Field(5e-4, gt=0.0, description="AdamW peak learning rate.")
    lr_schedule: ScheduleConfig = Field(default_factory=ConstantSchedule, description="Learning-rate schedule: `constant`, `cosine` or `linear` decay.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW's epsilon: a gradient much smaller than it moves its weight by less than the learning rate.")
    grad_clip: float = Field(1.0, gt=0.0, description="Gradient-norm clip.")
    max_skipped_steps: int = Field(5, ge=1, description="This many non-finite steps in a row stop the run (exit 3).")
    kl: KLConfig = Field(default_factory=KLConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)

    @model_validator(mode="before")
    @classmethod
    def _correction_of_the_loss(cls, data: Any) -> Any:
        # OPMD's reference is the sampler's own log-probs, and naive PPO's ratio is to the
        # behavior policy: by default neither takes a correction.
        if isinstance(data, dict) and "correction" not in data:
            loss = data.get("loss", "ppo")
            if isinstance(loss, str):
                loss = {"name": loss}
            elif not isinstance(loss, dict):
                loss = {"name": getattr(loss, "name", "ppo"), "decoupled": getattr(loss, "decoupled", True)}
            name, decoupled = loss.get("name", "ppo"), loss.get("decoupled", True)
            if name == "opmd" or (name == "ppo" and decoupled in (False, "false", "False")):
                return {**data, "correction": NoCorrection()}
        return data


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="Resumable checkpoint every this many steps (0 = only at the end).")
    keep: int = Field(2, ge=1, description="Complete checkpoints kept in RUN_DIR/checkpoints.")
    final_master: bool = Field(False, description="Also write the learner's float32 master weights to RUN_DIR/final-master (final/ holds the weights as the actors ran them).")
