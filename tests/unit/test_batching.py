"""batching.py: the row layout of a batch (prompt ++ response ++ pad, predictions shifted
by one), the order that gives each learner rank whole groups of every minibatch, and
the scatter over a real one-process gloo group."""
import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

from async_rl.batching import build_batch, order_for_ranks, scatter_batch
from async_rl.transport import ExperienceGroup, Response

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
def test_each_rank_block_holds_its_share_of_every_minibatch(world, minibatches):
    n_groups, G = 8, 2
    batch = build_batch([group([g + 1], [[g + 1]] * G) for g in range(n_groups)], pad_id=PAD)
    ordered = order_for_ranks(batch, G, world, minibatches)
    per_rank = n_groups // world
    for r in range(world):
        block = ordered.tokens[r * per_rank * G:(r + 1) * per_rank * G, 0].tolist()[::G]
        per_mb = n_groups // minibatches
        # Rank r's k-th slice: its part of the k-th run of consecutive groups (admission order).
        expected = [k * per_mb + r * (per_mb // world) + i + 1
                    for k in range(minibatches) for i in range(per_mb // world)]
        assert block == expected


def test_scatter_over_a_one_rank_group_returns_the_batch(tmp_path):
    batch = build_batch([group([1, 2], [[3, 4], [5]])], pad_id=PAD)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        local = scatter_batch(batch, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    for name in ("tokens", "attention", "loss_mask", "logp_behav", "rewards", "group", "prompt_len", "truncated"):
        assert torch.equal(getattr(local, name), getattr(batch, name)), name
    assert torch.isnan(local.baselines).all()
