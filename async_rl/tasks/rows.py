"""One row of a user's data as a prompt: the prompt (a string, or a chat as a list of
{"role", "content"} turns ending with the user's), the answer (a string; a number is
turned into its text), and every other column kept as the prompt's `fields`.
JSONL lines (jsonl.py) and Hugging Face dataset rows (dataset.py) go through here.

A reward function receives the fields it names as keyword arguments
(`def reward(prompt, response, answer, db_id)`), or all of them with `**fields`; one
of three parameters receives none. An environment factory reads `prompt.fields`.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from async_rl.tasks.base import EVAL_ID_OFFSET, EpochSampler, Prompt, RewardFn
from async_rl.tasks.rewards import load_reward_fn

ROLES = ("system", "user", "assistant")

Row = tuple[str, str, "tuple[tuple[str, str], ...] | None", dict[str, Any]]  # (text, answer, chat, fields)


def messages_of(value: object, where: str, column: str = "messages") -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: '{column}' must be a non-empty list of {{'role', 'content'}} objects")
    turns = []
    for k, turn in enumerate(value):
        if not isinstance(turn, Mapping) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: {column}[{k}] must be {{'role': one of {'/'.join(ROLES)}, "
                             "'content': string}")
        turns.append((turn["role"], turn["content"]))
    if turns[-1][0] != "user":
        raise ValueError(f"{where}: {column}: the last message must be the user's turn (the model answers it)")
    return tuple(turns)


def row_of(obj: Mapping[str, Any], where: str, *, prompt: str | tuple[str, ...] = ("prompt", "messages"),
           answer: str = "answer", answer_required: bool = True) -> Row:
    """The row's prompt (the first of the `prompt` columns present: a string, or a chat),
    its answer, and its other columns. One line naming `where` for anything amiss."""
    names = (prompt,) if isinstance(prompt, str) else prompt
    column = next((name for name in names if name in obj), None)
    if column is None:
        raise ValueError(f"{where}: no {' or '.join(repr(n) for n in names)} (the prompt)")
    value, messages = obj[column], None
    if isinstance(value, list):
        messages = messages_of(value, where, column)
        text = messages[-1][1]
    elif isinstance(value, str) and value:
        text = value
    else:
        raise ValueError(f"{where}: {column!r} must be a non-empty string or a chat (a list of messages)")
    if answer in obj:
        value = obj[answer]
        # bool is an int subclass; True as an answer is almost surely a mistake.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ValueError(f"{where}: {answer!r} must be a string (or a number)")
    elif answer_required:
        raise ValueError(f"{where}: no {answer!r} (the answer the reward compares with)")
    else:
        value = ""
    fields = {k: v for k, v in obj.items() if k not in (*names, answer)}
    return text, value, messages, fields


def with_fields(reward: Callable[..., float]) -> Callable[..., float]:
    """`reward(prompt, response, answer, **fields)` passing on only the fields the
    function takes: those it names, or all with **kwargs; none to f(prompt, response, answer)."""
    try:
        params = list(inspect.signature(reward).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the three arguments
        params = []
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return reward
    named = {p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not named:
        return lambda prompt, response, answer, **fields: reward(prompt, response, answer)

    def call(prompt: str, response: str, answer: str, **fields: Any) -> float:
        return reward(prompt, response, answer, **{k: v for k, v in fields.items() if k in named})

    return call


def held_out(rows: list[Row], fraction: float, eval_seed: int, source: str, key: str,
             fraction_key: str = "eval_fraction") -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows): a fixed `fraction` chosen by `eval_seed`
    (independent of the run's seed, so every seed is evaluated on the same prompts),
    both parts in their original order (the epoch sampler shuffles the training order)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{source}: {fraction_key} must be in (0, 1), got {fraction}")
    n_eval = math.ceil(fraction * len(rows))
    if n_eval >= len(rows):
        raise ValueError(f"{source}: {len(rows)} prompt(s) is too few to hold out {fraction:.0%} for evaluation;"
                         f" add prompts or give {key}")
    eval_idx = set(np.random.default_rng([eval_seed, 0x5E1]).permutation(len(rows))[:n_eval].tolist())
    return ([r for i, r in enumerate(rows) if i not in eval_idx], [r for i, r in enumerate(rows) if i in eval_idx])


class RowsTask:
    """A task over rows held in memory: training prompts walk them epoch by epoch, each
    epoch in a seeded order; `reward` None where an environment scores the episodes."""

    def __init__(self, seed: int, train: list[Row], held: list[Row], reward: str | RewardFn | None) -> None:
        self.seed = int(seed)
        self._train, self._eval = train, held
        self._sampler = EpochSampler(len(train), self.seed)
        fn = load_reward_fn(reward) if isinstance(reward, str) else reward
        if fn is not None and not callable(fn):
            raise ValueError(f"reward must be a 'module:function' spec or a callable, got {reward!r}")
        self._reward = with_fields(fn) if fn is not None else None

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_prompt(self, index: int) -> Prompt:
        return Prompt(index, *self._train[self._sampler(index)])

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(EVAL_ID_OFFSET + k, *row) for k, row in enumerate(self._eval)]

    def reward(self, prompt: str, response: str, answer: str, **fields: Any) -> float:
        if self._reward is None:
            raise RuntimeError("this task has no reward: its episodes are scored by the environment (env.name)")
        return self._reward(prompt, response, answer, **fields)  # checked by the caller (prepare, actors)
