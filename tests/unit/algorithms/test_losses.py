"""The policy-loss registry: each `train.loss` choice is its formula (ppo.py, opmd.py; tested
by hand and by reference elsewhere) behind one call shape, with its metrics under their final
keys and the units its loss is a mean over."""

from __future__ import annotations

import pytest
import torch
from reference_formulas import AGGS, batch, close

from async_rl.algorithms.aggregation import agg_denominator
from async_rl.algorithms.losses import CLIP_FRACTIONS, LOSSES, LossInputs, LossOutput
from async_rl.algorithms.opmd import opmd_loss
from async_rl.algorithms.ppo import ppo_clip_loss
from async_rl.algorithms.step_metrics import Mean
from async_rl.config import build_config


def inputs(x, train: dict, seed_adv: bool = True) -> LossInputs:
    """`train`: a train section, whose loss and agg the loss gets."""
    cfg = build_config({"train": train}).train
    return LossInputs(x.logp, x.prox, x.behav, x.adv_seq if seed_adv else x.adv_tok, x.mask, x.rewards, x.group,
                      cfg.loss, cfg.agg)


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_entry_is_ppo_clip_loss_with_the_config(agg):
    x = batch(0)
    train = {"agg": agg, "loss": {"name": "ppo", "eps_low": 0.15, "eps_high": 0.28, "is_cap": 1.5, "dual_clip": 2.0,
                                  "is_mode": "mask", "log_ratio_clamp": 5.0}}
    out = LOSSES["ppo"](inputs(x, train))
    loss, stats = ppo_clip_loss(x.logp, x.prox, x.behav, x.adv_seq, x.mask, eps_low=0.15, eps_high=0.28, is_cap=1.5,
                                agg=agg, dual_clip=2.0, is_mode="mask", log_ratio_clamp=5.0)
    assert isinstance(out, LossOutput)
    close(out.loss, loss.detach())
    tokens = float(x.mask.sum())
    # token means of the micro-batch, weighted by its response tokens when the step sums them
    assert out.metrics == {key: Mean(value * tokens, tokens) for key, value in stats.items()}
    assert set(CLIP_FRACTIONS) <= out.metrics.keys()
    assert LOSSES["ppo"].units(x.mask, x.group, agg) == agg_denominator(x.mask, agg)


@pytest.mark.parametrize("length_norm", [False, True])
def test_opmd_entry_is_opmd_loss_with_the_config(length_norm):
    x = batch(1)
    out = LOSSES["opmd"](inputs(x, {"loss": {"name": "opmd", "tau": 0.3, "length_norm": length_norm}}))
    loss, stats = opmd_loss(x.logp, x.behav, x.mask, x.rewards, x.group, tau=0.3, length_norm=length_norm)
    close(out.loss, loss.detach())
    samples, tokens = x.mask.shape[0], float(x.mask.sum())
    for key, value in stats.items():  # means over the responses, weighted by their number
        assert out.metrics[key] == Mean(value * samples, samples), key
    # nothing clipped or capped, still on every step line
    assert {key: out.metrics[key] for key in CLIP_FRACTIONS} == {key: Mean(0.0, tokens) for key in CLIP_FRACTIONS}
    assert out.metrics.keys() == stats.keys() | set(CLIP_FRACTIONS)
    # a mean over the prompt groups present (4 distinct ids), whatever train.agg says
    for agg in AGGS:
        assert LOSSES["opmd"].units(x.mask, x.group, agg) == 4.0


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_has_one_call_shape(name):
    x = batch(2)
    out = LOSSES[name](inputs(x, {"loss": name}))
    assert out.loss.dim() == 0 and out.loss.requires_grad and torch.isfinite(out.loss)
    (grad,) = torch.autograd.grad(out.loss, x.logp)
    assert torch.isfinite(grad).all() and (grad[x.mask == 0] == 0).all()
    assert set(CLIP_FRACTIONS) <= out.metrics.keys()  # the run directory contract: is/clip_frac on every step line
    assert all(isinstance(f, Mean) and f.weight > 0 for f in out.metrics.values())
    assert LOSSES[name].units(x.mask, x.group, "token-mean") > 0
