"""The run configuration: every section, each defined by the component that reads it,
and the rules that span sections."""
from __future__ import annotations

from pydantic import Field, model_validator

from async_rl.actor.config import ActorsConfig, RewardConfig
from async_rl.actor.environments.config import EnvConfig
from async_rl.config.section import Section
from async_rl.coordinator.config import EvalConfig
from async_rl.learner.config import CheckpointConfig, LearnerConfig, TrainConfig
from async_rl.models.config import ModelConfig
from async_rl.reward_server.config import RewardServerConfig
from async_rl.rm.config import RMConfig
from async_rl.run.config import MetricsConfig
from async_rl.sft.config import SFTConfig
from async_rl.tasks.config import ArithmeticConfig, TaskConfig
from async_rl.weight_transfer.config import SyncConfig
from async_rl.wire.config import SecurityConfig, TransportConfig


class Config(Section):
    name: str = Field("demo", description="Run name, used for the default run_dir.")
    run_dir: str | None = Field(None, description="Run directory (default runs/<name>-<timestamp>).")
    seed: int = Field(0, description="Seed for prompts, sampling and initialization.")
    max_staleness: int = Field(2, ge=0, description="Bound on a sample's staleness, in learner steps; 0 = synchronous.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticConfig, description="Prompt source and scoring.")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    reward_server: RewardServerConfig = Field(default_factory=RewardServerConfig,
                                              description="The reward server of `placement: server` components.")
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    env: EnvConfig | None = Field(None, description="Multi-turn episodes (null = single-turn).")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig,
                           description="Supervised warm start on demonstrations (`async-rl sft`).")
    rm: RMConfig = Field(default_factory=RMConfig,
                         description="A reward model trained on preference pairs (`async-rl rm`).")
    transport: TransportConfig = Field(default_factory=TransportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> Config:
        for rule in RULES:
            problem = rule(self)
            if problem:
                raise ValueError(problem)
        return self


def _syncs_reach_admission(cfg: Config) -> str | None:
    # Admission needs actors at version >= v - max_staleness; with rarer syncs they never
    # get there and the run deadlocks.
    if cfg.sync.every > cfg.max_staleness + 1:
        return f"sync.every: must be <= max_staleness + 1 = {cfg.max_staleness + 1}, got {cfg.sync.every}"
    return None


def _whole_groups_per_rank(cfg: Config) -> str | None:
    ranks, t = cfg.learner.ranks, cfg.train  # "auto" is checked once the launch has chosen it
    if ranks == "auto":
        return None
    if t.batch_groups % ranks:
        return (f"train.batch_groups: must be a multiple of learner.ranks={ranks} (each rank trains on whole "
                f"groups), got {t.batch_groups}")
    if t.batch_groups % (ranks * t.minibatches):
        return (f"train.minibatches: batch_groups={t.batch_groups} must split into learner.ranks * minibatches = "
                f"{ranks * t.minibatches} equal parts of whole groups")
    return None


def _advantage_for_the_loss(cfg: Config) -> str | None:
    advantage = cfg.train.advantage.name
    if cfg.train.loss.name == "opmd" and advantage in ("remax", "gae"):
        return f"train.advantage: {advantage} needs train.loss=ppo, gspo or cispo (opmd uses rewards directly)"
    return None


def _correction_for_the_loss(cfg: Config) -> str | None:
    loss, correction = cfg.train.loss, cfg.train.correction.name
    if loss.name == "ppo" and not loss.decoupled and correction != "none":
        return (f"train.correction: {correction} corrects toward the proximal policy, which naive PPO "
                "(train.loss.decoupled=false) does not have; use decoupled PPO or train.correction=none")
    return None


def _overlong_penalty_fits(cfg: Config) -> str | None:
    if cfg.train.overlong.penalty_tokens >= cfg.actors.max_new_tokens:
        return f"train.overlong.penalty_tokens: must be below actors.max_new_tokens={cfg.actors.max_new_tokens}"
    return None


def _transport_for_the_device(cfg: Config) -> str | None:
    transport = cfg.sync.transport
    if transport in ("nccl", "cuda_ipc") and cfg.model.device == "cpu":
        return f"sync.transport: {transport} needs model.device=cuda (CPU weights go over gloo)"
    if cfg.actors.engine.name == "vllm" and transport != "auto":
        return (f"sync.transport: {transport} cannot reach vLLM actors, which take vLLM's weight transfer (NCCL on "
                "a GPU, gloo on a CPU); leave it auto")
    return None


def _vllm_adapters_between_requests(cfg: Config) -> str | None:
    if cfg.model.lora.rank and cfg.actors.engine.name == "vllm" and cfg.sync.in_flight:
        return "sync.in_flight: vLLM actors switch LoRA adapters between requests, not mid-generation"
    return None


RULES = (_syncs_reach_admission, _whole_groups_per_rank, _advantage_for_the_loss, _correction_for_the_loss,
         _overlong_penalty_fits,
         _transport_for_the_device, _vllm_adapters_between_requests)
