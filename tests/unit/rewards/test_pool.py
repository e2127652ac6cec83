"""Rewards in worker processes: a call past its deadline has its worker killed (no core
stays busy), a reward may time itself out with signal.alarm, failures come back named,
and the pool survives its workers' deaths."""
import os
import textwrap
import time

import numpy as np
import psutil
import pytest

from async_rl.rewards.pool import Call, RemoteTraceback, RewardPool, RewardPoolError

REWARDS = '''
import os, signal, time

def reward(prompt, response, answer, **fields):
    if response == "spin":
        while True:
            pass
    if response == "sleep":
        time.sleep(1000)
    if response == "exit":
        os._exit(3)
    if response == "raise":
        raise ValueError("no answer in it")
    if response == "nan":
        return float("nan")
    if response == "pid":
        return float(os.getpid())
    if response == "fields":
        return float(sum(fields["weights"]) + fields["bonus"])
    print("a reward that prints")  # must not corrupt the answers
    return float(response == answer)

def alarm(prompt, response, answer):
    """Times itself out as math-verify does: signal.alarm works in a main thread only."""
    def stop(*_):
        raise TimeoutError
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        while True:
            pass
    except TimeoutError:
        return 1.0

def math_verify_timeout_in_force(prompt, response, answer):
    from async_rl.tasks.rewards import _math_verify_timeout
    return float(_math_verify_timeout() is not None)
'''
TIMEOUT_S = 1.0


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def pool_for(rewards_file, function: str = "reward", processes: int = 2, timeout_s: float = TIMEOUT_S) -> RewardPool:
    return RewardPool({"name": "jsonl", "train_path": "unused.jsonl", "reward": f"{rewards_file}:{function}"}, 0,
                      processes=processes, timeout_s=timeout_s)


def test_rewards_come_back_in_order_from_several_workers(rewards_file):
    with pool_for(rewards_file) as pool:
        calls = [Call("p", str(i % 3), "1") for i in range(500)]
        assert pool.score(calls) == [float(i % 3 == 1) for i in range(500)]
        assert pool.restarts == 0


@pytest.mark.parametrize("response", ["spin", pytest.param("sleep", marks=pytest.mark.integration)])
def test_a_call_past_its_deadline_is_killed_with_its_worker_and_the_core_is_free(rewards_file, response):
    with pool_for(rewards_file, processes=1) as pool:
        worker = psutil.Process(pool.workers[0].process.pid)
        started = time.monotonic()
        outcomes = pool.score([Call("p", response, "1"), Call("p", "1", "1")])
        assert time.monotonic() - started < TIMEOUT_S + 1.0 + 1.5  # the deadline, then a new worker's start
        assert outcomes[0].reason == "timeout" and "killed" in str(outcomes[0])
        assert outcomes[1] == 1.0  # queued behind it: answered by the replacement
        assert not worker.is_running()  # no process left spinning after the deadline
        assert pool.restarts == 1


def test_a_reward_may_time_itself_out_with_signal_alarm(rewards_file):
    with pool_for(rewards_file, "alarm", processes=1) as pool:
        assert pool.score([Call("p", "r", "a")]) == [1.0]
    with pool_for(rewards_file, "math_verify_timeout_in_force", processes=1) as pool:
        assert pool.score([Call("p", "r", "a")]) == [1.0]


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_math_verify_scores_in_a_worker():
    pytest.importorskip("math_verify")
    with RewardPool({"name": "jsonl", "train_path": "unused.jsonl", "reward": "math_verify"}, 0, processes=1,
                    timeout_s=30) as pool:
        assert pool.score([Call("p", r"The answer is $\frac{1}{2}$", "0.5"), Call("p", "It is 3", "0.5")]) == [1.0, 0.0]


def test_failures_come_back_named_and_the_pool_goes_on(rewards_file):
    with pool_for(rewards_file) as pool:
        raised, died, nan, ok = pool.score([Call("p", "raise", "1"), Call("p", "exit", "1"), Call("p", "nan", "1"),
                                            Call("p", "1", "1")])
        assert raised.reason == "raised" and str(raised) == "raised ValueError: no answer in it"
        assert isinstance(raised.__cause__, RemoteTraceback) and "in reward" in str(raised.__cause__)
        assert died.reason == "raised" and "exited with status 3" in str(died)
        assert nan.reason == "non_finite"
        assert ok == 1.0
        assert pool.score([Call("p", "1", "1")] * 4) == [1.0] * 4


def test_row_fields_travel_as_data(rewards_file):
    with pool_for(rewards_file, processes=1) as pool:
        assert pool.score([Call("p", "fields", "", {"weights": np.array([1, 2]), "bonus": np.float32(0.5)})]) == [3.5]
        good = Call("p", "fields", "", {"weights": [1], "bonus": 1})
        first, failed, last = pool.score([good, Call("p", "fields", "", {"weights": object()}), good])
        assert failed.reason == "raised" and "cannot reach a reward worker" in str(failed)
        assert first == last == 2.0  # the others of its batch still travel


def test_a_reward_that_cannot_be_imported_fails_the_start_in_one_line(tmp_path):
    pool = RewardPool({"name": "jsonl", "train_path": "x.jsonl", "reward": f"{tmp_path}/missing.py:reward"}, 0,
                      processes=1, timeout_s=1)
    with pytest.raises(RewardPoolError, match="the reward cannot be built") as err:
        pool.start()
    pool.close()
    assert "\n" not in str(err.value)


def test_close_leaves_no_worker(rewards_file):
    pool = pool_for(rewards_file)
    pool.start()
    pids = [pool.score([Call("p", "pid", "")])[0]] + [w.process.pid for w in pool.workers]
    pool.close()
    assert not any(psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)
    assert os.getpid() not in pids
