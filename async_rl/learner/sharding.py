"""The learner's models under FSDP2: loading, sharding (mixed precision, activation
checkpointing) and gathering full parameters back, shared by the learner role, the
benchmarks and the test workers."""
from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from async_rl.config import Config
from async_rl.learner.packing import attention_kind, packing_error, shares_prompt
from async_rl.learner.step import Models

log = logging.getLogger("async_rl.learner")


def shard_model(model: torch.nn.Module, mesh, *, precision: str = "fp32",
                activation_checkpointing: bool = False) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (HF names them in `_no_split_modules`), plus the root.

    precision="bf16": FSDP2's MixedPrecisionPolicy all-gathers bf16 copies of the fp32
    sharded parameters for compute and reduce-scatters gradients in fp32; the sharded
    parameters (master weights), their gradients and the optimizer state stay fp32.
    activation_checkpointing: transformers' own per-layer checkpointing (non-reentrant
    torch.utils.checkpoint), enabled before sharding. It wraps each decoder layer's
    `forward`, not `__call__`, so FSDP2's unshard/reshard hooks stay outside the
    checkpointed region (recompute runs inside the layer's pre-backward unshard), and it
    renames nothing: torch's `checkpoint_wrapper` would insert `_checkpoint_wrapped_module`
    into every parameter name that weight sync, evaluation copies and checkpoints key on.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    if activation_checkpointing:
        from transformers import PreTrainedModel

        # The policy itself, or the critic's trunk: the outermost HF model inside `model`.
        hf = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # One rank: resharding after the forward frees nothing the backward will not gather
    # (and cast) again. A model that never runs a backward (the KL reference) then keeps
    # its gathered copy between forwards: the memory of one more copy, no gather per step.
    reshard = mesh.size() > 1
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model


def adamw(params, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (one pass over each parameter's state instead of
    the foreach implementation's several), on CPU and CUDA alike; the same update rule."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)


def full_parameters(model: torch.nn.Module, keep=None):
    """Yield (name, full tensor) one parameter at a time (those whose name `keep` accepts,
    when given); a collective on every rank."""
    for name, param in model.named_parameters():
        if keep is not None and not keep(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach()


def build_models(cfg: Config, device: torch.device, mesh) -> Models:
    """Policy (+ frozen reference for KL, + critic for GAE), each sharded with FSDP2."""
    from transformers import AutoModelForCausalLM

    def load_policy():
        kernel = {"attn_implementation": cfg.learner.attention} if cfg.learner.attention else {}
        return AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32, **kernel).to(device)

    lc = cfg.learner
    policy = load_policy()
    # Deterministic and identical on every rank (same weights, same inputs): all agree.
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
    lora = cfg.model.lora.rank > 0
    if lora:
        from async_rl.lora.adapters import with_adapters

        policy = with_adapters(policy, cfg.model.lora)
    policy = shard_model(policy, mesh, precision=lc.precision,
                         activation_checkpointing=lc.activation_checkpointing)
    trained = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters alone
    models = Models(policy, adamw(trained, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay))
    if cfg.train.kl.coef > 0 and lora:
        models.reference_is_base = True  # the policy computing its base (lora.base_only): no second model
    elif cfg.train.kl.coef > 0:  # no backward through the reference: nothing to checkpoint
        models.reference = shard_model(load_policy().requires_grad_(False).eval(), mesh, precision=lc.precision)
    if cfg.train.advantage.name == "gae":
        from async_rl.models.critic import ValueModel

        models.critic = shard_model(ValueModel(cfg.model.path).to(device), mesh, precision=lc.precision,
                                    activation_checkpointing=lc.activation_checkpointing)
        models.critic_optimizer = adamw(models.critic.parameters(), lr=cfg.train.advantage.critic_lr,
                                        weight_decay=cfg.train.weight_decay)
    return models
