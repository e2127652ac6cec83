"""batching.py: the row layout of a batch (prompt ++ response ++ pad, predictions shifted
by one), the order that gives each learner rank whole groups of every minibatch, and
the groups' encoding for the other ranks, and the scatter over a real one-process gloo
group (two ranks: tests/integration/test_fsdp.py)."""
import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

from async_rl.learner.batching import assign_to_ranks, build_batch, decode_share, encode_share, scatter_batch
from async_rl.wire import ExperienceGroup, Response

PAD = 0


def group(prompt, responses, logprob=-0.5, reward=1.0, greedy=None):
    G, T = len(responses), max(len(r) for r in responses)
    lengths = np.array([len(r) for r in responses], np.int32)
    return ExperienceGroup.from_responses(
        [Response(r, np.full(len(r), logprob), np.zeros(len(r))) for r in responses],
        actor_id=0, group=0, prompt_id=0, version=0, prompt_tokens=np.array(prompt, np.int32),
        rewards=np.full(G, reward, np.float32), truncated=(lengths == T).astype(np.uint8), gen_seconds=0.0,
        greedy_reward=greedy)


def test_rows_are_prompt_then_response_and_predictions_shift_by_one():
    batch = build_batch([group([7, 8, 9], [[4, 5], [6]], logprob=-0.25, greedy=0.5)], pad_id=PAD)
    assert batch.tokens.tolist() == [[7, 8, 9, 4, 5], [7, 8, 9, 6, PAD]]
    assert batch.attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # Position t scores token t+1: the response starts at position P = 3, predicted at 2.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch.logp_behav.tolist() == [[0, 0, -0.25, -0.25], [0, 0, -0.25, 0]]
    assert batch.prompt_len.tolist() == [3, 3] and batch.group.tolist() == [0, 0]
    assert batch.truncated.tolist() == [1, 0] and batch.baselines.tolist() == [0.5, 0.5]


def test_groups_of_different_prompt_lengths_share_one_width():
    batch = build_batch([group([1], [[2, 3], [2]]), group([1, 1, 1], [[2], [2]], reward=0.0)], pad_id=PAD)
    assert batch.tokens.shape == (4, 4) and batch.group.tolist() == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0] and torch.isnan(batch.baselines).all()


@pytest.mark.parametrize("world,minibatches", [(1, 2), (2, 1), (2, 2)])
def test_each_rank_holds_its_share_of_every_minibatch(world, minibatches):
    n_groups = 8
    shares = assign_to_ranks(list(range(n_groups)), world, minibatches)
    per_mb = n_groups // minibatches
    for r in range(world):
        # Rank r's k-th slice: its part of the k-th run of consecutive groups (admission order).
        assert shares[r] == [k * per_mb + r * (per_mb // world) + i
                             for k in range(minibatches) for i in range(per_mb // world)]
    assert sorted(g for share in shares for g in share) == list(range(n_groups))


def test_a_share_crosses_in_the_sample_format_and_gives_the_same_rows():
    """What rank 0 sends each other rank: its groups' wire frames, decoded (and validated)
    there into the groups they were, so the rank builds the rows rank 0 would have."""
    groups = [group([1, 2], [[3, 4], [5]]), group([6], [[7], [8, 9, 10]], reward=0.0, greedy=0.25)]
    data = encode_share(groups)
    assert isinstance(data, bytes)
    expected, got = build_batch(groups, pad_id=5), build_batch(decode_share(data), pad_id=5)
    for name in ("tokens", "attention", "loss_mask", "logp_behav", "rewards", "baselines", "group", "prompt_len",
                 "truncated"):
        assert torch.allclose(getattr(got, name), getattr(expected, name), equal_nan=True, rtol=0, atol=0), name


def test_scatter_over_a_one_rank_group_returns_the_rows_of_every_group(tmp_path):
    groups = [group([1, 2], [[3, 4], [5]]), group([6], [[7], [8, 9, 10]], reward=0.0)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        local = scatter_batch(groups, 5, 0, 1, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    expected = build_batch(groups, pad_id=5)
    for name in ("tokens", "attention", "loss_mask", "logp_behav", "rewards", "group", "prompt_len", "truncated"):
        assert torch.equal(getattr(local, name), getattr(expected, name)), name
    assert local.tokens[2].tolist() == [6, 7, 5, 5] and torch.isnan(local.baselines).all()


def test_a_multi_turn_response_scores_only_the_policys_tokens_and_places_its_steps():
    turns = Response(np.array([4, 5, 90, 91, 6]), np.array([-0.5, -0.25, 0.0, 0.0, -1.0]), np.zeros(5),
                     policy_mask=np.array([1, 1, 0, 0, 1]), step_ends=np.array([1, 4]),
                     step_rewards=np.array([0.5, 1.0]))
    single = Response(np.array([7, 8]), np.array([-0.1, -0.2]), np.zeros(2))
    g = ExperienceGroup.from_responses([turns, single], actor_id=0, group=0, prompt_id=0, version=0,
                                       prompt_tokens=np.array([1, 2], np.int32),
                                       rewards=np.array([1.5, 0.25], np.float32),
                                       truncated=np.zeros(2, np.uint8), gen_seconds=0.0)
    batch = build_batch([g], pad_id=PAD)
    assert batch.tokens.tolist() == [[1, 2, 4, 5, 90, 91, 6], [1, 2, 7, 8, PAD, PAD, PAD]]
    # Position t predicts token t+1: the environment's 90, 91 (positions 3, 4) are context.
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert batch.logp_behav.tolist() == [[0, -0.5, -0.25, 0, 0, -1.0],
                                         [0, pytest.approx(-0.1), pytest.approx(-0.2), 0, 0, 0]]
    nan = float("nan")
    steps = torch.where(batch.step_rewards.isnan(), nan, batch.step_rewards)
    # The steps end at response offsets 1 and 4 (tokens 5 and 6); a response without steps
    # has one, its reward at its last policy token.
    assert torch.equal(steps.isnan(), torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]], dtype=torch.bool))
    assert batch.step_rewards[0, 2] == 0.5 and batch.step_rewards[0, 5] == 1.0 and batch.step_rewards[1, 2] == 0.25


def test_unscorable_samples_train_nothing_and_leave_their_groups_statistics():
    from msgspec.structs import replace

    from async_rl.algorithms.advantages import group_advantages

    scored = group([1], [[2, 3], [4], [5, 6], [7]])
    scored = replace(scored, rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32))
    # The same group with a fifth sample whose reward call failed: its value (the fallback, or
    # anything) must not move the others' advantages.
    failed = group([1], [[2, 3], [4], [5, 6], [7], [8, 9]])
    failed = replace(failed, rewards=np.array([1.0, 0.0, 1.0, 0.0, 1000.0], np.float32),
                     unscorable=np.array([0, 0, 0, 0, 1], np.uint8))
    batch = build_batch([failed], pad_id=PAD)
    assert batch.loss_mask[4].sum() == 0 and batch.loss_mask[:4].sum() == 6
    adv = group_advantages(batch.rewards, batch.group, method="grpo")
    expected = group_advantages(build_batch([scored], pad_id=PAD).rewards, torch.zeros(4, dtype=torch.int64),
                                method="grpo")
    assert torch.allclose(adv[:4], expected) and adv[4] == 0
    assert int(batch.group[4]) not in batch.group[:4].tolist()


def test_a_group_left_with_one_scorable_sample_is_dropped_whole():
    from msgspec.structs import replace

    dropped = replace(group([1], [[2], [3], [4]]), unscorable=np.array([1, 0, 1], np.uint8))
    kept = group([1], [[5], [6]])
    batch = build_batch([dropped, kept], pad_id=PAD)
    assert batch.loss_mask[:3].sum() == 0 and batch.loss_mask[3:].sum() == 2
    assert len(set(batch.group[:3].tolist())) == 3 and batch.group[3:].tolist() == [1, 1]
