"""FSDP2 for the learner's models: sharding (mixed precision, activation checkpointing)
and gathering full parameters back, shared by the learner, the benchmarks and the test
workers."""
from __future__ import annotations

import logging

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

log = logging.getLogger("async_rl.learner")


def shard_model(model: torch.nn.Module, mesh, *, precision: str = "fp32",
                activation_checkpointing: bool = False, compile: bool = False) -> torch.nn.Module:
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
    compile: each decoder layer compiled in place before it is sharded (models/compiled.py),
    so FSDP2's hooks gather around the compiled region.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    if activation_checkpointing:
        from transformers import PreTrainedModel

        # The policy itself, or the critic's trunk: the outermost HF model inside `model`.
        hf = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        from async_rl.models.compiled import compile_blocks

        compile_blocks(model)
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


def full_parameters(model: torch.nn.Module, keep=None):
    """Yield (name, full tensor) one parameter at a time (those whose name `keep` accepts,
    when given); a collective on every rank. Always the master weights: after a forward
    without a backward (an evaluation) on one rank, FSDP2 leaves the compute copies
    registered (bf16 under learner.precision=bf16), so the model is resharded first."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    for name, param in model.named_parameters():
        if keep is not None and not keep(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach()
