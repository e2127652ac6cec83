"""What an environment is: one object per episode, made from the episode's prompt row,
answering each of the policy's turns.

    def make(prompt: Prompt) -> Environment        # a fresh episode (env.factory)

    class Environment:
        def step(self, action: str) -> Turn:       # the policy's turn, as text
            ...
        def close(self) -> None:                   # optional: called after the episode ends
            ...

The policy speaks first: its turn answers the prompt (the task's prompt, rendered with
the chat template). The environment answers with a `Turn`: messages to append to the
conversation (a tool's result, a game's state; `{"role": ..., "content": ...}` as the
chat template takes them), an optional reward for the step that turn ended, and whether
the episode is over. An episode also ends at `env.max_turns` policy turns or its token
budget. The episode's reward is the sum of its turns' rewards; each rewarded turn is a
step for `train.advantage=grpo_process`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from async_rl.tasks.base import Prompt


@dataclass
class Turn:
    """The environment's answer to one policy turn."""

    messages: list[dict[str, str]] = field(default_factory=list)  # appended to the conversation
    reward: float | None = None  # this step's reward (None: the turn is not rewarded)
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def step(self, action: str) -> Turn:
        """Answer the policy's turn `action` (its text, special tokens removed)."""
        ...


EnvironmentFactory = Callable[[Prompt], Environment]
