"""The advantage registry: every `train.advantage` choice behind one call shape, composed
from the formulas tested by hand and by reference in test_reference_estimators.py."""

from __future__ import annotations

import pytest
import torch
from reference_formulas import D, batch, close, t

from async_rl.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    Advantages,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
    token_rewards,
)
from async_rl.algorithms.gae import gae_advantages
from async_rl.config import build_config

SHARDS = [slice(0, 3), slice(3, 8)]  # two "ranks"


def inputs(x, *, name: str = "grpo", kl_coef: float = 0.0, with_kl: bool = False, rows=slice(None),
           reduce_sum=None, **advantage) -> AdvantageInputs:
    """`advantage`: the train.advantage section's knobs of estimator `name`."""
    section = build_config({"train": {"advantage": {"name": name, **advantage}}}).train.advantage
    kl = torch.where(x.mask.bool(), x.kl, 0.0)[rows] if with_kl else None
    baselines = torch.linspace(-1, 1, x.mask.shape[0], dtype=D)
    return AdvantageInputs(x.rewards[rows], x.mask[rows], x.group[rows], baselines[rows], section, kl_coef, kl,
                           x.values.detach()[rows], reduce_sum)


def test_sequence_rewards_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    kl = t([[0.5, 1.5, 0.0], [-0.2, 0.0, 0.0]])
    grpo = build_config({}).train.advantage
    x = AdvantageInputs(t([1.0, 0.0]), mask, torch.tensor([0, 0]), t([0.0, 0.0]), grpo, 0.1, kl)
    close(x.sequence_rewards(), [1.0 - 0.1 * 2.0, 0.0 + 0.1 * 0.2])
    close(AdvantageInputs(t([1.0, 0.0]), mask, torch.tensor([0, 0]), t([0.0, 0.0]), grpo, 0.1).sequence_rewards(),
          [1.0, 0.0])


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("with_kl", [False, True])
def test_group_relative_entries_see_the_kl_penalized_rewards(method, with_kl):
    x = batch(0)
    a = inputs(x, kl_coef=0.2, with_kl=with_kl)
    out = ADVANTAGES[method](a)
    rewards = x.rewards - 0.2 * torch.where(x.mask.bool(), x.kl, 0.0).sum(-1) if with_kl else x.rewards
    close(out.advantages, group_advantages(rewards, x.group, method=method))
    assert out.returns is None


def test_remax_entry():
    x = batch(1)
    a = inputs(x, kl_coef=0.2, with_kl=True)
    close(ADVANTAGES["remax"](a).advantages, remax_advantages(a.sequence_rewards(), a.baselines))


@pytest.mark.parametrize("with_kl", [False, True])
def test_reinforce_pp_entry_penalizes_kl_per_token(with_kl):
    x = batch(2, prompt=True)
    out = ADVANTAGES["reinforce_pp"](inputs(x, name="reinforce_pp", kl_coef=0.3, with_kl=with_kl, gamma=0.9))
    kl = torch.where(x.mask.bool(), x.kl, 0.0) if with_kl else None
    close(out.advantages, reinforce_pp_advantages(x.rewards, x.mask, kl=kl, kl_coef=0.3, gamma=0.9))


def test_gae_entry_whitens_gae_and_returns_the_critic_targets():
    x = batch(3, prompt=True)
    out = ADVANTAGES["gae"](inputs(x, name="gae", kl_coef=0.1, with_kl=True, gamma=0.95, lam=0.8))
    token_r = token_rewards(x.rewards, x.mask, kl=torch.where(x.mask.bool(), x.kl, 0.0), kl_coef=0.1)
    adv, returns = gae_advantages(token_r, x.values, x.mask, gamma=0.95, lam=0.8)
    close(out.advantages, masked_whiten(adv, x.mask))
    close(out.returns, returns)


def sharded(name: str, x, **kw) -> torch.Tensor:
    """ADVANTAGES[name] on two row shards with reduce_sum simulating an all_reduce(SUM)."""
    local = []
    for rows in SHARDS:  # first pass: each shard's own sums
        ADVANTAGES[name](inputs(x, name=name, rows=rows, reduce_sum=lambda v: local.append(v.clone()) or v, **kw))
    others = [sum(local) - mine for mine in local]  # each shard's view of the other's sums
    outs = [ADVANTAGES[name](inputs(x, name=name, rows=rows, reduce_sum=lambda v, o=others[i]: v + o, **kw))
            for i, rows in enumerate(SHARDS)]
    return torch.cat([o.advantages for o in outs])


@pytest.mark.parametrize("name", ["reinforce_pp", "gae"])
def test_token_level_entries_whiten_over_the_global_batch(name):
    x = batch(4, prompt=True)
    kw = dict(kl_coef=0.2, with_kl=True, gamma=0.9)
    close(sharded(name, x, **kw), ADVANTAGES[name](inputs(x, name=name, **kw)).advantages)


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_every_estimator_has_one_call_shape(name):
    x = batch(5, prompt=True)
    out = ADVANTAGES[name](inputs(x, name=name, kl_coef=0.1, with_kl=True))
    assert isinstance(out, Advantages) and out.advantages.shape in {x.mask.shape[:1], x.mask.shape}
    assert torch.isfinite(out.advantages).all() and not out.advantages.requires_grad
    if out.advantages.dim() == 2:
        assert (out.advantages[x.mask == 0] == 0).all()
    assert (out.returns is not None) == (name == "gae")
