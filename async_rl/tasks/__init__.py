"""Tasks: prompt sources and reward functions.

``make_task("arithmetic", seed=..., digits=2)`` or
``make_task("jsonl", seed=..., path="data.jsonl", reward="pkg.mod:fn")``.
Reward functions are referenced as ``"module:function"``;
``async_rl.tasks.arithmetic:exact_match`` is a ready-made one.
"""

from __future__ import annotations

from typing import Any

from async_rl.tasks.arithmetic import ArithmeticTask, exact_match
from async_rl.tasks.base import EVAL_ID_OFFSET, Prompt, RewardFn, Task, is_eval_id, load_reward_fn
from async_rl.tasks.jsonl import JsonlTask, read_jsonl

TASKS = {"arithmetic": ArithmeticTask, "jsonl": JsonlTask}


def make_task(name: str, *, seed: int, **options: Any) -> Task:
    """Build a task by name; unknown names or options raise ValueError saying which."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
    try:
        return cls(seed=seed, **options)
    except TypeError as exc:
        # An unexpected keyword from a config file: report it as a config error.
        raise ValueError(f"task {name!r}: {exc}") from exc


__all__ = [
    "EVAL_ID_OFFSET",
    "ArithmeticTask",
    "JsonlTask",
    "Prompt",
    "RewardFn",
    "TASKS",
    "Task",
    "exact_match",
    "is_eval_id",
    "load_reward_fn",
    "make_task",
    "read_jsonl",
]
