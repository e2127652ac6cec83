"""Rewards: what a call of a reward comes to (`outcome`; a reward that scores step by
step returns `StepRewards`), several sources summed (`components`), and the worker
processes the task's reward runs in (`pool`, `worker`, `frames`), where a call past its
deadline can be stopped."""
from async_rl.rewards.outcome import StepRewards

__all__ = ["StepRewards"]
