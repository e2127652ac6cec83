"""The run-saving warnings: said once, after the streak, with the likely cause."""
import logging

import numpy as np
import pytest

from async_rl.learner.health import HACKING_WINDOW, RunHealth


def batch(rewards, lengths, truncated=None):
    rewards = np.asarray(rewards, np.float32)
    return (rewards, np.asarray(lengths), np.zeros(len(rewards), np.uint8) if truncated is None
            else np.asarray(truncated, np.uint8))


def test_one_token_responses_warn_once_after_the_streak(caplog):
    health = RunHealth(steps=3, uses_chat_template=False, max_new_tokens=8)
    one_token = batch([1, 0, 0, 1], [1, 1, 1, 4])  # 3 of 4 one token long, rewards vary
    with caplog.at_level(logging.WARNING, logger="async_rl.learner.health"):
        assert health.check(*one_token, group_size=2) == []
        assert health.check(*one_token, group_size=2) == []
        (msg,) = health.check(*one_token, group_size=2)
        assert health.check(*one_token, group_size=2) == []  # once
    assert "one token long" in msg and "chat template" in msg and "\n" not in msg
    assert [r.getMessage() for r in caplog.records] == [msg]


def test_a_streak_must_be_unbroken():
    health = RunHealth(steps=2, uses_chat_template=True, max_new_tokens=8)
    flat, varied = batch([0, 0, 0, 0], [5] * 4), batch([0, 1, 1, 0], [5] * 4)
    for b in (flat, varied, flat, varied, flat):
        assert health.check(*b, group_size=2) == []
    (msg,) = health.check(*flat, group_size=2)
    assert "same reward" in msg and "no response ever scores" in msg and "cut at" not in msg


def test_zero_variance_names_truncation_or_a_constant_reward():
    health = RunHealth(steps=1, uses_chat_template=True, max_new_tokens=16)
    (msg,) = health.check(*batch([0] * 4, [16] * 4, [1, 1, 1, 0]), group_size=2)
    assert "75% of responses are cut at actors.max_new_tokens=16" in msg
    health = RunHealth(steps=1, uses_chat_template=True, max_new_tokens=16)
    (msg,) = health.check(*batch([1, 1, 0, 0], [3] * 4), group_size=2)  # equal within each group
    assert "every sample scores 0.5" in msg



def test_mismatch_warns_when_it_passes_the_threshold_and_again_when_it_doubles(caplog):
    health = RunHealth(10, True, 64, mismatch_threshold=0.01)
    assert health.check_mismatch(1, {"is/mismatch_kl": 0.009}) is None
    assert health.check_mismatch(2, {"is/mismatch_kl": 0.05}) is None  # one step's spike
    assert health.check_mismatch(3, {"is/mismatch_kl": 0.009}) is None
    assert health.check_mismatch(4, {"is/mismatch_kl": 0.011}) is None
    first = health.check_mismatch(5, {"is/mismatch_kl": 0.012, "is/ratio_max": 40.0, "is/masked_frac": 0.03})
    assert first.startswith("step 5: mismatch KL") and "0.012" in first and "ratio max 40" in first
    assert "3.0% of tokens masked" in first and "\n" not in first and first in caplog.text
    assert health.check_mismatch(6, {"is/mismatch_kl": 0.02}) is None  # not yet twice 0.012
    assert health.check_mismatch(7, {"is/mismatch_kl": 0.03}) is None
    assert health.check_mismatch(8, {"is/mismatch_kl": 0.03}).startswith("step 8")
    assert RunHealth(10, True, 64, mismatch_threshold=None).check_mismatch(1, {"is/mismatch_kl": 9.0}) is None


def test_an_environments_too_long_answers_are_named_once(caplog):
    health = RunHealth(steps=3, uses_chat_template=True, max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="async_rl.learner.health"):
        assert health.check_observations(1, 0, "mine:make", 256) is None
        msg = health.check_observations(2, 3, "mine:make", 256)
        assert health.check_observations(3, 5, "mine:make", 256) is None  # once
    assert "environment mine:make" in msg and "env.max_tokens=256" in msg and "3 episode" in msg
    assert [r.getMessage() for r in caplog.records] == [msg]


def test_most_groups_without_signal_in_the_first_steps_warn_once_at_step_3(caplog):
    health = RunHealth(steps=10, uses_chat_template=True, max_new_tokens=24)
    flat = batch([0] * 8, [24, 24, 24, 5, 5, 5, 5, 5], [1, 1, 1, 0, 0, 0, 0, 0])  # 4 groups of 2, all flat
    one_varied = batch([0, 1, 0, 0, 0, 0, 0, 0], [5] * 8)  # 1 of 4 groups has signal
    with caplog.at_level(logging.WARNING, logger="async_rl.learner.health"):
        assert health.check(*flat, group_size=2) == []
        assert health.check(*one_varied, group_size=2) == []
        (msg,) = health.check(*flat, group_size=2)
        for _ in range(5):
            assert health.check(*flat, group_size=2) == []  # once; the streak's own line comes at step 10
    # 11 of 12 groups flat; mean reward 1/24; 6 of 24 responses cut (25%: not named)
    assert msg.startswith("step 3: 92% of groups (11 of 12) in the first 3 steps carry no learning signal")
    assert "mean reward 0.0417" in msg and "cut at" not in msg
    assert msg.endswith("docs/environments.md#when-a-run-gets-no-signal") and "\n" not in msg
    assert [r.getMessage() for r in caplog.records] == [msg]


def test_the_early_line_needs_most_groups_flat_and_names_cut_responses():
    health = RunHealth(steps=10, uses_chat_template=True, max_new_tokens=24)
    half = batch([0, 1, 0, 0], [5] * 4)  # 1 of 2 groups flat
    assert all(health.check(*half, group_size=2) == [] for _ in range(4))
    health = RunHealth(steps=10, uses_chat_template=True, max_new_tokens=24)
    cut = batch([0] * 4, [24] * 4, [1, 1, 1, 0])
    assert health.check(*cut, group_size=2) == [] and health.check(*cut, group_size=2) == []
    (msg,) = health.check(*cut, group_size=2)
    assert "75% of responses cut at actors.max_new_tokens=24" in msg


def test_a_trained_reward_rising_while_its_watcher_falls_is_said_once():
    health = RunHealth(10, uses_chat_template=False, max_new_tokens=8)
    rng = np.random.default_rng(0)
    said = [health.check_hacking(step, 0.05 * step + rng.normal(0, 0.01), {"correct": 0.5 - 0.02 * step})
            for step in range(1, 41)]
    warned = [s for s in said if s is not None]
    assert len(warned) == 1 and said[HACKING_WINDOW - 1] is not None  # as soon as the window is full
    assert "reward/correct, watched at weight 0, fell" in warned[0]


@pytest.mark.parametrize("watched", [
    lambda step, rng: 0.5 + 0.02 * step,  # both rise: learning
    lambda step, rng: 0.3 + rng.normal(0, 0.05),  # the watcher only noisy
])
def test_no_hacking_line_when_the_watcher_does_not_fall(watched):
    health = RunHealth(10, uses_chat_template=False, max_new_tokens=8)
    rng = np.random.default_rng(1)
    assert all(health.check_hacking(step, 0.05 * step, {"correct": watched(step, rng)}) is None
               for step in range(1, 41))
