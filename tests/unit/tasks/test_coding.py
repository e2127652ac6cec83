"""The built-in coding task: seeded prompts naming a function, tests computed from a
reference solution that passes them in the real sandbox (also from inside a reward
worker), and held-out prompts from families training never draws."""
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pydantic import TypeAdapter

from async_rl.rewards.pool import Call, RewardPool
from async_rl.tasks import EVAL_ID_OFFSET, CodingTask, WithReward, make_task, task_from_config
from async_rl.tasks.coding import HELD_OUT_FAMILIES, MIN_TESTS, TESTS_PER_PROMPT, TRAIN_FAMILIES, pose
from async_rl.tasks.config import TaskConfig


def function_name(prompt) -> str:
    return re.match(r"Write a Python function `(\w+)\(", prompt.text).group(1)


def reference_code(prompt) -> str:
    return re.fullmatch(r"```python\n(.*)```", prompt.answer, re.DOTALL).group(1)


def test_prompts_are_deterministic_and_name_the_function():
    task = make_task("coding", seed=3, eval_size=16)
    again = CodingTask(seed=3, eval_size=16)
    for i in range(200):
        p = task.train_prompt(i)
        assert p == again.train_prompt(i) and p.id == i and p.fields == again.train_prompt(i).fields
        name = function_name(p)
        assert p.text.endswith("in a ```python code block.") and f"`{name}(" in p.text.split("\n")[1]
        assert MIN_TESTS <= len(p.fields["tests"]) <= TESTS_PER_PROMPT
        assert all(t.startswith(f"assert {name}(") for t in p.fields["tests"])
        assert p.answer not in p.text
    assert task.train_prompt(5) != make_task("coding", seed=4).train_prompt(5)
    assert len({task.train_prompt(i).text for i in range(200)}) > 190  # many distinct prompts


def test_every_reference_solution_passes_its_own_tests():
    """In this process (our own code): fast, so over many prompts of every family."""
    task = CodingTask(seed=1, eval_size=256)
    for prompt in [task.train_prompt(i) for i in range(1000)] + task.eval_prompts():
        scope = {}
        exec(reference_code(prompt), scope)  # noqa: S102 - the task's own reference solution
        for test in prompt.fields["tests"]:
            exec(test, scope)  # noqa: S102


def test_held_out_prompts_come_from_families_never_trained_on():
    task = CodingTask(seed=0, eval_size=200)
    held = task.eval_prompts()
    assert len(held) == 200 and held[0].id == EVAL_ID_OFFSET and held[-1].id == EVAL_ID_OFFSET + 199
    assert held == CodingTask(seed=9, eval_size=200).eval_prompts()  # the same for every run seed
    assert [p.fields for p in held] == [p.fields for p in CodingTask(seed=9, eval_size=200).eval_prompts()]
    trained = {function_name(task.train_prompt(i)) for i in range(3000)}
    held_names = {function_name(p) for p in held}
    assert not trained & held_names
    rng = np.random.default_rng(0)
    for families, names in ((TRAIN_FAMILIES, trained), (HELD_OUT_FAMILIES, held_names)):
        assert all(family(rng).name in names for family in families)  # every family shows up where it belongs
    with pytest.raises(ValueError, match="eval_size"):
        CodingTask(seed=0, eval_size=0)


def test_reference_solutions_pass_in_the_sandbox_and_wrong_ones_do_not():
    """One problem of every family plus a few task prompts, scored by the task's reward."""
    task = CodingTask(seed=5, eval_size=8)
    rng = np.random.default_rng(5)
    posed = [pose(family(rng), rng) for family in TRAIN_FAMILIES + HELD_OUT_FAMILIES]
    posed += [(p.text, p.answer, p.fields["tests"]) for p in [task.train_prompt(0), task.eval_prompts()[0]]]
    with ThreadPoolExecutor(2) as threads:  # the sandbox runs two at a time
        scores = list(threads.map(lambda q: task.reward(q[0], q[1], q[1], tests=q[2]), posed))
    assert scores == [1.0] * len(posed)
    prompt = task.train_prompt(0)
    wrong = f"```python\ndef {function_name(prompt)}(*args):\n    return None\n```"
    assert task.reward(prompt.text, wrong, prompt.answer, **prompt.fields) < 1.0
    assert task.reward(prompt.text, reference_code(prompt), prompt.answer, **prompt.fields) == 0.0  # no code block


def test_the_config_section_and_a_reward_that_names_the_tests():
    section = TypeAdapter(TaskConfig).validate_python({"name": "coding", "eval_size": 4,
                                                       "reward": "code_tests_all_pass"})
    task = task_from_config(section, seed=0)
    assert isinstance(task, WithReward) and len(task.eval_prompts()) == 4
    prompt = task.train_prompt(0)
    assert task.reward(prompt.text, prompt.answer, prompt.answer, **prompt.fields) == 1.0


def test_a_reward_worker_scores_the_reference_answer_in_the_sandbox():
    task = CodingTask(seed=0, eval_size=4)
    prompt = task.eval_prompts()[0]
    with RewardPool({"name": "coding", "eval_size": 4}, 0, processes=1, timeout_s=10) as pool:
        scores = pool.score([Call(prompt.text, prompt.answer, prompt.answer, prompt.fields),
                             Call(prompt.text, "no code here", prompt.answer, prompt.fields)])
    assert scores == [1.0, 0.0]
