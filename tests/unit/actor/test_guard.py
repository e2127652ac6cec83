"""actor/guard.py: user code (rewards, environments) that raises, hangs or returns
nonsense becomes a failure of its reason, scores the fallback, is counted and logged
once per reason; one timeout mechanism (a worker thread and a deadline) for all of it."""
import logging
import math
import signal
import threading
import time

import numpy as np
import pytest

from async_rl.actor.environments import Turn
from async_rl.actor.guard import Call, Calls, Guard
from async_rl.actor.rollout.episodes import checked_turn, has_step
from async_rl.learner.step_data import step_errors
from async_rl.rewards.outcome import Failed, as_reward
from async_rl.wire import ExperienceGroup, WireError, decode, encode
from async_rl.wire.messages import FAILURE_REASONS

# How long a hanging call takes to return: far longer than any guard timeout below, so a
# test that finishes sooner has not waited for a hang, however slow the machine.
HANG_S = 10.0
# A guard that never times out a call that returns at once, however slow the machine.
PATIENT_S = 60.0


def returning(value):
    return lambda prompt, response, answer: value


def raising(prompt, response, answer):
    raise ValueError("cannot parse")


def sleeping(prompt, response, answer):
    time.sleep(HANG_S)
    return 1.0


def spinning(prompt, response, answer):
    while True:  # pure Python: interruptible
        try:
            pass
        except Exception:  # a reward that swallows errors must still be stopped
            pass


def counts(**by_reason):
    return [by_reason.get(r, 0) for r in FAILURE_REASONS]


def score(guard, fn, *responses):
    """The guarded rewards of `responses` (one batch: one worker thread), fallbacks for failures."""
    calls = Calls()
    calls.submit([Call(i, guard, fn, ("1+1=", r, "2"), as_reward) for i, r in enumerate(responses)])
    outcomes = calls.wait_all()
    return [guard.failed(outcomes[i]) if isinstance(outcomes[i], Failed) else outcomes[i]
            for i in range(len(responses))]


@pytest.mark.parametrize("fn, reason", [
    (raising, "raised"),
    (sleeping, "timeout"),
    (spinning, "timeout"),
    (returning(float("nan")), "non_finite"),
    (returning(float("inf")), "non_finite"),
    (returning(-math.inf), "non_finite"),
    (returning(1e39), "non_finite"),  # finite in float64, inf in the float32 it travels as
    (returning(10 ** 400), "non_finite"),
    (returning(None), "not_a_number"),
    (returning("abc"), "not_a_number"),
    (returning("1.0"), "not_a_number"),  # a string is a bug even when it parses
    (returning(b"1"), "not_a_number"),
    (returning([1.0]), "not_a_number"),
    (returning(1 + 0j), "not_a_number"),
    (returning(object()), "not_a_number"),
])
def test_each_failure_scores_the_fallback_and_is_counted(fn, reason, caplog):
    guard = Guard("my_reward", timeout_s=0.2 if reason == "timeout" else PATIENT_S, fallback=-0.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="async_rl.reward"):
        assert score(guard, fn, "2", "3") == [-0.5, -0.5]
    assert time.monotonic() - started < HANG_S  # two timeouts of 0.2 s, not a hang
    assert guard.totals == counts(**{reason: 2})
    lines = [r for r in caplog.records if r.name == "async_rl.reward"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and f"'{reason}'" in lines[0].getMessage()
    assert "reward my_reward" in lines[0].getMessage() and "reward.fallback=-0.5" in lines[0].getMessage()
    assert f"counted (reward/errors_{reason})" in lines[0].getMessage()
    if reason == "raised":  # the first traceback, for the user to fix their code
        assert lines[0].exc_info and lines[0].exc_info[0] is ValueError
        assert "cannot parse" in lines[0].getMessage()


def test_good_rewards_pass_through_unchanged():
    for value, expected in [(1.0, 1.0), (0, 0.0), (-2.5, -2.5), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25),
                            (np.int64(3), 3.0), (np.float64(1e30), 1e30)]:
        guard = Guard("r", timeout_s=5.0)
        [got] = score(guard, returning(value), "r")
        assert got == expected and type(got) is float
        assert guard.totals == counts()


def test_one_log_line_per_reason_over_many_failures(caplog):
    results = iter([None, float("nan"), "x", float("inf"), 1.0] * 20)

    def flaky(prompt, response, answer):
        value = next(results)
        if value == 1.0:
            raise RuntimeError("boom")
        return value

    guard = Guard("flaky", timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="async_rl.reward"):
        assert score(guard, flaky, *["r"] * 100) == [0.0] * 100
    assert guard.totals == counts(raised=20, non_finite=40, not_a_number=40)
    messages = [r.getMessage() for r in caplog.records if r.name == "async_rl.reward"]
    assert len(messages) == 3
    assert sorted(m.split("further '")[1].split("'")[0] for m in messages) == ["non_finite", "not_a_number", "raised"]


def test_a_hung_call_fails_alone_and_the_calls_behind_it_still_run():
    """Calls submitted together run in one thread; one past its deadline moves the rest to another."""
    # The slow call alone has a short timeout: the others return at once, and must not be
    # timed out by a slow machine either.
    guard, patient = Guard("r", timeout_s=0.3), Guard("r", timeout_s=PATIENT_S)
    slow = {1}

    def reward(prompt, response, answer):
        if int(response) in slow:
            time.sleep(HANG_S)
        return float(response)

    started = time.monotonic()
    calls = Calls()
    calls.submit([Call(i, guard if i in slow else patient, reward, ("1+1=", str(i), "2"), as_reward)
                  for i in range(4)])
    outcomes = calls.wait_all()
    assert [guard.failed(outcomes[i]) if i in slow else outcomes[i] for i in range(4)] == [0.0, 0.0, 2.0, 3.0]
    assert time.monotonic() - started < HANG_S  # the calls behind it did not wait for it
    assert guard.totals == counts(timeout=1) and patient.totals == counts()


def test_a_runaway_loop_is_stopped_not_left_spinning():
    guard = Guard("r", timeout_s=0.2)
    spun = []

    def spinning_here(prompt, response, answer):
        spun.append(threading.current_thread())
        return spinning(prompt, response, answer)

    assert score(guard, spinning_here, "x") == [0.0]
    [thread] = spun
    thread.join(timeout=PATIENT_S)
    assert not thread.is_alive()  # interrupted, not spinning on beside the actor


def test_no_signal_is_used_and_a_timer_set_by_someone_else_runs_on():
    fired = []
    before = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    timer_s = 1.0
    try:
        set_at = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, timer_s)
        guard = Guard("r", timeout_s=0.1)
        assert score(guard, sleeping, "x") == [0.0] and guard.totals == counts(timeout=1)
        left, elapsed = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic() - set_at
        # Still running down from where it was set (0 once it has fired, on a slow machine);
        # 10 ms for the two clocks' readings.
        assert timer_s - elapsed - 0.01 <= left <= timer_s
        deadline = time.monotonic() + timer_s + PATIENT_S
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_off_the_main_thread_the_timeout_holds_too():
    out = {}

    def work():
        guard = Guard("r", timeout_s=0.1)
        out["scores"] = score(guard, sleeping, "x"), guard.totals

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(PATIENT_S)
    assert out["scores"] == ([0.0], counts(timeout=1))


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
def test_a_bad_environment_step_is_one_failure_of_its_reason(value, reason):
    guard = Guard("my_env", timeout_s=5.0, kind="environment")
    calls = Calls()
    calls.submit([Call("step", guard, Replies(value).step, ("action",), checked_turn)])
    [(key, outcome)] = calls.answers()
    assert key == "step" and isinstance(outcome, Failed) and outcome.reason == reason
    assert guard.failed(outcome) == 0.0 and guard.totals == counts(**{reason: 1})


def test_a_good_turn_passes_and_a_bool_reward_counts_as_a_number():
    turn = checked_turn(Turn([{"role": "tool", "content": "12"}], reward=True, done=True))
    assert turn == Turn([{"role": "tool", "content": "12"}], 1.0, True)


def test_a_factory_that_raises_or_makes_no_environment_fails_the_episode(caplog):
    def broken(prompt):
        raise KeyError("row")

    guard = Guard("my_env", timeout_s=5.0, fallback=-1.0, kind="environment")
    calls = Calls()
    calls.submit([Call("a", guard, broken, ("p",), has_step)])
    calls.submit([Call("b", guard, lambda prompt: object(), ("p",), has_step)])
    outcomes = calls.wait_all()
    assert outcomes["a"].reason == "raised" and "KeyError" in str(outcomes["a"])
    assert outcomes["b"].reason == "not_a_number" and "has no step" in str(outcomes["b"])
    with caplog.at_level(logging.WARNING, logger="async_rl.reward"):
        for _ in range(3):
            assert guard.failed(outcomes["a"]) == -1.0
    assert len(caplog.records) == 1 and "environment my_env raised KeyError" in caplog.text


def test_answers_come_as_calls_finish():
    guard = Guard("r", timeout_s=PATIENT_S)
    calls = Calls()
    release = threading.Event()  # the slow call finishes once the fast one was answered
    calls.submit([Call("slow", guard, release.wait, (PATIENT_S,))])
    calls.submit([Call("fast", guard, lambda: 7)])
    assert calls.answers() == [("fast", 7)] and len(calls) == 1
    release.set()
    assert calls.answers() == [("slow", True)] and len(calls) == 0
    assert calls.answers() == []


def _group(**changes):
    g = 4
    fields = dict(actor_id=1, group=0, prompt_id=0, version=0, prompt_tokens=np.zeros(3, np.int32),
                  response_tokens=np.zeros(g * 2, np.int32), response_lengths=np.full(g, 2, np.int32),
                  logprobs=np.zeros(g * 2, np.float32), token_versions=np.zeros(g * 2, np.int32),
                  rewards=np.zeros(g, np.float32), truncated=np.zeros(g, np.uint8), gen_seconds=0.1)
    return ExperienceGroup(**{**fields, **changes})


def test_counts_travel_with_a_group_and_old_messages_mean_zero():
    got = decode(encode(_group(reward_errors=[1, 0, 2, 1])))
    assert got.reward_errors == [1, 0, 2, 1]
    assert _group().reward_errors == counts()
    with pytest.raises(WireError, match="bad_value"):  # more failures than samples
        decode(encode(_group(reward_errors=[5, 0, 0, 0])))
    assert decode(encode(_group(reward_errors=[4, 0, 0, 1], greedy_reward=0.0))).reward_errors == [4, 0, 0, 1]
    errors = step_errors([_group(reward_errors=[1, 0, 0, 0]), _group(reward_errors=[0, 1, 2, 0])])
    assert errors.reward == [1, 1, 2, 0] and errors.env == counts() and errors.frac == 4 / 8
    assert not errors.in_environment() and errors.first == ""
    assert step_errors([]).frac == 0.0


def test_environment_failures_travel_apart_from_the_rewards_with_the_first_note():
    note = "environment raised ValueError: " + "x" * 400
    with pytest.raises(WireError):  # a note longer than a log line
        decode(encode(_group(env_errors=[1, 0, 0, 0], first_failure=note)))
    got = decode(encode(_group(env_errors=[2, 1, 0, 0], first_failure=note[:200])))
    assert got.env_errors == [2, 1, 0, 0] and got.first_failure == note[:200]
    with pytest.raises(WireError, match="bad_value"):  # reward and environment failures share the samples
        decode(encode(_group(reward_errors=[2, 0, 0, 0], env_errors=[0, 3, 0, 0])))
    errors = step_errors([_group(reward_errors=[1, 0, 0, 0]), got])
    assert errors.env == [2, 1, 0, 0] and errors.frac == 4 / 8 and errors.in_environment()
    assert errors.first == note[:200]


def test_the_first_failure_says_where_it_is_counted_and_what_becomes_of_its_sample(caplog):
    """An environment's failures are counted in env/errors_<reason>; with
    reward.on_failure=exclude the sample is left out, not trained on as the fallback."""
    guard = Guard("my_env", timeout_s=5.0, fallback=0.0, kind="environment", excluded=True,
                  logger=logging.getLogger("async_rl.env"))
    with caplog.at_level(logging.WARNING, logger="async_rl.env"):
        guard.failed(Failed("raised", "raised KeyError: 'x'"))
    [line] = [r.getMessage() for r in caplog.records if r.name == "async_rl.env"]
    assert line == ("environment my_env raised KeyError: 'x': its sample is left out of training "
                    "(reward.on_failure=exclude) and scores reward.fallback=0 in evaluations; further 'raised' "
                    "failures are counted (env/errors_raised), not logged")
