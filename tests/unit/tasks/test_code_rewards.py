"""The code_tests rewards: a response's code run against a row's tests in the real
sandbox, whatever form the tests arrive in; hostile code ends at the sandbox's deadline;
bad tests are an error, never a silent 0."""
import json
import time

import pytest

from async_rl.tasks import make_task
from async_rl.tasks.code_rewards import LIMITS, code_tests, code_tests_all_pass, parse_tests

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


def test_the_fraction_of_tests_passed_and_all_or_nothing():
    right, half_right = fenced("def add(a, b):\n    return a + b\n"), fenced("def add(a, b):\n    return a * 2\n")
    assert code_tests("q", right, "", ADD_TESTS) == 1.0
    assert code_tests_all_pass("q", right, "", tests=ADD_TESTS) == 1.0
    assert code_tests("q", half_right, "", json.dumps(ADD_TESTS)) == pytest.approx(1 / 3)  # only add(2, 2)
    assert code_tests_all_pass("q", half_right, "", ADD_TESTS) == 0.0


def test_stdin_stdout_cases_as_a_json_string():
    cases = json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}])
    program = fenced("a, b = map(int, input().split())\nprint(a + b)\n")
    assert parse_tests(cases) == [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
    assert code_tests("q", program, "", cases) == 1.0


def test_a_response_without_a_code_block_scores_zero_without_running():
    started = time.monotonic()
    assert code_tests("q", "def add(a, b): return a + b", "", ADD_TESTS) == 0.0
    assert code_tests_all_pass("q", "", "", ADD_TESTS) == 0.0
    assert time.monotonic() - started < 0.1


@pytest.mark.parametrize(("tests", "needle"), [
    (None, "no 'tests' field"),
    ("assert add(1, 2) == 3", "not JSON"),
    ('{"input": "1", "output": "1"}', "must be a list"),
    (5, "must be a list .*, got int"),
    ([], "empty list"),
    ("[]", "empty list"),
    (["assert add(1, 2) == 3", "  "], r"tests\[1\] is blank"),
    (["assert add(1, 2 == 3"], r"tests\[0\] is not valid Python"),
    ([{"input": "1", "output": 1}], r"tests\[0\] is neither an assert line nor"),
    (["assert True", {"input": "", "output": ""}], r"tests\[0\] is neither .* all tests must be of one kind"),
])
def test_malformed_tests_raise_one_line_whatever_the_response(tests, needle):
    for response in (fenced("def add(a, b):\n    return a + b\n"), "no code"):
        with pytest.raises(ValueError, match=needle) as raised:
            code_tests("q", response, "", tests)
        assert "\n" not in str(raised.value) and str(raised.value).startswith("code_tests: ")


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_code_that_spins_forever_in_one_test_keeps_the_tests_before_it():
    spins = fenced("def add(a, b):\n    if a == 2:\n        while True:\n            pass\n    return a + b\n")
    started = time.monotonic()
    assert code_tests("q", spins, "", ADD_TESTS) == pytest.approx(2 / 3)  # the third test never ends
    assert time.monotonic() - started < LIMITS.timeout_s + 1


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_code_that_waits_on_a_child_process_ends_at_the_deadline():
    sleeps = fenced('import os\nos.system("sleep 100")\n\ndef add(a, b):\n    return a + b\n')
    started = time.monotonic()
    assert code_tests("q", sleeps, "", ADD_TESTS) == 0.0
    assert time.monotonic() - started < LIMITS.timeout_s + 1


def test_rows_with_a_tests_column_are_scored_by_name(tmp_path):
    """task.reward=code_tests on the user's own rows: `tests` reaches the reward as a
    list or as the JSON string datasets often store."""
    rows = [{"prompt": f"Write add, take {k}.", "answer": "", "tests": ADD_TESTS if k % 2 else json.dumps(ADD_TESTS)}
            for k in range(10)]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = make_task("jsonl", seed=0, path=path, reward="code_tests")
    prompts = [task.train_prompt(i) for i in range(9)] + task.eval_prompts()
    assert {type(p.fields["tests"]) for p in prompts} == {list, str}
    right, wrong = fenced("def add(a, b):\n    return a + b\n"), fenced("def add(a, b):\n    return a * 2\n")
    for prompt in (next(p for p in prompts if isinstance(p.fields["tests"], kind)) for kind in (list, str)):
        assert task.reward(prompt.text, right, prompt.answer, **prompt.fields) == 1.0
        assert task.reward(prompt.text, wrong, prompt.answer, **prompt.fields) == pytest.approx(1 / 3)


@pytest.mark.parametrize("form", ["list", "json string"])
def test_a_dataset_with_a_tests_column(tmp_path, form):
    datasets = pytest.importorskip("datasets")
    tests = ADD_TESTS if form == "list" else json.dumps(ADD_TESTS)
    path = tmp_path / "code.parquet"
    datasets.Dataset.from_list([{"question": f"Write add ({k}).", "answer": "", "tests": tests}
                                for k in range(10)]).to_parquet(str(path))
    task = make_task("dataset", seed=0, path=path, prompt_column="question", reward="code_tests_all_pass")
    prompt = task.train_prompt(0)
    assert prompt.fields == {"tests": tests}
    assert task.reward(prompt.text, fenced("def add(a, b):\n    return a + b\n"), "", **prompt.fields) == 1.0
    assert task.reward(prompt.text, fenced("def add(a, b):\n    return 3\n"), "", **prompt.fields) == 0.0
