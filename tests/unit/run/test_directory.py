"""run/directory.py: waiting for the hub's address, as the launcher and an actor started with
`--run-dir` do: it comes when endpoints.json does, and a reason to give up or the
deadline ends the wait."""
import json
import time

import pytest

from async_rl.run.directory import RunDir


def test_the_hub_address_comes_once_endpoints_json_is_written(tmp_path):
    polls = []

    def publish_once_it_waits():  # polled every round: the second round has looked once and found none
        polls.append(1)
        if len(polls) == 2:
            (tmp_path / "endpoints.json").write_text(json.dumps({"hub": "tcp://127.0.0.1:5555", "actors": []}))
        return None

    assert RunDir(tmp_path).wait_for_hub(timeout_s=60, give_up=publish_once_it_waits) == "tcp://127.0.0.1:5555"
    assert len(polls) == 2


def test_a_reason_to_give_up_ends_the_wait_with_it(tmp_path):
    calls = []

    def give_up():
        calls.append(1)
        return "the learner exited with status 1 before starting its hub" if len(calls) > 2 else None

    with pytest.raises(RuntimeError, match="exited with status 1"):
        RunDir(tmp_path).wait_for_hub(timeout_s=10, give_up=give_up)
    assert len(calls) == 3


def test_no_hub_before_the_deadline_is_an_error_naming_it(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not come up within 0s"):
        RunDir(tmp_path / "not-yet-made").wait_for_hub(timeout_s=0.3)
    assert time.monotonic() - started < 30  # its deadline, however slow the machine, not a longer one
