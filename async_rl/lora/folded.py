"""Adapters folded into the weights an actor decodes with.

Unmerged, every adapted projection costs two more small matmuls per decode step, and
with many projections and one token a step their dispatch slows generation
(docs/lora.md). So a float32 torch engine keeps its adapters merged (W + scale * B @ A, peft's
`merge_adapter`), and a sync lands in a separate set of tensors named as the
adapters; once a whole version has arrived, `fold()` takes the previous adapters out
of the weights and puts the new ones in (peft's `unmerge_adapter` then
`merge_adapter`). Each fold rounds the weights twice, one float32 ulp at most each; a
test bounds the drift over many folds. In lower precisions that rounding would
accumulate, so they stay unmerged (`foldable`).
"""
from __future__ import annotations

import torch

from async_rl.lora.adapters import adapter_parameters


def foldable(dtype: torch.dtype) -> bool:
    return dtype == torch.float32


class FoldedAdapters:
    """The adapters of peft model `model`, merged into its base weights; `received`
    holds the tensors a sync writes into (the adapters' names, shapes and order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.live = adapter_parameters(model)
        self.received = [(name, p.detach().clone()) for name, p in self.live]
        model.merge_adapter()

    @torch.no_grad()
    def fold(self) -> None:
        """Replace the merged adapters by the received ones."""
        self.model.unmerge_adapter()
        for (_, live), (_, new) in zip(self.live, self.received):
            live.copy_(new)
        self.model.merge_adapter()
