"""RewardGuard: user reward code that raises, hangs or returns a non-number scores the
fallback and is counted by reason, and the first failure of each reason is logged once."""
import logging
import math
import signal
import threading
import time

import numpy as np
import pytest

from async_rl.user_code import REASONS, RewardGuard, step_errors
from async_rl.wire import ExperienceGroup, WireError, decode, encode


def returning(value):
    return lambda prompt, response, answer: value


def raising(prompt, response, answer):
    raise ValueError("cannot parse")


def sleeping(prompt, response, answer):
    time.sleep(5)
    return 1.0


def spinning(prompt, response, answer):
    while True:  # pure Python: interruptible
        try:
            pass
        except Exception:  # a reward that swallows errors must still be stopped
            pass


def counts(**by_reason):
    return [by_reason.get(r, 0) for r in REASONS]


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
    guard = RewardGuard(fn, timeout_s=0.2, fallback=-0.5)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="async_rl.reward"):
        assert guard("1+1=", "2", "2") == -0.5
        assert guard("1+1=", "3", "2") == -0.5
    assert time.monotonic() - started < 2.0  # two timeouts of 0.2 s, not two hangs
    assert guard.take_counts() == counts(**{reason: 2})
    assert guard.take_counts() == counts()  # taken: reset
    assert guard.totals == counts(**{reason: 2})
    lines = [r for r in caplog.records if r.name == "async_rl.reward"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and f"'{reason}'" in lines[0].getMessage()
    assert "reward.fallback=-0.5" in lines[0].getMessage()
    if reason == "raised":  # the first traceback, for the user to fix their code
        assert lines[0].exc_info and lines[0].exc_info[0] is ValueError
        assert "cannot parse" in lines[0].getMessage()


def test_good_rewards_pass_through_unchanged():
    for value, expected in [(1.0, 1.0), (0, 0.0), (-2.5, -2.5), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25),
                            (np.int64(3), 3.0), (np.float64(1e30), 1e30)]:
        guard = RewardGuard(returning(value))
        got = guard("p", "r", "a")
        assert got == expected and type(got) is float
        assert guard.take_counts() == counts()


def test_one_log_line_per_reason_over_many_failures(caplog):
    results = iter([None, float("nan"), "x", float("inf"), 1.0] * 20)

    def flaky(prompt, response, answer):
        value = next(results)
        if value == 1.0:
            raise RuntimeError("boom")
        return value

    guard = RewardGuard(flaky, fallback=0.0)
    with caplog.at_level(logging.WARNING, logger="async_rl.reward"):
        assert all(guard("p", "r", "a") == 0.0 for _ in range(100))
    assert guard.take_counts() == counts(raised=20, non_finite=40, not_a_number=40)
    messages = [r.getMessage() for r in caplog.records if r.name == "async_rl.reward"]
    assert len(messages) == 3
    assert sorted(m.split("further '")[1].split("'")[0] for m in messages) == ["non_finite", "not_a_number", "raised"]


def test_a_previous_sigalrm_handler_and_timer_are_restored():
    fired = []

    def outer(signum, frame):
        fired.append(signum)

    before, saved = signal.signal(signal.SIGALRM, outer), signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        guard = RewardGuard(returning(1.0), timeout_s=5.0)
        assert guard("p", "r", "a") == 1.0
        assert signal.getsignal(signal.SIGALRM) is outer
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 0.3 < remaining <= 0.6  # the outer timer runs on, not reset to our 5 s or cancelled
        timed_out = RewardGuard(sleeping, timeout_s=0.1)
        assert timed_out("p", "r", "a") == 0.0 and timed_out.take_counts() == counts(timeout=1)
        assert signal.getsignal(signal.SIGALRM) is outer
        time.sleep(0.8)
        assert fired == [signal.SIGALRM]  # the outer timer still fired, once
        # No timer of ours is left behind.
        RewardGuard(returning(1.0), timeout_s=0.1)("p", "r", "a")
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, before)
        if saved[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *saved)


def test_off_the_main_thread_it_guards_without_a_timeout():
    out = {}

    def work():
        guard = RewardGuard(lambda p, r, a: time.sleep(0.3) or 1.0, timeout_s=0.05)
        out["slow"] = guard("p", "r", "a")  # no SIGALRM off the main thread: it runs to the end
        bad = RewardGuard(raising)
        out["raised"] = bad("p", "r", "a"), bad.take_counts()
        out["counts"] = guard.take_counts()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(10)
    assert out["slow"] == 1.0 and out["counts"] == counts()
    assert out["raised"] == (0.0, counts(raised=1))


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
    errors, frac = step_errors([_group(reward_errors=[1, 0, 0, 0]), _group(reward_errors=[0, 1, 2, 0])])
    assert errors == [1, 1, 2, 0] and frac == 4 / 8
    assert step_errors([])[1] == 0.0


def test_the_coordinator_sums_counts_into_its_checkpoint_state_and_old_states_mean_zero(tmp_path):
    import torch

    from async_rl.config import build_config
    from async_rl.coordinator.coordinator import Coordinator
    from async_rl.tasks import make_task
    from async_rl.weight_transfer.broadcaster import WeightBroadcaster

    cfg = build_config({"learner": {"ranks": 1}})
    bc = WeightBroadcaster([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)
    try:
        coord = Coordinator(cfg, make_task("arithmetic", seed=0), bc, tmp_path)
        state, _ = coord.snapshot()
        assert state["reward_errors"] == dict.fromkeys(REASONS, 0)
        old = {k: v for k, v in state.items() if k != "reward_errors"}  # a checkpoint from before the counts
        coord.restore(0, old, [])
        assert coord.reward_error_totals() == dict.fromkeys(REASONS, 0)
        coord.restore(0, {**old, "reward_errors": {"raised": 3, "timeout": 1}}, [])
        coord._count_reward_errors([1, 0, 2, 0])
        assert coord.reward_error_totals() == {"raised": 4, "timeout": 1, "non_finite": 2, "not_a_number": 0}
        assert coord.snapshot()[0]["reward_errors"] == coord.reward_error_totals()
    finally:
        bc.close()
