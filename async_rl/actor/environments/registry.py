"""`env.name` to an environment factory: a built-in name, a skyrl-gym environment or user code."""
from __future__ import annotations

from functools import partial

from async_rl.actor.environments.base import EnvironmentFactory
from async_rl.actor.environments.calculator import Calculator
from async_rl.actor.environments.skyrl import PREFIX as SKYRL_PREFIX
from async_rl.actor.environments.skyrl import skyrl_factory
from async_rl.tasks.base import load_callable

BUILTIN = ("calculator",)


def environment_factory(name: str, task, options: dict | None = None, max_turns: int = 4) -> EnvironmentFactory:
    """The factory `env.name` names; `task`: the run's task, whose reward the built-in
    environments score final answers with; `options` (env.options) and `max_turns` go to
    skyrl-gym environments. ValueError in one line when it cannot load."""
    if name == "calculator":
        return partial(Calculator, score=task.reward)
    if name.startswith(SKYRL_PREFIX):
        return skyrl_factory(name, options or {}, max_turns)
    if ":" not in name:
        raise ValueError(f"env.name {name!r} must be a built-in environment ({', '.join(BUILTIN)}), "
                         f"'{SKYRL_PREFIX}<id>', 'module:function' or 'path/to/file.py:function'")
    return load_callable(name, "env.name")
