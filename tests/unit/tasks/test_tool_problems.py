"""The built-in tool-use task: deterministic problems with correct answers, a fixed
held-out set, and a chat that shows the calculator's format once."""
import re

import pytest

from async_rl.actor.environments.calculator import evaluate
from async_rl.tasks import EVAL_ID_OFFSET, ToolProblemsTask, make_task
from async_rl.tasks.tool_problems import EXAMPLE, SYSTEM


def test_prompts_are_deterministic_answers_correct_and_the_example_teaches_the_tool():
    task = make_task("tool_problems", seed=3, eval_size=64)
    again = ToolProblemsTask(seed=3, eval_size=64)
    for i in range(200):
        p = task.train_prompt(i)
        assert p == again.train_prompt(i) and p.id == i
        assert p.messages == (("system", SYSTEM), *EXAMPLE, ("user", p.text))
        a, b, *rest = (int(x) for x in re.findall(r"\d+", p.text))
        expected = a * b + (0 if not rest else rest[0] if "more" in p.text else -rest[0])
        assert int(p.answer) == expected
    shown = EXAMPLE[1][1]  # the worked example is itself right
    assert f"<result>{evaluate(shown[len('<calc>'):-len('</calc>')])}</result>" == EXAMPLE[2][1]
    assert task.train_prompt(5) != make_task("tool_problems", seed=4).train_prompt(5)


def test_held_out_set_is_fixed_disjoint_and_numbered():
    task = ToolProblemsTask(seed=0, eval_size=100)
    held = task.eval_prompts()
    assert len({p.text for p in held}) == 100 and held[0].id == EVAL_ID_OFFSET
    assert held == ToolProblemsTask(seed=7, eval_size=100).eval_prompts()
    texts = {p.text for p in held}
    assert not any(task.train_prompt(i).text in texts for i in range(3000))
    with pytest.raises(ValueError, match="eval_size"):
        ToolProblemsTask(seed=0, eval_size=0)
