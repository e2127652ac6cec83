"""Users' tasks: prompts and answers from JSONL, reward from a spec (see load_reward_fn).

Each non-blank line is an object with an ``answer`` (a string; a number is accepted
and turned into its text) and either a ``prompt`` (a string) or ``messages`` (a chat:
a list of ``{"role": "system" | "user" | "assistant", "content": str}`` ending with a
user turn), as in the chat datasets of TRL and verl. Other keys become the prompt's
`fields` (rows.py), for the environment and for a reward that names them, so files
written for other tools load as they are. The answer may be left out where an
environment scores the episodes (no reward given). Held-out prompts come from ``eval_path``
when given, else a fixed fraction of the file chosen by ``eval_seed`` (independent
of the run seed, so every seed is evaluated on the same prompts).
"""

from __future__ import annotations

import json
from pathlib import Path

from async_rl.tasks.base import RewardFn
from async_rl.tasks.rows import Row, RowsTask, held_out, row_of

DEFAULT_REWARD = "async_rl.tasks.arithmetic:exact_match"


def read_jsonl(path: str | Path, answer_required: bool = True) -> list[Row]:
    """Read ``(text, answer, messages, fields)`` rows; a bad line raises ValueError naming
    file and line."""
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
        rows.append(row_of(obj, where, prompt=("messages", "prompt"), answer_required=answer_required))
    if not rows:
        raise ValueError(f"{path}: no prompts in file")
    return rows


class JsonlTask(RowsTask):
    """Training prompts walk the file epoch by epoch, each epoch in a seeded order."""

    def __init__(
        self,
        *,
        seed: int,
        path: str | Path,
        eval_path: str | Path | None = None,
        eval_fraction: float = 0.1,
        eval_seed: int = 0,
        reward: str | RewardFn | None = DEFAULT_REWARD,
    ) -> None:
        rows = read_jsonl(path, answer_required=reward is not None)
        if eval_path is not None:
            train_rows, eval_rows = rows, read_jsonl(eval_path, answer_required=reward is not None)
        else:
            train_rows, eval_rows = held_out(rows, eval_fraction, eval_seed, str(path), "eval_path")
        self.path = Path(path)
        super().__init__(seed, train_rows, eval_rows, reward)
