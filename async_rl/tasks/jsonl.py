"""Users' tasks: prompts and answers from JSONL, reward from a spec (see load_reward_fn).

Each non-blank line is an object with an ``answer`` (a string; a number is accepted
and turned into its text) and either a ``prompt`` (a string) or ``messages`` (a chat:
a list of ``{"role": "system" | "user" | "assistant", "content": str}`` ending with a
user turn), as in the chat datasets of TRL and verl. Other keys are ignored, so files
written for other tools load as they are. Held-out prompts come from ``eval_path``
when given, else a fixed fraction of the file chosen by ``eval_seed`` (independent
of the run seed, so every seed is evaluated on the same prompts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from async_rl.tasks.base import EVAL_ID_OFFSET, EpochSampler, Prompt, RewardFn
from async_rl.tasks.rewards import load_reward_fn

DEFAULT_REWARD = "async_rl.tasks.arithmetic:exact_match"


Row = tuple[str, str, "tuple[tuple[str, str], ...] | None"]  # (question text, answer, chat turns)
ROLES = ("system", "user", "assistant")


def _messages(value: object, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    turns = []
    for k, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: messages[{k}] must be {{'role': one of {'/'.join(ROLES)}, 'content': string}}")
        turns.append((turn["role"], turn["content"]))
    if turns[-1][0] != "user":
        raise ValueError(f"{where}: the last message must be the user's turn (the model answers it)")
    return tuple(turns)


def read_jsonl(path: str | Path) -> list[Row]:
    """Read ``(text, answer, messages)`` rows; a bad line raises ValueError naming file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read task file ({exc.strerror or exc})") from exc
    rows: list[Row] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with 'answer' and 'prompt' or 'messages'")
        messages = None
        if "messages" in obj:
            messages = _messages(obj["messages"], where)
            prompt = messages[-1][1]
        else:
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: 'prompt' must be a non-empty string (or give 'messages')")
        answer = obj.get("answer")
        # bool is an int subclass; True as an answer is almost surely a mistake.
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ValueError(f"{where}: 'answer' must be a string (or a number)")
        rows.append((prompt, answer, messages))
    if not rows:
        raise ValueError(f"{path}: no prompts in file")
    return rows


class JsonlTask:
    """Training prompts walk the file epoch by epoch, each epoch in a seeded order."""

    def __init__(
        self,
        *,
        seed: int,
        path: str | Path,
        eval_path: str | Path | None = None,
        eval_fraction: float = 0.1,
        eval_seed: int = 0,
        reward: str | RewardFn = DEFAULT_REWARD,
    ) -> None:
        rows = read_jsonl(path)
        if eval_path is not None:
            train_rows, eval_rows = rows, read_jsonl(eval_path)
        else:
            train_rows, eval_rows = self._split(rows, eval_fraction, eval_seed, path)
        self.path = Path(path)
        self.seed = int(seed)
        self._train = train_rows
        self._eval = eval_rows
        self._sampler = EpochSampler(len(train_rows), self.seed)
        self._reward: Callable[[str, str, str], float] = (
            load_reward_fn(reward) if isinstance(reward, str) else reward
        )
        if not callable(self._reward):
            raise ValueError(f"jsonl task: reward must be a 'module:function' spec or a callable, got {reward!r}")

    @staticmethod
    def _split(rows: list[Row], fraction: float, eval_seed: int, path: str | Path) -> tuple[list[Row], list[Row]]:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"jsonl task: eval_fraction must be in (0, 1), got {fraction}")
        n_eval = math.ceil(fraction * len(rows))
        if n_eval >= len(rows):
            raise ValueError(
                f"{path}: {len(rows)} prompt(s) is too few to hold out {fraction:.0%} for evaluation;"
                " add prompts or give eval_path"
            )
        order = np.random.default_rng([eval_seed, 0x5E1]).permutation(len(rows))
        # Keep both parts in file order: easier to inspect, and the training order is
        # reshuffled by the epoch sampler anyway.
        eval_idx = set(order[:n_eval].tolist())
        train = [r for i, r in enumerate(rows) if i not in eval_idx]
        held = [r for i, r in enumerate(rows) if i in eval_idx]
        return train, held

    @property
    def num_train(self) -> int:
        return len(self._train)

    def train_prompt(self, index: int) -> Prompt:
        return Prompt(index, *self._train[self._sampler(index)])

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(EVAL_ID_OFFSET + k, *row) for k, row in enumerate(self._eval)]

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return self._reward(prompt, response, answer)  # checked by the caller (prepare, actors)
