"""async-rl: asynchronous off-policy reinforcement fine-tuning of language models.

What user code needs (a task's prompts and reward, an environment, a reward source) is
importable from here, and stays here across redesigns (docs/api.md):

    from async_rl import Prompt, Turn, StepRewards

Everything else is the project's inside and may move; a module that moved says where
to when imported from its old place (moved_modules.py). The names load on first use,
so `import async_rl` (and `import async_rl.config`) imports no torch.
"""
from __future__ import annotations

import importlib
from typing import Any

from async_rl.moved_modules import refuse_moved_modules

PUBLIC = {
    # tasks: prompts and the reward's signature
    "Prompt": "async_rl.tasks.base",
    "Task": "async_rl.tasks.base",
    "RewardFn": "async_rl.tasks.base",
    # environments: one object per episode answering the policy's turns
    "Turn": "async_rl.actor.environments.base",
    "Environment": "async_rl.actor.environments.base",
    "EnvironmentFactory": "async_rl.actor.environments.base",
    # what a reward may return besides a number
    "StepRewards": "async_rl.rewards.outcome",
    # reward sources, each a reward `(prompt, response, answer, **fields) -> float`
    "RewardModel": "async_rl.rewards.reward_model",
    "ProcessRewardModel": "async_rl.rewards.reward_model",
    "Judge": "async_rl.rewards.judge",
    # configs, as `async-rl train` reads them
    "Config": "async_rl.config",
    "ConfigError": "async_rl.config",
    "load_config": "async_rl.config",
}
__all__ = sorted(PUBLIC)

refuse_moved_modules()


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'async_rl' has no attribute {name!r} (its public names: {', '.join(__all__)})")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
