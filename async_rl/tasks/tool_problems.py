"""Built-in task for tool use (`task.name: tool_problems`, with `env.name: calculator`):
word problems whose arithmetic a small model gets wrong in its head, posed as a chat
in which one worked example shows the calculator's format.

    system     You have a calculator: write <calc>expression</calc> to use it. ...
    user       A shelf has 23 rows with 41 books in each row. How many books ...?
    assistant  <calc>23 * 41</calc>
    user       <result>943</result>
    assistant  943
    user       A crate holds 37 boxes and each box holds 24 pens. How many pens ...?  -> "888"

Problems multiply two numbers of two digits, some then add or take away a third: one
or two calls. Scored by the last number of the final turn (`last_number`). Held-out
and training prompts as generated.py draws them. Made by our own code: nothing downloaded.
"""
from __future__ import annotations

import numpy as np

from async_rl.tasks.base import Prompt
from async_rl.tasks.generated import GeneratedTask
from async_rl.tasks.rewards import last_number

SYSTEM = "You have a calculator: write <calc>expression</calc> to use it. Answer with just the number."
EXAMPLE = (("user", "A shelf has 23 rows with 41 books in each row. How many books are on the shelf?"),
           ("assistant", "<calc>23 * 41</calc>"), ("user", "<result>943</result>"), ("assistant", "943"))
NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max", "Ella")


def _crates(a, b, c, name):
    return f"A crate holds {a} boxes and each box holds {b} pens. How many pens are in the crate?", a * b


def _rows(a, b, c, name):
    return f"A hall has {a} rows of {b} seats. How many seats are in the hall?", a * b


def _school(a, b, c, name):
    return (f"A school has {a} classes of {b} students, and {c} students are absent today. "
            f"How many students are present?", a * b - c)


def _savings(a, b, c, name):
    return f"{name} saves {a} dollars a week for {b} weeks, then gets {c} dollars more. How much does {name} have?", \
        a * b + c


TEMPLATES = (_crates, _rows, _school, _savings)


class ToolProblemsTask(GeneratedTask):
    NAME, EVAL_SALT = "tool_problems", 0x70F

    def __init__(self, *, seed: int, eval_size: int = 200, eval_seed: int = 0) -> None:
        super().__init__(seed=seed, eval_size=eval_size, eval_seed=eval_seed)

    def _draw(self, rng: np.random.Generator) -> tuple[str, str]:
        template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        a, b = (int(x) for x in rng.integers(11, 100, size=2))
        c = int(rng.integers(1, 10))
        question, answer = template(a, b, c, NAMES[int(rng.integers(len(NAMES)))])
        return question, str(answer)

    def _prompt(self, prompt_id: int, question: str, answer: str) -> Prompt:
        return Prompt(id=prompt_id, text=question, answer=answer,
                      messages=(("system", SYSTEM), *EXAMPLE, ("user", question)))

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return last_number(prompt, response, answer)
