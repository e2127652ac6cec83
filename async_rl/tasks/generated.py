"""Tasks whose prompts our own code draws (word_problems, tool_problems): a fixed
held-out set of distinct questions chosen by `eval_seed` (the same for every run seed),
and training prompts that are a pure function of (seed, index) and never a held-out
question."""
from __future__ import annotations

import numpy as np

from async_rl.tasks.base import EVAL_ID_OFFSET, Prompt


class GeneratedTask:
    NAME = "generated"
    EVAL_SALT = 0  # keeps each task's held-out draws its own

    def __init__(self, *, seed: int, eval_size: int, eval_seed: int = 0) -> None:
        if not 1 <= eval_size <= 5000:
            raise ValueError(f"{self.NAME}: eval_size must be in 1..5000, got {eval_size}")
        self.seed = int(seed)
        self._eval: list[tuple[str, str]] = []
        seen: set[str] = set()
        rng = np.random.default_rng([eval_seed, self.EVAL_SALT])
        while len(self._eval) < eval_size:
            question, answer = self._draw(rng)
            if question not in seen:
                seen.add(question)
                self._eval.append((question, answer))
        self._reserved = seen

    def _draw(self, rng: np.random.Generator) -> tuple[str, str]:
        """One (question, answer)."""
        raise NotImplementedError

    def _prompt(self, prompt_id: int, question: str, answer: str) -> Prompt:
        return Prompt(id=prompt_id, text=question, answer=answer)

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        while True:  # the held-out set is a tiny part of the space: this loop almost always runs once
            question, answer = self._draw(rng)
            if question not in self._reserved:
                return self._prompt(index, question, answer)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(EVAL_ID_OFFSET + k, q, a) for k, (q, a) in enumerate(self._eval)]
