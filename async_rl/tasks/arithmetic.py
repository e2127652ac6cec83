"""Built-in task: addition of two ``digits``-digit numbers, e.g. ``"37+45="`` -> ``"82"``.

The held-out set is a fixed sample of ``eval_size`` ordered pairs chosen by
``eval_seed`` (not by the run seed, so runs with different seeds are scored on the
same questions). Training never yields an eval pair in either order: holding out
``45+37`` as well as ``37+45`` keeps commutativity from leaking the answer.
Training prompts are drawn i.i.d. by a generator seeded with ``(seed, index)``; that
needs no table of all pairs, so it scales to any number of digits.
"""

from __future__ import annotations

import numpy as np

from async_rl.tasks.base import EVAL_ID_OFFSET, Prompt


def exact_match(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return 1.0 if response.strip() == answer.strip() else 0.0


class ArithmeticTask:
    """``a+b=`` with both operands having exactly ``digits`` digits (0-9 for one digit)."""

    def __init__(self, *, seed: int, digits: int = 2, eval_size: int = 256, eval_seed: int = 0) -> None:
        if not 1 <= digits <= 9:
            raise ValueError(f"arithmetic: digits must be in 1..9, got {digits}")
        self.seed = int(seed)
        self.digits = digits
        # A one-digit operand may be 0; longer operands have no leading zeros so the
        # prompt length is fixed and the text never contains "07".
        self.low = 0 if digits == 1 else 10 ** (digits - 1)
        self.span = 10**digits - self.low
        self.num_pairs = self.span * self.span
        # Reserving both orders removes up to 2*eval_size pairs; demand that most of
        # the space stays available for training.
        if not 1 <= eval_size <= self.num_pairs // 4:
            raise ValueError(
                f"arithmetic: eval_size must be in 1..{self.num_pairs // 4} for digits={digits}, got {eval_size}"
            )
        self.eval_size = eval_size
        self._eval_pairs = self._choose_eval_pairs(eval_size, eval_seed)
        self._reserved = {p for a, b in self._eval_pairs for p in (self._code(a, b), self._code(b, a))}

    # Longest answer (digits+1 characters) plus an end-of-sequence token: a sensible
    # generation budget for callers.
    @property
    def max_new_tokens(self) -> int:
        return self.digits + 2

    def _code(self, a: int, b: int) -> int:
        return (a - self.low) * self.span + (b - self.low)

    def _decode(self, code: int) -> tuple[int, int]:
        i, j = divmod(code, self.span)
        return i + self.low, j + self.low

    def _choose_eval_pairs(self, size: int, eval_seed: int) -> list[tuple[int, int]]:
        rng = np.random.default_rng([eval_seed, 0xE7A1])
        seen: set[int] = set()
        pairs: list[tuple[int, int]] = []
        while len(pairs) < size:
            code = int(rng.integers(self.num_pairs))
            a, b = self._decode(code)
            # Skip a pair whose mirror is already in: both orders would be eval.
            if code in seen or self._code(b, a) in seen:
                continue
            seen.add(code)
            pairs.append((a, b))
        return pairs

    def _prompt(self, pid: int, a: int, b: int) -> Prompt:
        return Prompt(id=pid, text=f"{a}+{b}=", answer=str(a + b))

    def train_prompt(self, index: int) -> Prompt:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        # Rejection sampling: at most a few percent of pairs are reserved, so this
        # loop almost always runs once.
        while True:
            code = int(rng.integers(self.num_pairs))
            if code not in self._reserved:
                return self._prompt(index, *self._decode(code))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(EVAL_ID_OFFSET + k, a, b) for k, (a, b) in enumerate(self._eval_pairs)]

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return exact_match(prompt, response, answer)
