import pytest

from async_rl.sandbox import extract_code, score_code

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]


def test_extract_code_takes_the_last_python_block():
    response = "First:\n```python\nx = 1\n```\nthen\n```bash\nls\n```\nfinally:\n```py\nx = 2\n```\ndone"
    assert extract_code(response) == "x = 2\n"


def test_extract_code_prefers_a_python_block_over_a_later_plain_one():
    response = "```python\nx = 1\n```\n```\noutput: 1\n```"
    assert extract_code(response) == "x = 1\n"


def test_extract_code_falls_back_to_a_plain_block_and_dedents_it():
    response = "1. Do this:\n   ```\n   def f():\n       return 1\n   ```\n"
    assert extract_code(response) == "def f():\n    return 1\n"


@pytest.mark.parametrize("response", [
    "no code here", "```bash\necho hi\n```", "inline ```python x = 1``` only", "```python\nnever closed\n",
])
def test_extract_code_finds_none(response):
    assert extract_code(response) is None


def test_all_asserts_pass(sandbox):
    result = score_code(ADD, ADD_TESTS, sandbox)
    assert (result.passed, result.total, result.fraction, result.all_passed) == (3, 3, 1.0, True)
    assert result.first_failure == ""
    assert result.execution.status == "ok"


def test_failing_asserts_count_and_the_first_failure_is_named(sandbox):
    code = "def add(a, b):\n    return a - b\n"
    result = score_code(code, ADD_TESTS + ["assert add(2, 0) == 2"], sandbox)
    assert (result.passed, result.total, result.all_passed) == (1, 4, False)  # only add(2, 0)
    assert result.fraction == 0.25
    assert result.first_failure == "assert add(1, 2) == 3: AssertionError"


def test_an_error_inside_a_test_is_its_failure_message(sandbox):
    result = score_code(ADD, ["assert add(1, 2) == 3", "assert add(1) == 1"], sandbox)
    assert result.passed == 1
    assert result.first_failure.startswith("assert add(1) == 1: TypeError: add() missing 1 required positional")


def test_code_that_does_not_compile_scores_zero_without_running(sandbox):
    result = score_code("def add(a, b)\n    return a + b\n", ADD_TESTS, sandbox)
    assert (result.passed, result.total, result.execution) == (0, 3, None)
    assert result.first_failure.startswith("the code does not compile: SyntaxError: ")
    assert "(line 1)" in result.first_failure


def test_printed_imitations_of_results_count_for_nothing(sandbox):
    forger = ADD.replace("a + b", "None") + (
        "import json\n"
        "for i in range(3):\n"
        "    print(json.dumps({'test': i}))\n"
        "    print('ok', i, 'passed')\n")
    result = score_code(forger, ADD_TESTS, sandbox)
    assert result.passed == 0


def test_the_code_exiting_at_the_top_still_gets_tested(sandbox):
    result = score_code(ADD + "import sys\nsys.exit(0)\n", ADD_TESTS, sandbox)
    assert result.all_passed


def test_an_exception_at_the_top_is_reported_and_the_tests_still_run(sandbox):
    result = score_code(ADD + "input()\n", ADD_TESTS, sandbox)  # stdin is empty: EOFError
    assert result.all_passed
    broken = score_code("raise RuntimeError('no')\n" + ADD, ADD_TESTS, sandbox)
    assert broken.passed == 0
    assert broken.first_failure.startswith("the code raised RuntimeError: no before the tests; assert add(1, 2) == 3:")


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_a_test_that_hangs_keeps_the_results_before_it(sandbox):
    code = ADD + "def spin():\n    while True:\n        pass\n"
    tests = ["assert add(1, 2) == 3", "assert spin()", "assert add(2, 2) == 4"]
    result = score_code(code, tests, sandbox, timeout_s=1.5)
    assert (result.passed, result.total) == (1, 3)
    assert result.first_failure == "assert spin(): not run, the run timed out"
    assert result.execution.status == "timeout"


def test_a_program_that_ends_itself_fails_the_rest(sandbox):
    code = ADD + "import os\ndef leave():\n    os._exit(0)\n"
    result = score_code(code, ["assert add(1, 2) == 3", "leave()", "assert add(2, 2) == 4"], sandbox)
    assert result.passed == 1
    assert result.first_failure == "leave(): not run, the program ended (exit code 0)"


SUM_LINE = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"


def test_stdin_stdout_cases_compare_stripped_output(sandbox):
    cases = [{"input": "1 2", "output": "3"}, {"input": "5\n5\n", "output": "  10  \n\n"}]
    result = score_code(SUM_LINE, cases, sandbox)
    assert (result.passed, result.total, result.first_failure) == (2, 2, "")


def test_a_wrong_answer_names_the_case_and_both_outputs(sandbox):
    cases = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}, {"input": "0", "output": "0"}]
    result = score_code(SUM_LINE, cases, sandbox)
    assert (result.passed, result.total) == (2, 3)
    assert result.first_failure == "case 1: expected '5', got '4'"
    assert result.execution.stdout == "4\n"


def test_a_crashing_case_fails_with_how_it_ended(sandbox):
    cases = [{"input": "1", "output": "1"}, {"input": "0", "output": "0"}]
    result = score_code("print(1 // int(input()))", cases, sandbox)
    assert result.passed == 1
    assert result.first_failure == "case 1: the program ended (exit code 1) (ZeroDivisionError: integer division or " \
                                   "modulo by zero)"


@pytest.mark.parametrize("tests", [[], "assert True", [{"input": "1"}], ["assert True", {"input": "", "output": ""}]])
def test_malformed_tests_are_refused(sandbox, tests):
    with pytest.raises(ValueError, match="tests"):
        score_code(ADD, tests, sandbox)
