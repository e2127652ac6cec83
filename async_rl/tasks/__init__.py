"""Tasks: prompt sources and reward functions.

``make_task("arithmetic", seed=..., digits=2)`` or
``make_task("jsonl", seed=..., path="data.jsonl", reward="pkg.mod:fn")``, or
``make_task("dataset", seed=..., path="data.parquet", prompt_column="question")``.
Reward functions are referenced as ``"module:function"``;
``async_rl.tasks.arithmetic:exact_match`` is a ready-made one.
"""

from __future__ import annotations

from typing import Any

from async_rl.tasks.arithmetic import ArithmeticTask, exact_match
from async_rl.tasks.base import EVAL_ID_OFFSET, Prompt, RewardFn, Task, is_eval_id
from async_rl.tasks.coding import CodingTask
from async_rl.tasks.dataset import DatasetTask
from async_rl.tasks.jsonl import JsonlTask, read_jsonl
from async_rl.tasks.reasoning_gym_adapter import ReasoningGymTask
from async_rl.tasks.rewards import load_reward_fn
from async_rl.tasks.rows import with_fields
from async_rl.tasks.tool_problems import ToolProblemsTask
from async_rl.tasks.word_problems import WordProblemsTask

TASKS = {"arithmetic": ArithmeticTask, "word_problems": WordProblemsTask, "tool_problems": ToolProblemsTask,
         "coding": CodingTask, "jsonl": JsonlTask, "dataset": DatasetTask, "reasoning_gym": ReasoningGymTask}


class WithReward:
    """A task with its reward function replaced (`task.reward` on a built-in task); the
    prompt's fields reach a reward that names them (`coding`'s tests)."""

    def __init__(self, task: Task, reward: RewardFn) -> None:
        self.task, self._reward = task, with_fields(reward)

    def train_prompt(self, index: int) -> Prompt:
        return self.task.train_prompt(index)

    def eval_prompts(self) -> list[Prompt]:
        return self.task.eval_prompts()

    def reward(self, prompt: str, response: str, answer: str, **fields: Any) -> float:
        return self._reward(prompt, response, answer, **fields)  # checked by the caller (prepare, actors)


class PromptIndex:
    """A task's prompts by id: training prompts (id = index) and held-out ones
    (EVAL_ID_OFFSET + position), as the coordinator names them in its grants."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._eval: list[Prompt] | None = None

    def __getitem__(self, prompt_id: int) -> Prompt:
        if not is_eval_id(prompt_id):
            return self.task.train_prompt(prompt_id)
        if self._eval is None:
            self._eval = self.task.eval_prompts()
        return self._eval[prompt_id - EVAL_ID_OFFSET]


def task_from_config(section, seed: int) -> Task:
    """The task a `task` config section describes (tasks/config.py), with the run's seed;
    its `reward`, when set, replaces the task's own."""
    if section.name == "jsonl":
        return make_task("jsonl", seed=seed, path=section.train_path, eval_path=section.eval_path,
                         reward=section.reward)
    if section.name == "dataset":
        return make_task("dataset", seed=seed, path=section.path, split=section.split,
                         prompt_column=section.prompt_column, answer_column=section.answer_column,
                         eval_split=section.eval_split, eval_fraction=section.eval_fraction, reward=section.reward)
    if section.name == "reasoning_gym":
        return make_task("reasoning_gym", seed=seed, dataset=section.dataset, options=section.dataset_options,
                         eval_size=section.eval_size, system_prompt=section.system_prompt)
    options = {"digits": section.digits} if section.name == "arithmetic" else {}
    if section.name == "coding":
        options["eval_families"] = section.eval_families
    task = make_task(section.name, seed=seed, eval_size=section.eval_size, **options)
    return WithReward(task, load_reward_fn(section.reward)) if section.reward else task


def reward_from_config(section, seed: int) -> RewardFn:
    """The reward of the task a `task` section describes, as `task_from_config` would
    score with it, built without the task's prompts when the section names the reward
    (a reward worker needs the function, not the data)."""
    if getattr(section, "reward", None):
        return with_fields(load_reward_fn(section.reward))
    return task_from_config(section, seed).reward


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
    "CodingTask",
    "JsonlTask",
    "Prompt",
    "PromptIndex",
    "ReasoningGymTask",
    "RewardFn",
    "TASKS",
    "Task",
    "ToolProblemsTask",
    "WithReward",
    "WordProblemsTask",
    "exact_match",
    "is_eval_id",
    "load_reward_fn",
    "make_task",
    "read_jsonl",
    "reward_from_config",
    "task_from_config",
]
