"""Built-in task for chat models: small arithmetic questions and one-step word problems.

    "What is 14 - 9? Answer with just the number."                     -> "5"
    "Mia has 8 coins and gets 12 more. How many coins does Mia have now?
     Answer with just the number."                                      -> "20"

Made by our own code, so a real pretrained model can be trained and evaluated with
nothing downloaded. Scored with the `last_number` reward: chat models tend to answer
in a sentence ("14 - 9 = 5") or to ramble on after the answer, and the last number of
the response is what a reader would take as its answer. The held-out set is a fixed
sample chosen by `eval_seed` (the same for every run seed); training never yields a
question whose text is in it. Training prompts are a pure function of (seed, index).
"""
from __future__ import annotations

import numpy as np

from async_rl.tasks.generated import GeneratedTask
from async_rl.tasks.rewards import last_number

INSTRUCTION = " Answer with just the number."
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max", "Ella")
THINGS = ("apples", "books", "pens", "cards", "marbles", "coins", "stickers", "shells", "cookies", "stamps")


def _plus(a: int, b: int, name: str, thing: str) -> tuple[str, int]:
    return f"What is {a} + {b}?", a + b


def _minus(a: int, b: int, name: str, thing: str) -> tuple[str, int]:
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def _gets_more(a: int, b: int, name: str, thing: str) -> tuple[str, int]:
    return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b


def _gives_away(a: int, b: int, name: str, thing: str) -> tuple[str, int]:
    a, b = max(a, b), min(a, b)
    return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b


def _two_boxes(a: int, b: int, name: str, thing: str) -> tuple[str, int]:
    return f"One box holds {a} {thing} and another holds {b}. How many {thing} are there in all?", a + b


# (template, weight): bare sums and differences, and the same in words.
TEMPLATES = ((_plus, 0.3), (_minus, 0.2), (_gets_more, 0.2), (_gives_away, 0.2), (_two_boxes, 0.1))


class WordProblemsTask(GeneratedTask):
    """Operands 1..`max_operand`; differences are never negative."""

    NAME, EVAL_SALT = "word_problems", 0x3A7

    def __init__(self, *, seed: int, eval_size: int = 256, eval_seed: int = 0, max_operand: int = 20,
                 instruction: str = INSTRUCTION) -> None:
        if max_operand < 2:
            raise ValueError(f"word_problems: max_operand must be >= 2, got {max_operand}")
        self.max_operand, self.instruction = max_operand, instruction
        self._weights = np.array([w for _, w in TEMPLATES])
        super().__init__(seed=seed, eval_size=eval_size, eval_seed=eval_seed)

    def _draw(self, rng: np.random.Generator) -> tuple[str, str]:
        template = TEMPLATES[int(rng.choice(len(TEMPLATES), p=self._weights))][0]
        a, b = (int(x) for x in rng.integers(1, self.max_operand + 1, size=2))
        question, answer = template(a, b, NAMES[int(rng.integers(len(NAMES)))], THINGS[int(rng.integers(len(THINGS)))])
        return question + self.instruction, str(answer)

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return last_number(prompt, response, answer)
