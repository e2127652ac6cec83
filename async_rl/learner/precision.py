"""The learner's float32 master weights against the 16-bit copies the policy is run in.

With `learner.precision: bf16` the learner's forward runs a bfloat16 copy of its float32
master weights, and 16-bit actors run one too: what the run samples, trains on and
evaluates is the master rounded to nearest. So the model a run hands out is written in
the dtype its actors ran (`actors_dtype`), and master weights that start exactly on that
grid are first spread inside their rounding intervals (`dither_to_grid`): from the
grid, round-to-nearest erases every update smaller than half a spacing, so neither the
actors nor the bf16 forward would see the optimizer's first steps, while the master
accumulates them (docs/results.md, "What final/ holds").
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("async_rl.learner")
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def actors_dtype(cfg) -> torch.dtype:
    """The dtype the actors hold the policy's weights in: the torch engine's, vLLM's when
    it is a 16-bit one ('auto': the model's own 16-bit dtype), else float32. It is what
    they sample and are evaluated with, so what the weights travel and final/ is written in."""
    engine = cfg.actors.engine
    dtype = engine.dtype
    if engine.name == "vllm" and dtype == "auto":
        from transformers import AutoConfig

        dtype = str(getattr(AutoConfig.from_pretrained(cfg.model.path), "dtype", None)).removeprefix("torch.")
    resolved = getattr(torch, dtype, torch.float32)
    return resolved if resolved in SIXTEEN_BIT else torch.float32


def compute_grid(cfg) -> torch.dtype | None:
    """The coarsest 16-bit dtype the policy is run in (the learner's bf16 forward, or the
    actors'), whose grid the master weights must not sit on; None when all is float32.
    A bfloat16 interval holds whole float16 ones: spread over it, a weight is also off
    float16's grid."""
    used = {actors_dtype(cfg)} | ({torch.bfloat16} if cfg.learner.precision == "bf16" else set())
    return torch.bfloat16 if torch.bfloat16 in used else torch.float16 if torch.float16 in used else None


# Float32's 23 mantissa bits against the 16-bit dtype's: the low bits a value on the
# 16-bit grid has zero, and the range of its normal numbers (bfloat16's is float32's).
LOW_BITS = {torch.bfloat16: 16, torch.float16: 13}
NORMAL_RANGE = {torch.bfloat16: (0.0, float("inf")), torch.float16: (2.0 ** -14, 65504.0)}


def on_grid(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where `t` (float32) holds a nonzero value `dtype` represents exactly, within its
    normal range (below it float16 is evenly spaced at 2^-24: no dead zone to speak of)."""
    bits = t.view(torch.int32)
    low, (smallest, largest) = LOW_BITS[dtype], NORMAL_RANGE[dtype]
    size = t.abs()
    return ((bits & ((1 << low) - 1)) == 0) & (size >= smallest) & (size <= largest) & (t != 0) \
        & torch.isfinite(t)


@torch.no_grad()
def dither_to_grid(t: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """`t` (float32) with each value on `dtype`'s grid (`on_grid`) moved to a uniformly
    random point of the interval that rounds to it: the same `dtype` copy, bit for bit,
    but a master whose rounding, from then on, moves with its updates in expectation
    (subtractive dither). Other values are left as they are.

    In float32's bit pattern (sign and magnitude, monotonic in the magnitude) a grid
    value has its LOW_BITS zero, and round-to-nearest-even sends every pattern less than
    half a grid step away to it: the offset is drawn there, so an interval that
    straddles a power of two keeps each side's own spacing."""
    low = LOW_BITS[dtype]
    half = (1 << (low - 1)) - 1  # the ends, half a step away, round to the even neighbour
    grid = on_grid(t, dtype)
    count = int(grid.sum())
    out = t.clone()
    if count:
        offsets = torch.randint(-half, half + 1, (count,), generator=generator, dtype=torch.int32)
        out.view(torch.int32)[grid] += offsets.to(t.device)
    return out


@torch.no_grad()
def dither_masters(model: torch.nn.Module, cfg) -> None:
    """learner.dither_masters: spread the trained weights of `model` (just loaded, float32,
    not yet sharded: every rank does the same, from cfg.seed) that lie on the grid of the
    16-bit dtype the policy runs in. A LoRA run trains adapters that start off the grid
    (or at zero) and leaves the base as loaded."""
    grid = compute_grid(cfg)
    if grid is None or not cfg.learner.dither_masters or cfg.model.lora.rank:
        return
    generator, total, moved = torch.Generator().manual_seed(cfg.seed), 0, 0
    for param in model.parameters():
        if param.requires_grad and param.dtype == torch.float32:
            moved += int(on_grid(param, grid).sum())
            total += param.numel()
            param.copy_(dither_to_grid(param, grid, generator))
    if total and moved / total > 0.01:
        name = str(grid).removeprefix("torch.")
        log.info("%.1f%% of the model's weights lie exactly on %s's grid (as a model written in 16 bits loads); "
                 "spread inside their rounding intervals, so that the %s copies the policy runs in move with the "
                 "first updates (learner.dither_masters)", 100 * moved / total, name, name)
