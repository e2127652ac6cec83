"""Multi-turn environments: what answers the policy's turns in an episode (tool results,
game state). An environment implements `step(action) -> Turn` (base.py); `env.name`
chooses one (registry.py): a built-in tool (the calculator, the Python interpreter), a
skyrl-gym environment, or user code. Episodes themselves are the rollout's
(async_rl/actor/rollout/).
"""
from async_rl.actor.environments.base import Environment, EnvironmentFactory, Turn

__all__ = ["Environment", "EnvironmentFactory", "Turn"]
