"""grpo_process: GRPO on process rewards (DeepSeekMath, arXiv 2402.03300, 4.1.3), against
values computed by hand, and equal to GRPO when each response is one step."""
import math

import pytest
import torch

from async_rl.algorithms.advantages import ADVANTAGES, group_advantages, process_advantages

NAN = float("nan")


def test_hand_computed_two_responses_three_steps():
    # Response A: steps ending at positions 1 (reward 1) and 3 (reward 0); response B: one
    # step ending at 2 (reward 1). The group's steps: 1, 0, 1 -> mean 2/3, unbiased std
    # sqrt(((1/3)^2 + (2/3)^2 + (1/3)^2) / 2) = sqrt(1/3); normalized +-.
    steps = torch.tensor([[NAN, 1.0, NAN, 0.0, NAN], [NAN, NAN, 1.0, NAN, NAN]])
    mask = torch.ones(2, 5)
    adv = process_advantages(steps, mask, torch.tensor([0, 0]))
    std = math.sqrt(1 / 3) + 1e-6
    up, down = (1 / 3) / std, (-2 / 3) / std
    expected = torch.tensor([[up + down, up + down, down, down, 0.0], [up, up, up, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-6)


def test_one_step_per_response_at_its_end_is_grpo():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, generator=g)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    lengths = torch.tensor([3, 5, 1, 4, 2, 5, 5, 3])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    steps = torch.full((8, 6), NAN)
    steps[torch.arange(8), lengths - 1] = rewards
    adv = process_advantages(steps, mask, group)
    torch.testing.assert_close(adv, group_advantages(rewards, group, method="grpo")[:, None] * mask)


def test_positions_outside_the_mask_are_zero_and_a_lone_step_gives_zero():
    steps = torch.tensor([[NAN, 2.0, NAN]])
    adv = process_advantages(steps, torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([3]))
    assert adv.tolist() == [[0.0, 0.0, 0.0]] and not adv.isnan().any()


@pytest.mark.parametrize("kl", [None, torch.tensor([[0.0, 0.5, 0.5], [0.0, 1.0, 0.0]])])
def test_the_registry_entry_charges_a_reward_kl_to_the_last_step(kl):
    from types import SimpleNamespace

    from async_rl.algorithms.advantages import AdvantageInputs

    steps = torch.tensor([[1.0, NAN, 0.0], [NAN, 1.0, NAN]])
    mask = torch.ones(2, 3)
    x = AdvantageInputs(torch.tensor([1.0, 1.0]), mask, torch.tensor([0, 0]), torch.full((2,), NAN),
                        SimpleNamespace(name="grpo_process"), 0.1, kl=kl, step_rewards=steps)
    expected_steps = steps if kl is None else torch.tensor([[1.0, NAN, 0.0 - 0.1], [NAN, 1.0 - 0.1, NAN]])
    torch.testing.assert_close(ADVANTAGES["grpo_process"](x).advantages,
                               process_advantages(expected_steps, mask, torch.tensor([0, 0])))
