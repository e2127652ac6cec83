"""`torch.compile` per transformer block, as torchtitan does: each decoder layer becomes
one compiled region (inductor: C++ on a CPU, Triton on a GPU), with dynamic shapes, so
packed rows of any length and a growing KV cache reuse one graph instead of recompiling
per shape. Whole-model compilation would also trace the HF wrapper's Python (masks,
cache objects, output classes), which breaks graphs; blocks are where the time goes.

`learner.compile` and `actors.engine.compile` switch it on per role; it is off by
default because on the CPUs measured it wins in float32 and loses in bf16
(docs/performance.md, "Compiled blocks"). Inductor caches compiled graphs on disk
(TORCHINDUCTOR_CACHE_DIR, by default under /tmp), so a restarted or resumed process
compiles again only what it has not seen.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("async_rl.models")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks: the longest ModuleList of modules that look like
    decoder layers (HF's `model.layers`, also under peft's wrappers)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)
             and all(type(layer).__name__.endswith(("DecoderLayer", "Block", "Layer")) for layer in m)]
    return max(lists, key=len, default=[])


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile each transformer block of `model` in place (parameter names unchanged, so
    weight sync and checkpoints see the same model); returns how many."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile: no transformer blocks found in {type(model).__name__}")
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
