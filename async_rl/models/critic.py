"""The critic for GAE: the policy's own transformer trunk plus a scalar value head.

Initializing the trunk from the policy checkpoint gives the critic the policy's
features from step 0 (as in InstructGPT/verl, where the critic starts from the
SFT or reward model); the head starts at zero so the first values are 0 and the
first advantages equal the discounted rewards.
"""
from __future__ import annotations

import torch
from torch import nn


class ValueModel(nn.Module):
    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoModel  # heavy import, only when a critic is used

        self.trunk = AutoModel.from_pretrained(path, dtype=dtype)
        self.head = nn.Linear(self.trunk.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        # FSDP2 wrapping in the learner shards one unit per decoder layer, found by these names.
        self._no_split_modules = list(getattr(self.trunk, "_no_split_modules", None) or ())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`[B, L]` values: entry t is V(state after token t), i.e. the value before
        token t+1 is emitted, aligned with the learner's `[B, L-1]` token tensors
        after dropping the last column."""
        hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # A fresh tensor, not a view: FSDP2 warns that in-place ops on a view returned
        # by a sharded root would skip its pre-backward hook.
        return self.head(hidden).squeeze(-1).float().clone()
