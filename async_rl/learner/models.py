"""The learner's models, built once on every rank: the policy (with LoRA adapters when
model.lora.rank > 0), its frozen KL reference, the GAE critic, each sharded with FSDP2,
and their optimizers and learning-rate schedule (optimizer.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from async_rl.config import Config
from async_rl.learner.optimizer import build_optimizers
from async_rl.learner.packing import attention_kind, packing_error, shares_prompt
from async_rl.learner.precision import dither_masters
from async_rl.learner.sharding import shard_model

log = logging.getLogger("async_rl.learner")


@dataclass
class Models:
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None = None  # frozen initial policy, when train.kl.coef > 0
    critic: torch.nn.Module | None = None  # value model, when train.advantage = gae
    critic_optimizer: torch.optim.Optimizer | None = None
    reference_is_base: bool = False  # LoRA: the reference is the policy with its adapters disabled
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None  # the policy optimizer's learning rate

    def trained(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """Each trained model with its optimizer, by the name a checkpoint stores it under."""
        parts = {"model": (self.policy, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_optimizer)
        return parts


def _check_packing(cfg: Config, policy: torch.nn.Module) -> None:
    """Turn learner.share_prompt / learner.pack off, with a line saying why, for a model
    that cannot take them. Deterministic and identical on every rank: all agree."""
    lc = cfg.learner
    if lc.pack and lc.share_prompt and not shares_prompt(policy):
        log.info("learner.share_prompt: %s attention takes no custom mask; packing without shared prompts",
                 attention_kind(policy))
        cfg.learner.share_prompt = False
    if lc.pack and lc.share_prompt:
        error = packing_error(policy, shared=True)
        if error > 1e-4:
            log.warning("learner.share_prompt: %s does not reproduce its padded logits with shared prompts (max "
                        "difference %.2g); packing without sharing", type(policy).__name__, error)
            cfg.learner.share_prompt = False
    if lc.pack and not lc.share_prompt:
        error = packing_error(policy)
        if error > 1e-4:
            log.warning("learner.pack: %s does not reproduce its padded logits when packed (max difference %.2g); "
                        "training with padded micro-batches", type(policy).__name__, error)
            cfg.learner.pack = False


def load_policy(cfg: Config, device: torch.device) -> torch.nn.Module:
    """The model at model.path, float32 on `device`, with learner.attention's kernel."""
    from transformers import AutoModelForCausalLM

    kernel = {"attn_implementation": cfg.learner.attention} if cfg.learner.attention else {}
    return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, **kernel).to(device)


def build_models(cfg: Config, device: torch.device, mesh) -> Models:
    """Policy (+ frozen reference for KL, + critic for GAE), each sharded with FSDP2, with
    their optimizers and the learning-rate schedule."""
    lc = cfg.learner
    policy = load_policy(cfg, device)
    dither_masters(policy, cfg)
    _check_packing(cfg, policy)
    lora = cfg.model.lora.rank > 0
    if lora:
        from async_rl.lora.adapters import with_adapters

        policy = with_adapters(policy, cfg.model.lora)
    policy = shard_model(policy, mesh, precision=lc.precision, activation_checkpointing=lc.activation_checkpointing,
                         compile=lc.compile)
    reference, critic = None, None
    if cfg.train.kl.coef > 0 and not lora:  # no backward through the reference: nothing to checkpoint
        reference = shard_model(load_policy(cfg, device).requires_grad_(False).eval(), mesh, precision=lc.precision)
    if cfg.train.advantage.name == "gae":
        from async_rl.models.critic import ValueModel

        critic = shard_model(ValueModel(cfg.model.path, reward_model=cfg.train.advantage.critic_init).to(device), mesh,
                             precision=lc.precision,
                             activation_checkpointing=lc.activation_checkpointing)
    optimizer, scheduler, critic_optimizer = build_optimizers(cfg.train, policy, critic)
    # LoRA: the KL reference is the policy computing its base (lora.base_only), no second model.
    return Models(policy, optimizer, reference, critic, critic_optimizer,
                  reference_is_base=bool(cfg.train.kl.coef > 0 and lora), scheduler=scheduler)
