"""`env.name` to an environment factory: a built-in name, a skyrl-gym environment or user code."""
from __future__ import annotations

from functools import partial

from async_rl.actor.environments.base import EnvironmentFactory
from async_rl.actor.environments.calculator import Calculator
from async_rl.actor.environments.python_tool import NAME as PYTHON_TOOL
from async_rl.actor.environments.python_tool import python_tool_factory
from async_rl.actor.environments.skyrl import PREFIX as SKYRL_PREFIX
from async_rl.actor.environments.skyrl import skyrl_factory
from async_rl.tasks.base import load_callable

BUILTIN = ("calculator", PYTHON_TOOL)


def environment_factory(name: str, task, options: dict | None = None, max_turns: int = 4) -> EnvironmentFactory:
    """The factory `env.name` names; `task`: the run's task, whose reward the built-in
    environments score final answers with; `options` (env.options) go to the Python tool
    and to skyrl-gym environments, `max_turns` to skyrl-gym's. ValueError in one line when
    it cannot load."""
    if name == "calculator":
        return partial(Calculator, score=task.reward)
    if name == PYTHON_TOOL:
        return python_tool_factory(task.reward, options or {})
    if name.startswith(SKYRL_PREFIX):
        return skyrl_factory(name, options or {}, max_turns)
    if ":" not in name:
        raise ValueError(f"env.name {name!r} must be a built-in environment ({', '.join(BUILTIN)}), "
                         f"'{SKYRL_PREFIX}<id>', 'module:function' or 'path/to/file.py:function'")
    return load_callable(name, "env.name")
