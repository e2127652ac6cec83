"""Step rewards from a reward (rewards/outcome.py StepRewards): a reward may score a
response step by step, ends as character offsets in its text; the actor puts each step
on the token where its text ends, components merge their weighted steps, the sample
travels with its steps (thread and process executors alike), and grpo_process trains on
them."""
import re

import numpy as np
import pytest
import torch
from conftest import build_chat_tokenizer

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.rollout.rollout import Rollout
from async_rl.algorithms.advantages import process_advantages
from async_rl.config import build_config
from async_rl.learner.batching import build_batch
from async_rl.learner.health import RunHealth
from async_rl.rewards import StepRewards
from async_rl.rewards.components import Components, ComponentScores
from async_rl.rewards.outcome import RESPONSE_END, Failed, as_outcome
from async_rl.rewards.pool import Call, RewardPool
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import PromptFormat, prompt_format_for
from async_rl.wire import WorkGrant, decode, encode

# Every 2 characters a step, worth 1 every 4 characters, and the sample's reward 1.0 whatever the steps.
STEPPED = """from async_rl.rewards import StepRewards


def pairs(prompt, response, answer):
    return StepRewards([(end, float(end % 4 == 0)) for end in range(2, len(response) + 1, 2)] or [(1, 0.5)],
                       value=1.0)


def unordered(prompt, response, answer):
    return StepRewards([(3, 1.0), (2, 1.0)])
"""


def test_split_cuts_at_each_separator_and_the_value_is_the_steps_sum_unless_given():
    checked = as_outcome(StepRewards.split("a\n\nbb\n\nc", [1, 0.5, True]))
    assert checked.steps == [(1, 1.0), (5, 0.5), (8, 1.0)] and checked.value == 2.5
    assert as_outcome(StepRewards([(4, 1.0), (9, -1.0)], value=0.25)).value == 0.25
    assert as_outcome(2) == 2.0  # a plain reward is as before
    with pytest.raises(ValueError, match="2 step rewards for 3 steps"):
        StepRewards.split("a.b.c", [1.0, 1.0], separator=".")


@pytest.mark.parametrize("steps, reason, says", [
    ([], "not_a_number", "0 steps"),
    ([(3, 1.0), (2, 1.0)], "not_a_number", "not positive and increasing"),
    ([(0, 1.0)], "not_a_number", "not positive and increasing"),
    ([(1.5, 1.0)], "not_a_number", "not character offsets"),
    ([(True, 1.0)], "not_a_number", "not character offsets"),
    ([(1, "1")], "not_a_number", "a step reward"),
    ([(1, float("nan"))], "non_finite", "a step reward"),
    ([(1, 1e39)], "non_finite", "a step reward"),
    (5, "not_a_number", "not (end, reward) pairs"),
    ([(1, 2, 3)], "not_a_number", "not (end, reward) pairs"),
])
def test_malformed_steps_fail_the_call_with_a_reason(steps, reason, says):
    with pytest.raises(Failed, match=re.escape(says)) as failed:
        as_outcome(StepRewards(steps))
    assert failed.value.reason == reason


def test_a_steps_end_falls_on_the_first_token_whose_text_reaches_it():
    fmt = PromptFormat(build_chat_tokenizer(), "auto")
    tok = fmt.tokenizer
    text = "Step one: 3+4=7.\n\nStep two: 7*2=14.\n\nSo 14."
    tokens = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert fmt.response_text(tokens) == text
    offsets = list(range(1, len(text)))
    for end, token in zip(offsets, fmt.token_ends(tokens, offsets)):
        assert len(fmt.response_text(tokens[:token + 1])) >= end > len(fmt.response_text(tokens[:token]))
    # The text's end, or past it: the last token, the end-of-turn token included.
    assert fmt.token_ends(tokens, [len(text), RESPONSE_END]) == [len(tokens) - 1] * 2


def test_steps_on_one_token_are_one_step_and_a_failed_single_turn_has_none():
    ep = Episode([1, 2], max_turns=1, max_tokens=8, environment=False)
    ep.tokens = [5, 6, 7]
    ep.score(1.0, [0, 2, 2], [0.5, 0.25, 0.25])
    assert (ep.step_ends, ep.step_rewards) == ([0, 2], [0.5, 0.5])
    response = ep.response()
    assert response.policy_mask is None and response.step_ends.tolist() == [0, 2]
    ep.fail(0.0, "raised", "reward")
    assert ep.response().step_ends is None  # its reward is its last token's, as without steps


def test_components_merge_their_weighted_steps_and_a_plain_one_counts_at_the_end():
    parts = Components([("prm", 2.0, lambda p, r, a: StepRewards([(2, 1.0), (4, 0.5)], value=0.5)),
                        ("exact", 0.5, lambda p, r, a: 1.0),
                        ("watch", 0.0, lambda p, r, a: StepRewards([(1, 9.0)]))])
    scores = parts("q", "abcd", "abcd")
    assert scores.values == [0.5, 1.0, 9.0] and scores.steps[1] is None
    settled = scores.settle()
    assert settled.value == 2.0 * 0.5 + 0.5 * 1.0  # the components' values, weighted, as without steps
    assert settled.steps == [(2, 2.0), (4, 1.0), (RESPONSE_END, 0.5)]  # the watcher's steps train nothing
    plain = Components([("exact", 1.0, lambda p, r, a: 1.0), ("watch", 0.0, lambda p, r, a: StepRewards([(1, 9.0)]))])
    assert plain("q", "abcd", "abcd").settle() == 1.0


def test_a_workers_steps_are_checked_again_and_bad_ones_fail_their_component():
    reply = {"components": [1.0, 2.0], "component_ms": [1.0, 1.0], "component_codes": [0, 0],
             "component_notes": ["", ""], "component_steps": [[[3, 1.0], [2, 1.0]], [[2, 2.0]]]}
    scores = ComponentScores.from_reply(reply, ["a", "b"], [1.0, 1.0])
    assert scores.codes == [4, 0] and scores.values == [0.0, 2.0] and scores.steps == [None, [(2, 2.0)]]


def test_the_reward_workers_return_steps(tmp_path):
    path = tmp_path / "stepped.py"
    path.write_text(STEPPED)
    with RewardPool({"name": "arithmetic", "reward": f"{path}:pairs"}, 0, processes=1, timeout_s=10) as pool:
        [stepped, one] = pool.score([Call("1+1=", "abcde", "2"), Call("1+1=", "", "2")])
    assert stepped.steps == [(2, 0.0), (4, 1.0)] and stepped.value == 1.0
    assert one.steps == [(1, 0.5)]
    with RewardPool({"name": "arithmetic", "reward": f"{path}:unordered"}, 0, processes=1, timeout_s=10) as pool:
        [failed] = pool.score([Call("1+1=", "abc", "2")])
    assert isinstance(failed, Failed) and failed.reason == "not_a_number" and "increasing" in str(failed)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_each_sample_travels_with_its_steps_and_grpo_process_trains_on_them(demo_model, tmp_path, executor):
    path = tmp_path / "stepped.py"
    path.write_text(STEPPED)
    cfg = build_config({"model": {"path": str(demo_model)}, "train": {"group_size": 4},
                        "actors": {"max_new_tokens": 6}, "task": {"reward": f"{path}:pairs"},
                        "reward": {"executor": executor, "workers": 1}})
    fmt = prompt_format_for(cfg.model.path, cfg.task)
    rollout = Rollout.from_config(cfg, TorchEngine(str(demo_model)), fmt, task_from_config(cfg.task, cfg.seed),
                                  torch.Generator().manual_seed(0))
    try:
        groups = [decode(encode(g)) for g in rollout.experience(WorkGrant(groups=[0, 1], prompt_ids=[0, 1]), 0)]
    finally:
        rollout.close()
    for g in groups:
        assert g.rewards.tolist() == [1.0] * 4 and len(g.policy_mask) == 0
        for r in g.responses():
            text = fmt.response_text(r.tokens.tolist())
            ends = list(range(2, len(text) + 1, 2))
            assert r.step_ends.tolist() == sorted(set(fmt.token_ends(r.tokens.tolist(), ends or [1])))
            # Steps that end on one token are one, their rewards summed.
            assert r.step_rewards.sum() == (sum(end % 4 == 0 for end in ends) if ends else 0.5)
    batch = build_batch(groups, pad_id=0)
    trained = ~torch.isnan(batch.step_rewards)
    assert trained.sum() == sum(len(g.step_ends) for g in groups)
    assert torch.equal(batch.step_rewards[trained], torch.from_numpy(np.concatenate([g.step_rewards for g in groups])))
    advantages = process_advantages(batch.step_rewards, batch.loss_mask, batch.group)
    assert advantages.abs().sum() > 0  # the steps worth 1 are told apart from those worth 0


def test_steps_under_an_estimator_that_ignores_them_warn_once():
    health = RunHealth(5, uses_chat_template=False, max_new_tokens=8)
    assert "grpo_process trains on them" in health.check_steps(3, "grpo")
    assert health.check_steps(4, "grpo") is None and RunHealth(5, False, 8).check_steps(1, "grpo_process") is None
