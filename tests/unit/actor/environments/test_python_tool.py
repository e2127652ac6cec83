"""The built-in Python tool: a call's code runs in the sandbox and its stdout, or why it
failed, is the answer; endless and hostile code is contained; a turn without a call is
scored by the task's reward."""
import os
import time
import uuid

import pytest
from conftest import tagged_processes

from async_rl.actor.environments.python_tool import PythonTool, PythonToolOptions, program
from async_rl.actor.environments.registry import environment_factory
from async_rl.tasks.base import Prompt

DEADLINE_S = 1


class RecordedSandbox:
    """The tool's sandbox, keeping each run's Execution to check what it left behind."""

    def __init__(self, sandbox):
        self.sandbox, self.runs = sandbox, []

    def run(self, code, **kwargs):
        self.runs.append(self.sandbox.run(code, **kwargs))
        return self.runs[-1]


def task_scoring(scored):
    def score(prompt, response, answer):
        scored.append((prompt, response, answer))
        return float(response.strip().endswith(answer))

    return type("Task", (), {"reward": staticmethod(score)})()


def make_tool(scored=None, **options):
    options = {"timeout_s": DEADLINE_S, **options}
    env = environment_factory("python", task_scoring([] if scored is None else scored), options)(
        Prompt(id=0, text="What is 1 + ... + 100?", answer="5050"))
    env.sandbox = RecordedSandbox(env.sandbox)
    return env


def answer(env, action):
    turn = env.step(action)
    assert not turn.done and turn.reward is None and [m["role"] for m in turn.messages] == ["user"]
    return turn.messages[0]["content"]


def test_a_call_answers_its_stdout_and_a_plain_turn_is_the_scored_final_answer():
    scored = []
    env = make_tool(scored)
    assert isinstance(env, PythonTool)
    assert answer(env, "Let me check. <python>print(sum(range(1, 101)))</python>") == "<output>5050</output>"
    assert answer(env, "<python>x = 1</python>") == "<output></output>"
    final = env.step("The answer is 5050")
    assert final.done and final.reward == 1.0 and final.messages == []
    assert scored == [("What is 1 + ... + 100?", "The answer is 5050", "5050")]


def test_calls_are_stateless_and_code_is_taken_out_of_a_markdown_fence():
    env = make_tool()
    answer(env, "<python>x = 41</python>")
    assert answer(env, "<python>\n```python\n    print(x + 1)\n```\n</python>") == \
        "<output>NameError: name 'x' is not defined</output>"
    assert program("\n    for i in range(2):\n        print(i)\n") == "for i in range(2):\n    print(i)\n"


def test_a_failure_answers_the_stdout_so_far_and_the_errors_last_line():
    env = make_tool()
    assert answer(env, "<python>print('partial')\n1 / 0</python>") == \
        "<output>partial\nZeroDivisionError: division by zero</output>"
    assert answer(env, "<python>def f(:</python>").startswith("<output>SyntaxError: ")
    assert answer(env, "<python>import sys; sys.exit(3)</python>") == "<output>exit status 3</output>"


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_an_endless_loop_times_out_by_the_deadline_and_the_episode_goes_on():
    env = make_tool()
    started = time.monotonic()
    said = answer(env, "<python>print('looping', flush=True)\nwhile True:\n    pass</python>")
    assert time.monotonic() - started <= DEADLINE_S + 1.0
    assert said == f"<output>looping\ntimed out after {DEADLINE_S}s</output>"
    assert answer(env, "<python>print(6 * 7)</python>") == "<output>42</output>"


def test_long_output_is_cut_with_a_marker():
    env = make_tool(max_output_chars=20)
    assert answer(env, "<python>print('x' * 100)</python>") == "<output>" + "x" * 20 + "...[truncated]</output>"
    flood = answer(env, "<python>import sys\nwhile True:\n    sys.stdout.write('y' * 4096)</python>")
    assert flood == "<output>" + "y" * 20 + "...[truncated]\nstopped: too much output</output>"
    long_error = answer(env, "<python>raise ValueError('z' * 1000)</python>")
    assert long_error.startswith("<output>ValueError: zzz") and len(long_error) < 250


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_a_shell_command_that_sleeps_is_killed_at_the_deadline():
    env = make_tool()
    started = time.monotonic()
    said = answer(env, '<python>import os; os.system("sleep 100")</python>')
    assert time.monotonic() - started <= DEADLINE_S + 1.0
    assert said == f"<output>timed out after {DEADLINE_S}s</output>"
    assert tagged_processes(env.sandbox.runs[-1].run_id) == []


def test_nothing_is_written_outside_the_run_directory(tmp_path):
    env = make_tool()
    if not env.sandbox.sandbox.isolation.namespaces:
        pytest.skip(f"needs namespaces, and here: {env.sandbox.sandbox.isolation.label}")
    outside = [str(tmp_path / "escaped.txt"), f"/etc/sandbox-test-{uuid.uuid4().hex}"]
    code = f"""for path in {outside!r}:
    try:
        open(path, 'w').write('escaped')
        print('written')
    except OSError as err:
        print('denied', type(err).__name__)
"""
    said = answer(env, f"<python>{code}</python>")
    assert said.count("denied") == len(outside) and "written" not in said, said
    assert not any(os.path.exists(path) for path in outside)


def test_defaults_and_sandbox_limits():
    options = PythonToolOptions.parse({})
    assert (options.timeout_s, options.memory_mb, options.max_output_chars) == (5.0, 512, 500)
    limits = PythonToolOptions.parse({"timeout_s": 2, "memory_mb": 256}).sandbox_limits()
    assert (limits.timeout_s, limits.cpu_s, limits.memory_mb) == (2.0, 2.0, 256)


@pytest.mark.parametrize("options,message", [
    ({"timeout": 5}, "env.name 'python': env.options has no option 'timeout' "
                     "(it takes timeout_s, memory_mb, max_output_chars)"),
    ({"timeout_s": 0}, "env.name 'python': env.options.timeout_s must be a positive number, got 0"),
    ({"timeout_s": "5"}, "env.name 'python': env.options.timeout_s must be a positive number, got '5'"),
    ({"timeout_s": float("inf")}, "env.name 'python': env.options.timeout_s must be a positive number, got inf"),
    ({"memory_mb": 1.5}, "env.name 'python': env.options.memory_mb must be a positive integer, got 1.5"),
    ({"max_output_chars": True}, "env.name 'python': env.options.max_output_chars must be a positive integer, "
                                 "got True"),
    ({"max_output_chars": -1}, "env.name 'python': env.options.max_output_chars must be a positive integer, "
                               "got -1"),
])
def test_a_bad_option_is_one_line(options, message):
    with pytest.raises(ValueError) as raised:
        environment_factory("python", task_scoring([]), options)
    assert str(raised.value) == message
