"""PPO (decoupled / naive, dual clip, every statistic) and OPMD (length_norm, groups of one)
against hand arithmetic and independent references.

The references (tests/reference_formulas.py) are written from the formulas of docs/algorithms.md (Notation and formulas)
without calling async_rl code. The tests compare the library's values *and*
`torch.autograd.grad` of its losses against them in float64 on random right-padded batches
with inf/nan garbage in every padded position. tests/test_algorithms.py already covers the
basic PPO / OPMD loop references (values, autograd-vs-autograd).
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_formulas import (
    AGGS,
    ATOL,
    INF,
    LENGTHS,
    NAN,
    D,
    agg_coef,
    batch,
    close,
    garbage_pad,
    grad_of,
    ref_off_policy,
    ref_opmd,
    ref_ppo,
    resp,
    t,
)
from token_is_ppo import ppo_with_token_is

from async_rl.algorithms.importance import off_policy_figures
from async_rl.algorithms.losses import LOSSES
from async_rl.algorithms.opmd import opmd_loss

# ============================================================== PPO


def check_ppo_stats(got: dict, ref: dict):
    for key, value in ref.items():
        # the library divides integer counts in float32: fractions agree to ~1e-7 only
        tol = dict(rel=1e-6, abs=1e-7) if "frac" in key else dict(rel=0, abs=ATOL)
        assert got[key] == pytest.approx(value, **tol), key


def off_policy(prox, behav, mask) -> dict[str, float]:
    """The learner's is/ess and is/mismatch_kl of one batch (whatever the loss)."""
    _, figures = off_policy_figures(prox, behav, mask)
    return {key: figures[key].value() for key in ("is/ess", "is/mismatch_kl")}


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "naive"])
@pytest.mark.parametrize("dual_clip", [None, 2.0], ids=["no-dual", "dual2"])
@pytest.mark.parametrize("adv_kind", ["seq", "tok"])
@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
def test_ppo_matches_reference(agg, decoupled, dual_clip, adv_kind, is_mode):
    seen = {k: 0.0 for k in ("is/clip_frac_low", "is/clip_frac_high", "is/dual_clip_frac", "is/capped_frac")}
    for seed in (0, 1):
        x = batch(seed)
        adv = x.adv_seq if adv_kind == "seq" else x.adv_tok
        kw = dict(eps_low=0.15, eps_high=0.28, is_cap=1.5, decoupled=decoupled, agg=agg, dual_clip=dual_clip,
                  is_mode=is_mode)
        loss, stats = ppo_with_token_is(x.logp, x.prox, x.behav, adv, x.mask, **kw)
        ref_loss, ref_grad, ref_stats = ref_ppo(x.logp, x.prox, x.behav, adv, x.mask, **kw)
        close(loss, ref_loss)
        close(grad_of(loss, x.logp), ref_grad)  # includes exact 0 on padding
        check_ppo_stats(stats, ref_stats)
        check_ppo_stats(off_policy(x.prox, x.behav, x.mask), ref_off_policy(x.prox, x.behav, x.mask))
        for k in seen:
            seen[k] += stats[k]
    # the batches really exercise both clip sides, the IS cap and the dual clip
    assert seen["is/clip_frac_low"] > 0 and seen["is/clip_frac_high"] > 0
    assert (seen["is/capped_frac"] > 0) == decoupled
    assert (seen["is/dual_clip_frac"] > 0) == (dual_clip is not None)


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_decoupled_hand(agg):
    # prox = 0, so raw w = exp(-behav) and r = exp(logp). Row 0 (A=+1):
    #   r=1.5 w=2 (raw 3, capped): min(1.5, 1.2) = 1.2 clipped high -> loss -2.4, grad 0
    #   r=0.7 w=0.5: min(0.7, 0.85) = 0.7                          -> loss -0.35, grad -w*A*r = -0.35
    #   r=1.1 w=1:                                                  -> loss -1.1,  grad -1.1
    # Row 1 (A=-2): r=0.6 w=1.5: min(-1.2, 0.85*-2 = -1.7) = -1.7 clipped low -> loss 2.55, grad 0
    # Row 2 fully padded. Padding is garbage everywhere.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    logp = garbage_pad(t([[math.log(1.5), math.log(0.7), math.log(1.1)], [math.log(0.6), 0, 0], [0] * 3]), mask)
    behav = garbage_pad(t([[-math.log(3.0), -math.log(0.5), 0.0], [-math.log(1.5), 0, 0], [0] * 3]), mask)
    prox = garbage_pad(torch.zeros(3, 3, dtype=D), mask)
    logp.requires_grad_()
    adv = t([1.0, -2.0, NAN])
    loss, st = ppo_with_token_is(logp, prox, behav, adv, mask, eps_low=0.15, eps_high=0.2, is_cap=2.0, agg=agg)
    row0, row1 = -2.4 - 0.35 - 1.1, 2.55  # -3.85, 2.55
    g_row0 = t([0.0, -0.35, -1.1])
    if agg == "token-mean":  # (-3.85 + 2.55) / 4 = -0.325
        value, g0 = (row0 + row1) / 4, g_row0 / 4
    elif agg == "seq-mean-token-mean":  # (-3.85/3 + 2.55) / 2 = 0.6341667
        value, g0 = (row0 / 3 + row1) / 2, g_row0 / 6
    else:  # (-3.85 + 2.55) / 2 = -0.65
        value, g0 = (row0 + row1) / 2, g_row0 / 2
    close(loss, value)
    expected_grad = torch.zeros(3, 3, dtype=D)
    expected_grad[0] = g0
    close(grad_of(loss, logp), expected_grad)
    check_ppo_stats(st, {"is/clip_frac": 0.5, "is/clip_frac_low": 0.25, "is/clip_frac_high": 0.25,
                         "is/dual_clip_frac": 0.0, "is/capped_frac": 0.25, "is/weight_mean": 1.25,
                         "is/ratio_mean": (1.5 + 0.7 + 1.1 + 0.6) / 4})
    # The logged ESS is of the raw weights 3, 0.5, 1, 1.5 (not the capped 2, 0.5, 1, 1.5):
    # sum 6, sum w^2 = 12.5 -> ESS = 36 / (4 * 12.5) = 0.72
    # mismatch k3(d = behav - prox = -ln raw) = raw - 1 - ln raw
    mismatch = sum(raw - 1 - math.log(raw) for raw in (3.0, 0.5, 1.0, 1.5)) / 4  # 0.29727
    check_ppo_stats(off_policy(prox, behav, mask), {"is/ess": 0.72, "is/mismatch_kl": mismatch})


def test_ppo_dual_clip_hand():
    # naive (anchor = behav = 0), token advantages A = -1, -1, -1, +1, ratios 4, 2, 0.5, 5, dual_clip = 3:
    #   r=4, A<0: min(-4, -1.2) = -4; max(-4, 3*-1 = -3) = -3  -> loss 3, dual active, grad 0
    #   r=2, A<0: min(-2, -1.2) = -2; max(-2, -3) = -2         -> loss 2, grad -A*r = 2
    #   r=.5 A<0: min(-0.5, -0.8) = -0.8 (clipped low)         -> loss 0.8, grad 0
    #   r=5, A>0: min(5, 1.2) = 1.2 (clipped high; no dual for A>0) -> loss -1.2, grad 0
    # token-mean: (3 + 2 + 0.8 - 1.2) / 4 = 1.15; grad [0, 2, 0, 0] / 4
    # without dual clip the first token is rA = -4 -> loss 4, grad 4: (4 + 2 + 0.8 - 1.2) / 4 = 1.4
    zero, mask = torch.zeros(1, 4, dtype=D), torch.ones(1, 4)
    logp = t([[math.log(4.0), math.log(2.0), math.log(0.5), math.log(5.0)]]).requires_grad_()
    adv = t([[-1.0, -1.0, -1.0, 1.0]])
    loss, st = ppo_with_token_is(logp, zero, zero, adv, mask, decoupled=False, dual_clip=3.0)
    close(loss, 1.15)
    close(grad_of(loss, logp), [[0.0, 0.5, 0.0, 0.0]])
    assert st["is/dual_clip_frac"] == pytest.approx(0.25)
    assert st["is/clip_frac"] == pytest.approx(0.5)
    assert st["is/clip_frac_low"] == pytest.approx(0.25) and st["is/clip_frac_high"] == pytest.approx(0.25)
    loss, st = ppo_with_token_is(logp, zero, zero, adv, mask, decoupled=False)
    close(loss, 1.4)
    close(grad_of(loss, logp), [[1.0, 0.5, 0.0, 0.0]])
    assert st["is/dual_clip_frac"] == 0.0
    # decoupled with w = 2 on every token (prox - behav = ln 2, cap 3): every loss doubles
    loss, _ = ppo_with_token_is(logp, zero, zero - math.log(2.0), adv, mask, is_cap=3.0, dual_clip=3.0)
    close(loss, 2.3)
    close(grad_of(loss, logp), [[0.0, 1.0, 0.0, 0.0]])


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
def test_ppo_is_mode_hand(agg, is_mode):
    # prox = 0: raw w = exp(-behav) = 3, 0.5, 1.5 with is_cap 2; r = exp(logp) = 1.1, 0.9, 1.0 (no clip
    # at eps 0.2); A = +1, +1, -1. d loss_t / d logp_t = -w * r * A.
    #   truncate: w = 2, 0.5, 1.5 -> loss_t -2.2, -0.45, 1.5; grads -2.2, -0.45, 1.5
    #   mask:     w = 0, 0.5, 1.5 -> loss_t  0,   -0.45, 1.5; grads  0,   -0.45, 1.5
    # The dropped token still counts in the denominator (AReaL): token-mean and seq-mean-token-mean
    # divide by 3 tokens, seq-mean-token-sum by 1 sequence, in both modes.
    mask = torch.ones(1, 3)
    logp = t([[math.log(1.1), math.log(0.9), 0.0]]).requires_grad_()
    behav = t([[-math.log(3.0), -math.log(0.5), -math.log(1.5)]])
    prox = torch.zeros(1, 3, dtype=D)
    adv = t([[1.0, 1.0, -1.0]])
    loss, st = ppo_with_token_is(logp, prox, behav, adv, mask, is_cap=2.0, agg=agg, is_mode=is_mode)
    token_loss = [-2.2, -0.45, 1.5] if is_mode == "truncate" else [0.0, -0.45, 1.5]
    token_grad = [-2.2, -0.45, 1.5] if is_mode == "truncate" else [0.0, -0.45, 1.5]
    denom = 1.0 if agg == "seq-mean-token-sum" else 3.0
    close(loss, sum(token_loss) / denom)
    close(grad_of(loss, logp), [[g / denom for g in token_grad]])
    w = [2.0, 0.5, 1.5] if is_mode == "truncate" else [0.0, 0.5, 1.5]
    check_ppo_stats(st, {"is/capped_frac": 1 / 3, "is/weight_mean": sum(w) / 3})
    # The logged ESS is of the raw weights 3, 0.5, 1.5, the same in both modes
    check_ppo_stats(off_policy(prox, behav, mask), {"is/ess": 5 ** 2 / (3 * 11.5)})
    # naive PPO has no importance weight: the mode changes nothing
    naive_t, _ = ppo_with_token_is(logp, prox, behav, adv, mask, agg=agg, decoupled=False)
    naive_m, _ = ppo_with_token_is(logp, prox, behav, adv, mask, agg=agg, decoupled=False, is_mode="mask")
    close(naive_m, naive_t.detach())


def test_token_correction_mode_must_be_known():
    z = torch.zeros(1, 1, dtype=D)
    with pytest.raises(ValueError, match="unknown mode"):
        ppo_with_token_is(z, z, z, torch.zeros(1, dtype=D), torch.ones(1, 1), is_mode="drop")


@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_ppo_log_ratio_clamp_hand(dtype):
    # naive PPO, anchor behav = 0, log-ratios 50, -50, ln 1.1 with A = -1, +1, +1; clamp at 20:
    #   r = e^20:  min(-e^20, -1.2) = -e^20  -> loss_t e^20,   grad 0 (clamped: constant in logp)
    #   r = e^-20: min(e^-20, 0.8) = e^-20   -> loss_t -e^-20, grad 0
    #   r = 1.1:   min(1.1, 1.1) = 1.1       -> loss_t -1.1,   grad -r*A = -1.1
    # token-mean: (e^20 - e^-20 - 1.1) / 3. Unclamped, the first token alone would be e^50 ~ 5e21.
    mask = torch.ones(1, 3)
    logp = torch.tensor([[50.0, -50.0, math.log(1.1)]], dtype=dtype, requires_grad=True)
    zero = torch.zeros(1, 3, dtype=dtype)
    adv = torch.tensor([[-1.0, 1.0, 1.0]], dtype=dtype)
    loss, st = ppo_with_token_is(logp, zero, zero, adv, mask, decoupled=False)
    # A few roundings in the dtype: exp (within an ulp, by the CPU's vector library), a
    # sum of three, a division.
    rounding = 8 * torch.finfo(dtype).eps
    expected = (math.exp(20) - math.exp(-20) - 1.1) / 3
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected, rel=rounding)
    grad = grad_of(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1.1 / 3]], dtype=dtype))
    assert st["is/ratio_mean"] == pytest.approx((math.exp(20) + math.exp(-20) + 1.1) / 3, rel=rounding)
    # float32 exp(100) = inf: only the clamp keeps the loss and the gradient finite
    far = torch.tensor([[100.0, -100.0, 0.0]], dtype=dtype, requires_grad=True)
    loss, _ = ppo_with_token_is(far, zero, zero, adv, mask, decoupled=False)
    assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, far)).all()
    # decoupled: the correction clamps the proximal/behavior log-ratio to +-20 whatever the
    # loss's clamp (w = e^20 with an infinite cap)
    logp0 = torch.zeros(1, 1, dtype=dtype, requires_grad=True)
    prox, behav = torch.zeros(1, 1, dtype=dtype), torch.full((1, 1), -50.0, dtype=dtype)
    loss, st = ppo_with_token_is(logp0, prox, behav, torch.ones(1, dtype=dtype), torch.ones(1, 1),
                                 is_cap=float("inf"), log_ratio_clamp=5.0)
    assert loss.item() == pytest.approx(-math.exp(20), rel=rounding)
    assert st["is/weight_mean"] == pytest.approx(math.exp(20), rel=rounding)
    torch.testing.assert_close(grad_of(loss, logp0), torch.tensor([[-math.exp(20)]], dtype=dtype))


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_ppo_log_ratio_clamp_must_be_positive(bad):
    z = torch.zeros(1, 1, dtype=D)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        ppo_with_token_is(z, z, z, torch.zeros(1, dtype=D), torch.ones(1, 1), log_ratio_clamp=bad)


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0])
def test_ppo_dual_clip_must_exceed_one(bad):
    z = torch.zeros(1, 1, dtype=D)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_with_token_is(z, z, z, torch.zeros(1, dtype=D), torch.ones(1, 1), dual_clip=bad)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_ppo_zero_staleness_decoupled_equals_standard_ppo(agg, dual_clip):
    # logp_behav == logp_prox (no staleness), logp != logp_prox (later minibatch step): w = 1 and
    # the trust region is centred on the same policy, so decoupled == naive PPO, value and gradient.
    x = batch(2)
    # is_cap = 1 = the raw weight: "capped" means raw > cap strictly, so capped_frac stays 0
    kw = dict(eps_low=0.15, eps_high=0.28, is_cap=1.0, agg=agg, dual_clip=dual_clip)
    dec, st = ppo_with_token_is(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=True, **kw)
    naive, _ = ppo_with_token_is(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=False, **kw)
    g_dec = grad_of(dec, x.logp)
    close(dec, naive)
    close(g_dec, grad_of(naive, x.logp))
    ref_loss, ref_grad, _ = ref_ppo(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=False, **kw)
    close(dec, ref_loss)
    close(g_dec, ref_grad)
    assert st["is/weight_mean"] == pytest.approx(1.0) and st["is/capped_frac"] == 0.0
    assert off_policy(x.prox, x.prox, x.mask) == {"is/ess": pytest.approx(1.0), "is/mismatch_kl": 0.0}
    assert st["is/clip_frac"] > 0  # the ratios are far from 1: clipping is in play


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("adv_kind", ["seq", "tok"])
def test_ppo_one_step_decoupled_is_weighted_policy_gradient(agg, adv_kind):
    # logp_prox = logp.detach(), stale behav: r = 1, no clipping, gradient = -c_bt * w * A (d r / d logp = 1)
    x = batch(3)
    adv = x.adv_seq if adv_kind == "seq" else x.adv_tok
    loss, st = ppo_with_token_is(x.logp, x.logp.detach(), x.behav, adv, x.mask, is_cap=1.5, agg=agg, dual_clip=2.0)
    expected_grad, expected_loss = torch.zeros_like(x.prox), 0.0
    for (b, s), c in agg_coef(x.mask, agg).items():
        w = min(math.exp(float(x.logp.detach()[b, s]) - float(x.behav[b, s])), 1.5)
        a = float(adv[b]) if adv_kind == "seq" else float(adv[b, s])
        expected_grad[b, s] = -c * w * a
        expected_loss += -c * w * a
    close(loss, expected_loss)
    close(grad_of(loss, x.logp), expected_grad)
    assert st["is/clip_frac"] == 0.0 and st["is/dual_clip_frac"] == 0.0 and st["is/ratio_mean"] == pytest.approx(1.0)
    assert st["is/capped_frac"] > 0  # the cap is exercised


@pytest.mark.parametrize("decoupled", [True, False])
def test_ppo_all_padding_batch(decoupled):
    mask = torch.zeros(2, 3)
    logp = garbage_pad(torch.zeros(2, 3, dtype=D), mask).requires_grad_()
    junk = garbage_pad(torch.zeros(2, 3, dtype=D), mask)
    loss, st = ppo_with_token_is(logp, junk, junk, t([NAN, INF]), mask, decoupled=decoupled, dual_clip=2.0)
    assert loss.item() == 0.0
    close(grad_of(loss, logp), torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in st.values())


# ============================================================== OPMD


@pytest.mark.parametrize("length_norm", [True, False])
def test_opmd_hand_length_norm(length_norm):
    # tau = 0.5, groups (out of order): 7 -> rows 0, 1, 3 (row 3 fully padded); -3 -> row 2 alone.
    # S - S_behav: row0 (-0.5-0.7) - (-0.6) = -0.6 over 2 tokens; row1 -2.0 - (-1.2) = -0.8 over 4;
    # row2 -1.0 - (-0.4) = -0.6 over 1; row3 0 (no tokens, length clamps to 1).
    # group 7 rewards 1, 0, 0.5 -> mean 0.5.
    # length_norm: x = -0.3, -0.2, -0.6, 0
    #   residuals r - mean - tau*x: 0.5 + 0.15 = 0.65, -0.5 + 0.1 = -0.4, (row2) 0 + 0.3 = 0.3, 0
    #   loss = ((0.65^2 + 0.4^2 + 0) / 3 + 0.3^2) / 2 = (0.5825/3 + 0.09) / 2 = 0.14208333
    #   grad per token of row j = 2*res_j*(-tau) / (G*k_j*len_j):
    #   row0 -0.65/12, row1 0.4/24, row2 -0.3/2
    # raw log-ratios: x = -0.6, -0.8, -0.6, 0 -> residuals 0.8, -0.1, 0.3, 0
    #   loss = ((0.64 + 0.01) / 3 + 0.09) / 2; grads row0 -0.8/6, row1 0.1/6, row2 -0.3/2
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    logp = garbage_pad(t([[-0.5, -0.7, 0, 0], [-0.5] * 4, [-1.0, 0, 0, 0], [0] * 4]), mask).requires_grad_()
    behav = garbage_pad(t([[-0.3, -0.3, 0, 0], [-0.3] * 4, [-0.4, 0, 0, 0], [0] * 4]), mask)
    rewards, group = t([1.0, 0.0, 1.0, 0.5]), torch.tensor([7, 7, -3, 7])
    loss, st = opmd_loss(logp, behav, mask, rewards, group, tau=0.5, length_norm=length_norm)
    if length_norm:
        value, g = (0.5825 / 3 + 0.09) / 2, (-0.65 / 12, 0.4 / 24, -0.15)
    else:
        value, g = (0.65 / 3 + 0.09) / 2, (-0.8 / 6, 0.1 / 6, -0.15)
    close(loss, value)
    expected = torch.zeros(4, 4, dtype=D)
    expected[0, :2], expected[1, :], expected[2, 0] = g
    close(grad_of(loss, logp), expected)
    assert LOSSES["opmd"].units(mask, group, "token-mean") == 2.0  # the loss is a mean over 2 groups


@pytest.mark.parametrize("length_norm", [False, True])
@pytest.mark.parametrize("tau", [1.0, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_opmd_matches_reference(length_norm, tau, seed):
    x = batch(seed)
    loss, stats = opmd_loss(x.logp, x.behav, x.mask, x.rewards, x.group, tau=tau, length_norm=length_norm)
    ref_loss, ref_grad = ref_opmd(x.logp, x.behav, x.mask, x.rewards, x.group, tau=tau, length_norm=length_norm)
    close(loss, ref_loss)
    close(grad_of(loss, x.logp), ref_grad)
    assert LOSSES["opmd"].units(x.mask, x.group, "token-mean") == 4.0
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("length_norm", [False, True])
def test_opmd_groups_of_one(length_norm):
    # every group has one member: mean(r) = r, residual = -tau * x, loss = mean_j (tau * x_j)^2
    # over the rows with a response token (row 3 has none: it counts for nothing)
    x = batch(4)
    singles = torch.arange(len(LENGTHS)) * 7 - 20
    loss, _ = opmd_loss(x.logp, x.behav, x.mask, x.rewards, singles, tau=0.4, length_norm=length_norm)
    terms = []
    for b in range(len(LENGTHS)):
        idx = resp(x.mask, b)
        lr = sum(float(x.logp.detach()[b, s]) - float(x.behav[b, s]) for s in idx)
        terms.append((0.4 * lr / (max(len(idx), 1) if length_norm else 1)) ** 2)
    close(loss, sum(terms) / sum(n > 0 for n in LENGTHS))
    _, ref_grad = ref_opmd(x.logp, x.behav, x.mask, x.rewards, singles, tau=0.4, length_norm=length_norm)
    close(grad_of(loss, x.logp), ref_grad)
