"""envs/guard.py: user environment code that fails is classified, counted and logged
once per reason; a well-formed Turn passes as it is."""
import logging
import math

import pytest

from async_rl.actor.environments.guard import EnvironmentGuard
from async_rl.actor.environments import Turn
from async_rl.actor.environments.guard import EnvironmentFailed
from async_rl.tasks.base import Prompt
from async_rl.user_code import REASONS

PROMPT = Prompt(id=0, text="q", answer="a")


class Replies:
    def __init__(self, value):
        self.value = value

    def step(self, action):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize("value,reason", [
    (RuntimeError("boom"), "raised"),
    ("done", "not_a_number"),
    (Turn([{"role": "user"}]), "not_a_number"),
    (Turn([("user", "x")]), "not_a_number"),
    (Turn(reward="1"), "not_a_number"),
    (Turn(reward=math.nan), "non_finite"),
    (Turn(reward=1e39), "non_finite"),
])
def test_a_bad_step_is_one_failure_of_its_reason(value, reason):
    guard = EnvironmentGuard(Replies)
    with pytest.raises(EnvironmentFailed) as info:
        guard.step(Replies(value), "action")
    assert info.value.reason == reason
    assert guard.failed(info.value) == 0.0
    assert guard.totals == [int(r == reason) for r in REASONS]


def test_a_good_turn_passes_and_a_bool_reward_counts_as_a_number():
    guard = EnvironmentGuard(lambda prompt: Replies(Turn([{"role": "tool", "content": "12"}], reward=True, done=True)))
    turn = guard.step(guard.start(PROMPT), "x")
    assert turn == Turn([{"role": "tool", "content": "12"}], 1.0, True)


def test_a_factory_that_raises_or_makes_no_environment_fails_the_episode():
    def broken(prompt):
        raise KeyError("row")

    with pytest.raises(EnvironmentFailed, match="KeyError") as info:
        EnvironmentGuard(broken).start(PROMPT)
    assert info.value.reason == "raised"
    with pytest.raises(EnvironmentFailed, match="has no step") as info:
        EnvironmentGuard(lambda prompt: object()).start(PROMPT)
    assert info.value.reason == "not_a_number"


def test_the_first_failure_of_each_reason_is_logged_once(caplog):
    guard = EnvironmentGuard(Replies, fallback=-1.0, name="my_env")
    with caplog.at_level(logging.WARNING, logger="async_rl.env"):
        for _ in range(3):
            try:
                guard.step(Replies(RuntimeError("boom")), "x")
            except EnvironmentFailed as failure:
                assert guard.failed(failure) == -1.0
    assert len(caplog.records) == 1 and "environment my_env raised RuntimeError: boom" in caplog.text
    assert guard.totals[REASONS.index("raised")] == 3
