"""The critic for GAE: the policy's own transformer trunk plus a scalar value head.

Initializing the trunk from the policy checkpoint gives the critic the policy's
features from step 0, and the head starts at zero so the first values are 0 and the
first advantages equal the discounted rewards. Or both start from a reward model
(`train.advantage.critic_init`: a sequence-classification directory with one output,
as `async-rl rm` writes): its trunk, and its score head as the value head, the
InstructGPT recipe (arXiv 2203.02155, section 3.5: "we initialize the value function
from the RM"), as OpenRLHF and verl do; the RM must read the policy's tokens (the same
vocabulary).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class ValueModel(nn.Module):
    def __init__(self, path: str, dtype: torch.dtype = torch.float32, reward_model: str | None = None):
        super().__init__()
        from transformers import AutoModel  # heavy import, only when a critic is used

        self.trunk = AutoModel.from_pretrained(reward_model or path, dtype=dtype)
        self.head = nn.Linear(self.trunk.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if reward_model is not None:
            with torch.no_grad():
                self.head.weight.copy_(reward_head(reward_model, self.trunk.config.hidden_size))
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


def reward_head(path: str, hidden_size: int) -> torch.Tensor:
    """The [1, hidden] score weight of the reward model at `path` (transformers' `score`
    head: a linear layer without bias); ValueError when it has no such head."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.split(".")[-2:] == ["score", "weight"]:
                    weight = tensors.get_tensor(name)
                    if tuple(weight.shape) != (1, hidden_size):
                        raise ValueError(f"{path}: its score head is {tuple(weight.shape)}, not (1, {hidden_size}): "
                                         "a reward model has one output")
                    return weight
    raise ValueError(f"{path}: no score head (score.weight) in {', '.join(f.name for f in files) or 'no safetensors'}")
