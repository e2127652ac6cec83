"""`env.name` to an environment factory: a built-in name or user code."""
from __future__ import annotations

from functools import partial

from ..tasks.base import load_callable
from .base import EnvironmentFactory
from .calculator import Calculator

BUILTIN = ("calculator",)


def environment_factory(name: str, task) -> EnvironmentFactory:
    """The factory `env.name` names; `task`: the run's task, whose reward the built-in
    environments score final answers with. ValueError in one line when it cannot load."""
    if name == "calculator":
        return partial(Calculator, score=task.reward)
    if ":" not in name:
        raise ValueError(f"env.name {name!r} must be a built-in environment ({', '.join(BUILTIN)}), "
                         "'module:function' or 'path/to/file.py:function'")
    return load_callable(name, "env.name")
