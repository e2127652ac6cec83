"""The sample format's multi-turn fields: a response that interleaves the policy's turns
with an environment's tokens (`policy_mask`), and rewards at the end of steps
(`step_ends`, `step_rewards`): built, sent over the wire, handed back per response, and
refused when inconsistent."""
import numpy as np
import pytest
from msgspec.structs import replace

from async_rl.wire import ExperienceGroup, Response, WireError, WireLimits, decode, encode


def two_turn_group() -> ExperienceGroup:
    # Response 0: policy [11 12] (version 3), environment [90 91], policy [13] (version 4).
    # Response 1: single turn, policy [21 22 23] (version 4), no mask, no steps.
    first = Response(np.array([11, 12, 90, 91, 13]), np.array([-0.5, -0.25, 0.0, 0.0, -1.0]),
                     np.array([3, 3, 3, 3, 4]), policy_mask=np.array([1, 1, 0, 0, 1]),
                     step_ends=np.array([1, 4]), step_rewards=np.array([0.5, 1.0]))
    second = Response(np.array([21, 22, 23]), np.array([-0.1, -0.2, -0.3]), np.array([4, 4, 4]))
    return ExperienceGroup.from_responses(
        [first, second], actor_id=0, group=5, prompt_id=7, version=3, prompt_tokens=np.array([1, 2], np.int32),
        rewards=np.array([1.5, 0.0], np.float32), truncated=np.zeros(2, np.uint8), gen_seconds=0.1)


def test_a_multi_turn_group_travels_and_hands_back_each_responses_turns():
    g = decode(encode(two_turn_group()))
    assert g.policy_mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 1]  # a response without a mask is all policy
    assert g.step_ends.tolist() == [1, 4] and g.step_rewards.tolist() == [0.5, 1.0]
    first, second = g.responses()
    assert first.tokens.tolist() == [11, 12, 90, 91, 13] and first.policy_mask.tolist() == [1, 1, 0, 0, 1]
    assert first.step_ends.tolist() == [1, 4] and first.step_rewards.tolist() == [0.5, 1.0]
    assert second.policy_mask.tolist() == [1, 1, 1] and second.step_ends is None


def test_single_turn_groups_carry_no_multi_turn_arrays():
    g = ExperienceGroup.from_responses(
        [Response(np.array([4, 5]), np.array([-0.5, -0.5]), np.array([0, 0]))], actor_id=0, group=0, prompt_id=0,
        version=0, prompt_tokens=np.array([1], np.int32), rewards=np.ones(1, np.float32),
        truncated=np.zeros(1, np.uint8), gen_seconds=0.0)
    assert len(g.policy_mask) == 0 and len(g.step_ends) == 0
    assert decode(encode(g)).responses()[0].policy_mask is None


def test_steps_of_later_responses_are_found_by_offset():
    g = two_turn_group()
    moved = ExperienceGroup.from_responses(list(reversed(g.responses())), **{
        k: getattr(g, k) for k in ("actor_id", "group", "prompt_id", "version", "prompt_tokens", "rewards",
                                   "truncated", "gen_seconds")})
    assert moved.step_ends.tolist() == [4, 7]  # after response 1's three tokens
    assert [r.step_ends is None for r in moved.responses()] == [True, False]
    assert moved.responses()[1].step_ends.tolist() == [1, 4]


def test_environment_tokens_do_not_count_for_the_groups_version():
    g = two_turn_group()
    versions = g.token_versions.copy()
    versions[2:4] = 1  # older than any policy token, but written by the environment
    assert decode(encode(replace(g, token_versions=versions))).version == 3


@pytest.mark.parametrize("change,reason", [
    (dict(policy_mask=np.ones(3, np.uint8)), "shape_mismatch"),
    (dict(policy_mask=np.array([1, 1, 2, 0, 1, 1, 1, 1], np.uint8)), "bad_value"),
    (dict(step_rewards=np.ones(3, np.float32)), "shape_mismatch"),
    (dict(step_ends=np.array([4, 1], np.int32)), "bad_value"),  # not in order
    (dict(step_ends=np.array([1, 8], np.int32)), "bad_value"),  # past the responses
    (dict(step_ends=np.array([1, 2], np.int32)), "bad_value"),  # ends on an environment token
    (dict(version=4), "version_mismatch"),  # the oldest policy token is version 3
])
def test_inconsistent_multi_turn_fields_are_refused(change, reason):
    with pytest.raises(WireError) as info:
        decode(encode(replace(two_turn_group(), **change)), WireLimits())
    assert info.value.reason == reason
