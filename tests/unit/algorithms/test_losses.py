"""The policy-loss registry: each `train.loss` choice is its formula (ppo.py, gspo.py,
cispo.py, opmd.py; tested by hand and by reference elsewhere) behind one call shape, with its
metrics under their final keys and the units its loss is a mean over; and every loss with
every `train.correction`."""

from __future__ import annotations

import pytest
import torch
from reference_formulas import AGGS, batch, close

from async_rl.algorithms.aggregation import agg_denominator
from async_rl.algorithms.cispo import cispo_loss
from async_rl.algorithms.config import CORRECTION_VARIANTS
from async_rl.algorithms.corrections import correct, icepop
from async_rl.algorithms.gspo import gspo_loss
from async_rl.algorithms.losses import CLIP_FRACTIONS, LOSSES, LossInputs, LossOutput
from async_rl.algorithms.opmd import opmd_loss
from async_rl.algorithms.ppo import ppo_clip_loss
from async_rl.algorithms.step_metrics import Mean
from async_rl.config import build_config
from async_rl.config.section import variant_names


def inputs(x, train: dict, seed_adv: bool = True) -> LossInputs:
    """`train`: a train section, whose loss, agg and correction the loss gets (the
    correction computed as the learner computes it)."""
    cfg = build_config({"train": train}).train
    return LossInputs(x.logp, x.prox, x.behav, x.adv_seq if seed_adv else x.adv_tok, x.mask, x.rewards, x.group,
                      cfg.loss, cfg.agg, correct(cfg.correction, x.prox, x.behav, x.mask))


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_entry_is_ppo_clip_loss_with_the_config(agg):
    x = batch(0)
    train = {"agg": agg, "loss": {"name": "ppo", "eps_low": 0.15, "eps_high": 0.28, "dual_clip": 2.0,
                                  "log_ratio_clamp": 5.0}, "correction": {"name": "icepop", "low": 0.5, "high": 1.5}}
    out = LOSSES["ppo"](inputs(x, train))
    weights = icepop(x.prox - x.behav, x.mask, 0.5, 1.5).weights
    loss, stats = ppo_clip_loss(x.logp, x.prox, x.adv_seq, x.mask, weights=weights, eps_low=0.15, eps_high=0.28,
                                agg=agg, dual_clip=2.0, log_ratio_clamp=5.0)
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
    close(out.loss, loss.detach())  # opmd's default correction is none
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


@pytest.mark.parametrize("agg", AGGS)
def test_gspo_and_cispo_entries_are_their_formulas_with_the_config(agg):
    x = batch(3)
    correction = {"name": "geometric_mask", "low": 0.5, "high": 2.0}
    gspo_out = LOSSES["gspo"](inputs(x, {"agg": agg, "correction": correction,
                                         "loss": {"name": "gspo", "eps_low": 0.01, "eps_high": 0.02}}))
    kept = correct(build_config({"train": {"correction": correction}}).train.correction, x.prox, x.behav, x.mask)
    loss, _ = gspo_loss(x.logp, x.prox, x.adv_seq, x.mask, weights=kept.weights, keep=kept.keep, eps_low=0.01,
                        eps_high=0.02)
    close(gspo_out.loss, loss.detach())
    # GSPO is a mean over responses whatever train.agg says
    assert LOSSES["gspo"].units(x.mask, x.group, agg) == agg_denominator(x.mask, "seq-mean-token-mean")
    cispo_out = LOSSES["cispo"](inputs(x, {"agg": agg, "loss": {"name": "cispo", "eps_high": 0.5}}))
    weights = correct(build_config({}).train.correction, x.prox, x.behav, x.mask).weights
    loss, _ = cispo_loss(x.logp, x.prox, x.adv_seq, x.mask, weights=weights, eps_high=0.5, agg=agg)
    close(cispo_out.loss, loss.detach())
    assert LOSSES["cispo"].units(x.mask, x.group, agg) == agg_denominator(x.mask, agg)


CORRECTIONS = [name for variant in CORRECTION_VARIANTS for name in variant_names(variant)]


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_every_correction_works_with_every_loss(loss, correction):
    """Finite loss and gradient, none on padding, and none on a token the correction masks
    (a masked token's own log-prob gets no gradient, whatever the loss)."""
    x = batch(4)
    # bounds loose enough that some tokens stay and tight enough that some go
    knobs = {"icepop": {"low": 0.6, "high": 1.6}, "sequence_mask": {"low": 0.2, "high": 5.0},
             "geometric_mask": {"low": 0.7, "high": 1.4}, "m2po": {"threshold": 0.3},
             "kl_reject": {"threshold": 0.3, "level": "token"}}.get(correction, {})
    train = {"loss": loss, "correction": {"name": correction, **knobs},
             "minibatches": 2}  # a proximal policy apart from the current one
    x_in = inputs(x, train)
    out = LOSSES[loss](x_in)
    (grad,) = torch.autograd.grad(out.loss, x.logp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and (grad[x.mask == 0] == 0).all()
    masked = x.mask.bool() & ~x_in.correction.keep
    if correction in ("icepop", "m2po", "kl_reject", "sequence_mask", "geometric_mask"):
        assert masked.any() and x_in.correction.keep.any(), "the bounds must exercise the mask"
    if loss != "opmd":  # OPMD's masked tokens leave the sequence sums, so their gradient is 0 too
        assert (grad[masked] == 0).all()
    else:
        assert (grad[masked] == 0).all()
