"""The built-in calculator environment: arithmetic evaluated node by node within its
limits, anything else refused as the policy's error; a turn without a call is scored
by the task's reward."""
import pytest

from async_rl.actor.environments.calculator import (
    MAX_EXPRESSION_CHARS,
    Calculator,
    CalculatorError,
    evaluate,
    first_call,
    format_value,
)
from async_rl.actor.environments.registry import environment_factory
from async_rl.tasks.base import Prompt


@pytest.mark.parametrize("expression,value", [
    ("37 * 24", 888), ("(3 + 4) * -2", -14), ("7 / 2", 3.5), ("7 // 2", 3), ("2 ** 10", 1024), ("17 % 5", 2),
    (" 1.5 + 1.5 ", 3.0),
])
def test_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('ls')", "not allowed"), ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "not allowed"), ("[1, 2]", "not allowed"), ("'a' * 3", "not allowed"), ("1 if 1 else 2", "not allowed"),
    ("9 ** 999", "exponent beyond"), ("10 ** 60 * 10 ** 60", "out of range"), ("1 / 0", "division by zero"),
    ("(-8) ** 0.5", "out of range"), ("1 +", "not an arithmetic"), ("1" * (MAX_EXPRESSION_CHARS + 1), "longer than"),
])
def test_anything_else_is_refused(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_a_call_is_answered_and_a_plain_turn_is_the_scored_final_answer():
    scored = []

    def score(prompt, response, answer):
        scored.append((prompt, response, answer))
        return float(response.strip().endswith(answer))

    env = environment_factory("calculator", type("Task", (), {"reward": staticmethod(score)})())(
        Prompt(id=0, text="What is 37 * 24?", answer="888"))
    assert isinstance(env, Calculator)
    turn = env.step("Let me compute. <calc>37 * 24</calc>")
    assert turn.messages == [{"role": "user", "content": "<result>888</result>"}] and not turn.done
    assert turn.reward is None
    assert env.step("<calc>1/0</calc>").messages[0]["content"] == "<error>division by zero</error>"
    final = env.step("The answer is 888")
    assert final.done and final.reward == 1.0 and scored == [("What is 37 * 24?", "The answer is 888", "888")]


def test_values_print_as_a_person_writes_them():
    assert [format_value(v) for v in (3.0, 2.5, 1 / 3, 12, 0.1 + 0.2)] == ["3", "2.5", "0.333333333333", "12", "0.3"]


def test_small_values_keep_their_value():
    assert format_value(evaluate("2**-64")) == "5.42101086243e-20"
    assert float(format_value(evaluate("1/3 * 1e-9"))) == pytest.approx(1 / 3 * 1e-9, rel=1e-11)


def test_the_first_complete_call_is_found_in_linear_time():
    assert first_call("a <calc>1+2</calc> b <calc>3</calc>") == "1+2"
    assert first_call("<calc><calc>1</calc>") == "<calc>1"  # as the regex's leftmost lazy match
    assert first_call("no call") is None and first_call("<calc>1+2") is None
    # Unclosed tags: the regex this replaces took 19 s on 20,000 of them (quadratic);
    # counting the characters searched keeps the check independent of the CPU's speed.
    class Counting(str):
        scanned = 0

        def find(self, sub, start=0, *args):
            found = str.find(self, sub, start, *args)
            Counting.scanned += (len(self) if found < 0 else found + len(sub)) - start
            return found

    text = Counting("<calc>" * 20_000)
    assert first_call(text) is None and Counting.scanned <= 2 * len(text)


def test_an_unknown_environment_name_is_one_line():
    with pytest.raises(ValueError, match="env.name 'calc' must be a built-in environment"):
        environment_factory("calc", None)
    with pytest.raises(ValueError, match="env.name 'no_such_module:make': no module named"):
        environment_factory("no_such_module:make", None)
