"""Tests for async_rl.algorithms: hand-computed cases plus per-element loop references."""

from __future__ import annotations

import math

import pytest
import torch
from token_is_ppo import ppo_with_token_is

from async_rl.algorithms.advantages import group_advantages, reinforce_pp_advantages, remax_advantages
from async_rl.algorithms.aggregation import agg_denominator, aggregate
from async_rl.algorithms.importance import off_policy_figures
from async_rl.algorithms.kl import kl_estimate
from async_rl.algorithms.losses import LOSSES
from async_rl.algorithms.opmd import opmd_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def off_policy(prox, behav, mask) -> dict[str, float]:
    """The learner's is/ess and is/mismatch_kl of one batch."""
    _, figures = off_policy_figures(prox, behav, mask)
    return {key: figures[key].value() for key in ("is/ess", "is/mismatch_kl")}


# ---------------------------------------------------------------- random padded batches


def random_batch(seed: int = 0):
    """B=7, T=5, right-padded; row 5 is fully padded; groups 40 (x3), 7 (x2), 13 (x1), 40
    again out of order, and padding filled with garbage (inf / nan)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 1, 4, 2, 0, 5]
    B, T = len(lengths), 5
    mask = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    group = torch.tensor([40, 7, 40, 13, 7, 40, 99])
    logp = -torch.rand(B, T, generator=g, dtype=D) * 2
    logp_prox = logp + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    logp_behav = logp_prox + 0.6 * torch.randn(B, T, generator=g, dtype=D)
    pad = mask == 0
    logp = logp.masked_fill(pad, float("inf"))
    logp_prox = logp_prox.masked_fill(pad, float("nan"))
    logp_behav = logp_behav.masked_fill(pad, -float("inf"))
    rewards = torch.randint(0, 3, (B,), generator=g).to(D)
    adv_tok = torch.randn(B, T, generator=g, dtype=D).masked_fill(pad, float("nan"))
    return logp.requires_grad_(), logp_prox, logp_behav, mask, rewards, group, adv_tok


# ---------------------------------------------------------------- loop references


def ref_aggregate(vals: list[list], mask, agg):
    """vals[b][t] torch scalars (or None on padding)."""
    B, T = mask.shape
    if agg == "token-mean":
        terms = [vals[b][t] for b in range(B) for t in range(T) if mask[b, t]]
        return sum(terms) / max(len(terms), 1)
    seqs = []
    for b in range(B):
        toks = [vals[b][t] for t in range(T) if mask[b, t]]
        if toks:
            seqs.append(sum(toks) / (len(toks) if agg == "seq-mean-token-mean" else 1))
    return sum(seqs) / max(len(seqs), 1)


def ref_ppo(logp, prox, behav, adv, mask, eps_low, eps_high, cap, decoupled, agg):
    B, T = mask.shape
    vals = [[None] * T for _ in range(B)]
    for b in range(B):
        for s in range(T):
            if not mask[b, s]:
                continue
            a = float(adv[b, s]) if adv.dim() == 2 else float(adv[b])
            anchor = float(prox[b, s]) if decoupled else float(behav[b, s])
            w = min(math.exp(float(prox[b, s]) - float(behav[b, s])), cap) if decoupled else 1.0
            r = torch.exp(logp[b, s] - anchor)
            rc = torch.clamp(r, 1 - eps_low, 1 + eps_high)
            vals[b][s] = -w * torch.minimum(r * a, rc * a)
    return ref_aggregate(vals, mask, agg)


def ref_opmd(logp, behav, mask, rewards, group, tau):
    B, T = mask.shape
    groups = {}
    for b in range(B):
        groups.setdefault(int(group[b]), []).append(b)
    total = 0.0
    for members in groups.values():
        r_mean = sum(float(rewards[b]) for b in members) / len(members)
        g_loss = 0.0
        for b in members:
            s = sum((logp[b, x] for x in range(T) if mask[b, x]), torch.zeros((), dtype=D))
            sb = sum(float(behav[b, x]) for x in range(T) if mask[b, x])
            g_loss = g_loss + (float(rewards[b]) - r_mean - tau * (s - sb)) ** 2
        total = total + g_loss / len(members)
    return total / len(groups)


def ref_group_adv(rewards, group, method):
    out = []
    r = [float(x) for x in rewards]
    for i in range(len(r)):
        mates = [r[j] for j in range(len(r)) if int(group[j]) == int(group[i])]
        k, mean = len(mates), sum(mates) / len(mates)
        if method == "drgrpo":
            out.append(r[i] - mean)
        elif method == "rloo":
            out.append(0.0 if k == 1 else r[i] - (sum(mates) - r[i]) / (k - 1))
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in mates) / (k - 1)) if k > 1 else 0.0
            out.append((r[i] - mean) / (std + 1e-6))
    return t(out)


# ---------------------------------------------------------------- KL


def test_kl_hand_values():
    d = t([[0.0, 1.0, -1.0]])
    zeros = torch.zeros_like(d)
    assert torch.allclose(kl_estimate(d, zeros, "k1"), d)
    assert torch.allclose(kl_estimate(d, zeros, "k2"), t([[0.0, 0.5, 0.5]]))
    # k3 = e^-d - 1 + d: d=1 -> e^-1 = 0.367879; d=-1 -> e - 2 = 0.718282
    assert torch.allclose(kl_estimate(d, zeros, "k3"), t([[0.0, 0.3678794412, 0.7182818285]]))
    # only the difference matters
    assert torch.allclose(kl_estimate(d + 3.0, zeros + 3.0, "k3"), kl_estimate(d, zeros, "k3"))


def test_k3_nonnegative_and_unknown_kind():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 32, generator=g) * 3, torch.randn(64, 32, generator=g) * 3
    assert (kl_estimate(a, b, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(a, b, "k4")


# ---------------------------------------------------------------- advantages


def test_group_advantages_hand():
    # groups (non-contiguous ids, interleaved): 7 -> [1, 0, 1], 3 -> [0, 2], 9 -> [5] (alone)
    rewards = t([1.0, 0.0, 2.0, 1.0, 0.0, 5.0])
    group = torch.tensor([7, 3, 3, 7, 7, 9])
    # group 7: mean 2/3, dev (1/3, 1/3, -2/3), unbiased var (1/9+1/9+4/9)/2 = 1/3
    # group 3: mean 1, dev (-1, 1), var 2 -> std sqrt 2
    s7, s3 = math.sqrt(1 / 3), math.sqrt(2)
    grpo = [(1 / 3) / s7, -1 / s3, 1 / s3, (1 / 3) / s7, (-2 / 3) / s7, 0.0]
    assert torch.allclose(group_advantages(rewards, group, method="grpo"), t(grpo), atol=1e-5)
    drgrpo = [1 / 3, -1.0, 1.0, 1 / 3, -2 / 3, 0.0]
    assert torch.allclose(group_advantages(rewards, group, method="drgrpo"), t(drgrpo))
    # rloo: 1 - mean(1, 0) = 0.5; 0 - 2 = -2; 2 - 0 = 2; 0 - mean(1, 1) = -1; alone -> 0
    rloo = [0.5, -2.0, 2.0, 0.5, -1.0, 0.0]
    assert torch.allclose(group_advantages(rewards, group, method="rloo"), t(rloo))


def test_group_advantages_match_loop_reference():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(11, generator=g, dtype=D)
    group = torch.tensor([5, -2, 5, 100, -2, 5, 8, 8, 8, 8, 31])  # 31 is alone
    for method in ["grpo", "drgrpo", "rloo"]:
        got = group_advantages(rewards, group, method=method)
        assert torch.allclose(got, ref_group_adv(rewards, group, method), atol=1e-9), method
        assert torch.isfinite(got).all()
    # identical rewards in a group -> 0, not NaN (std = 0)
    flat = group_advantages(t([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), method="grpo")
    assert torch.equal(flat, torch.zeros(3, dtype=D))


def test_group_advantages_unknown_method():
    with pytest.raises(ValueError, match="ppo"):
        group_advantages(t([1.0]), torch.tensor([0]), method="ppo")


def test_reinforce_pp_hand_no_kl():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token rewards [[0, 1, 0], [0, -, -]] -> returns on response tokens: 1, 1, 0
    # mean 2/3, unbiased std sqrt(((1/3)^2*2 + (2/3)^2)/2) = sqrt(1/3)
    adv = reinforce_pp_advantages(t([1.0, 0.0]), mask)
    s = math.sqrt(1 / 3)
    expected = t([[(1 / 3) / s, (1 / 3) / s, 0.0], [(-2 / 3) / s, 0.0, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_pp_hand_kl_gamma():
    mask = torch.tensor([[1, 1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3, float("nan")]])
    # token rewards -0.1, -0.2, -0.3 + 1 = 0.7; gamma 0.5 returns:
    # G2 = 0.7, G1 = -0.2 + 0.35 = 0.15, G0 = -0.1 + 0.075 = -0.025
    G = [-0.025, 0.15, 0.7]
    mean = sum(G) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in G) / 2)
    expected = t([[(x - mean) / (std + 1e-6) for x in G] + [0.0]])
    adv = reinforce_pp_advantages(t([1.0]), mask, kl=kl, kl_coef=1.0, gamma=0.5)
    assert torch.allclose(adv, expected, atol=1e-9)


def test_reinforce_pp_matches_loop_reference():
    _, _, _, mask, rewards, _, _ = random_batch(4)
    kl = torch.rand(mask.shape, dtype=D)
    coef, gamma = 0.3, 0.9
    rets = []
    for b in range(mask.shape[0]):
        idx = [x for x in range(mask.shape[1]) if mask[b, x]]
        running, row = 0.0, {}
        for x in reversed(idx):
            tok_r = -coef * float(kl[b, x]) + (float(rewards[b]) if x == idx[-1] else 0.0)
            running = tok_r + gamma * running
            row[x] = running
        rets.append(row)
    flat = [v for row in rets for v in row.values()]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1))
    expected = torch.zeros(mask.shape, dtype=D)
    for b, row in enumerate(rets):
        for x, v in row.items():
            expected[b, x] = (v - mean) / (std + 1e-6)
    got = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=coef, gamma=gamma)
    assert torch.allclose(got, expected, atol=1e-9)


def test_remax_hand():
    assert torch.allclose(remax_advantages(t([1.0, 0.0, 0.5]), t([0.5, 0.5, 1.0])), t([0.5, -0.5, -0.5]))


# ---------------------------------------------------------------- aggregation


def test_aggregation_hand_with_garbage_padding():
    inf, nan = float("inf"), float("nan")
    loss = t([[1.0, 2.0, 3.0], [4.0, inf, nan], [nan, nan, nan]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 fully padded
    # token-mean (1+2+3+4)/4 = 2.5; seq-mean-token-mean (2 + 4)/2 = 3; seq-mean-token-sum (6+4)/2 = 5
    cases = [("token-mean", 2.5, 4.0), ("seq-mean-token-mean", 3.0, 2.0), ("seq-mean-token-sum", 5.0, 2.0)]
    for agg, value, denom in cases:
        out = aggregate(loss, mask, agg)
        assert out.item() == pytest.approx(value) and agg_denominator(mask, agg) == denom
        (grad,) = torch.autograd.grad(out, loss)
        assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()
    # an all-padding batch gives 0, not NaN
    assert aggregate(loss, torch.zeros(3, 3), "token-mean").item() == 0.0
    assert agg_denominator(torch.zeros(3, 3), "seq-mean-token-sum") == 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_agg_denominator_rescales_micro_batches_to_global(agg):
    g = torch.Generator().manual_seed(5)
    loss = torch.randn(6, 4, generator=g, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    full = aggregate(loss, mask, agg)
    parts = [(loss[:3], mask[:3]), (loss[3:], mask[3:])]
    glob = agg_denominator(mask, agg)
    combined = sum(aggregate(lm, mm, agg) * agg_denominator(mm, agg) / glob for lm, mm in parts)
    assert torch.allclose(combined, full)


def test_unknown_agg_raises():
    with pytest.raises(ValueError, match="token-max"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "token-max")
    with pytest.raises(ValueError, match="token-max"):
        agg_denominator(torch.ones(1, 1), "token-max")
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        ppo_with_token_is(z, z, z, torch.zeros(1), torch.ones(1, 1), agg="token-max")


# ---------------------------------------------------------------- PPO


def test_ppo_naive_hand():
    # ratios (vs behav) row0: 1.5, 0.7, 1.0 with A=+1; row1: 0.5, 1.3, pad with A=-1
    behav = torch.zeros(2, 3, dtype=D)
    logp = t([[math.log(1.5), math.log(0.7), 0.0], [math.log(0.5), math.log(1.3), 99.0]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row0: min(1.5, 1.2) = 1.2 (clipped high), 0.7, 1.0 -> losses -1.2, -0.7, -1.0
    # row1: min(-0.5, -0.8) = -0.8 (clipped low), min(-1.3, -1.2) = -1.3 -> losses 0.8, 1.3
    # token-mean = (-1.2 - 0.7 - 1.0 + 0.8 + 1.3) / 5 = -0.16
    loss, st = ppo_with_token_is(logp, behav, behav, t([1.0, -1.0]), mask, decoupled=False)
    assert loss.item() == pytest.approx(-0.16)
    assert st["is/clip_frac"] == pytest.approx(0.4)
    assert st["is/clip_frac_low"] == pytest.approx(0.2) and st["is/clip_frac_high"] == pytest.approx(0.2)
    assert st["is/ratio_mean"] == pytest.approx(1.0)  # (1.5 + 0.7 + 1 + 0.5 + 1.3) / 5
    assert st["is/weight_mean"] == 1.0
    # d loss / d logp_t = -A * r / 5 on unclipped tokens, 0 on clipped ones
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, t([[0.0, -0.7 / 5, -1.0 / 5], [0.0, 1.3 / 5, 0.0]]))


def test_ppo_decoupled_hand_is_weights():
    # prox/behav = 3 -> w capped at 2 ; prox/behav = 0.5 -> w = 0.5; logp == prox so r = 1
    prox = t([[math.log(3.0), math.log(0.5)]])
    behav = torch.zeros(1, 2, dtype=D)
    logp = prox.clone().requires_grad_()
    adv = t([[1.0, -2.0]])  # token-level advantages
    loss, st = ppo_with_token_is(logp, prox, behav, adv, torch.ones(1, 2), is_cap=2.0)
    # loss = -(2*1 + 0.5*(-2)) / 2 = -0.5
    assert loss.item() == pytest.approx(-0.5)
    assert st["is/capped_frac"] == pytest.approx(0.5)
    assert st["is/weight_mean"] == pytest.approx(1.25)
    assert st["is/clip_frac"] == 0.0 and st["is/ratio_mean"] == pytest.approx(1.0)
    # The logged ESS is of the raw weights 3 and 0.5, not of the capped ones the loss applies
    off = off_policy(prox, behav, torch.ones(1, 2))
    assert off["is/ess"] == pytest.approx(3.5**2 / (2 * (9 + 0.25)))  # 0.662162
    # k3 of KL(behav||prox), d = behav - prox: (3 - 1 - ln 3 + 0.5 - 1 + ln 2) / 2
    assert off["is/mismatch_kl"] == pytest.approx((3 - 1 - math.log(3) + 0.5 - 1 + math.log(2)) / 2)


def test_ppo_zero_staleness_equals_standard_ppo():
    logp, _, _, mask, _, _, adv = random_batch(6)
    cur = logp.detach()
    dec, st = ppo_with_token_is(logp, cur, cur, adv, mask, decoupled=True)
    naive, _ = ppo_with_token_is(logp, cur, cur, adv, mask, decoupled=False)
    # on-policy: r = 1, loss = -mean(A), gradient = -A / N (REINFORCE with PPO's first step)
    m = mask.bool()
    assert torch.allclose(dec, naive) and torch.allclose(dec, -adv[m].mean())
    (g_dec,) = torch.autograd.grad(dec, logp)
    (g_naive,) = torch.autograd.grad(naive, logp)
    assert torch.allclose(g_dec, g_naive)
    assert torch.allclose(g_dec[m], -adv[m] / m.sum())
    assert st["is/clip_frac"] == 0.0 and st["is/weight_mean"] == pytest.approx(1.0)
    assert off_policy(cur, cur, mask) == {"is/ess": pytest.approx(1.0), "is/mismatch_kl": 0.0}


def test_ppo_decoupled_equals_naive_when_prox_is_behav():
    logp, prox, _, mask, _, _, adv = random_batch(7)
    a, _ = ppo_with_token_is(logp, prox, prox, adv, mask, decoupled=True)
    b, _ = ppo_with_token_is(logp, prox, prox, adv, mask, decoupled=False)
    assert torch.allclose(a, b)


def test_ppo_is_cap_truncates():
    # prox/behav = e^3 ~ 20: the weight is the cap, so loss scales linearly with it
    logp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    prox, behav, mask = torch.zeros(1, 2, dtype=D), torch.full((1, 2), -3.0, dtype=D), torch.ones(1, 2)
    l2, s2 = ppo_with_token_is(logp, prox, behav, t([1.0]), mask, is_cap=2.0)
    l5, s5 = ppo_with_token_is(logp, prox, behav, t([1.0]), mask, is_cap=5.0)
    l_inf, _ = ppo_with_token_is(logp, prox, behav, t([1.0]), mask, is_cap=float("inf"))
    assert l2.item() == pytest.approx(-2.0) and l5.item() == pytest.approx(-5.0)
    assert l_inf.item() == pytest.approx(-math.exp(3.0))
    assert s2["is/capped_frac"] == 1.0 and s2["is/weight_mean"] == pytest.approx(2.0)


def test_ppo_asymmetric_eps():
    zero, mask = torch.zeros(1, 1, dtype=D), torch.ones(1, 1)
    up = t([[math.log(1.25)]]).requires_grad_()
    # A > 0, r = 1.25: clipped at 1.2 with eps_high=0.2, free with eps_high=0.28 (clip-higher)
    l_a, s_a = ppo_with_token_is(up, zero, zero, t([1.0]), mask, eps_high=0.2, decoupled=False)
    l_b, s_b = ppo_with_token_is(up, zero, zero, t([1.0]), mask, eps_high=0.28, decoupled=False)
    assert l_a.item() == pytest.approx(-1.2) and s_a["is/clip_frac_high"] == 1.0
    assert l_b.item() == pytest.approx(-1.25) and s_b["is/clip_frac"] == 0.0
    # A < 0, r = 0.75: eps_low=0.2 -> clipped at 0.8 (loss 0.8); eps_low=0.3 -> free (loss 0.75)
    down = t([[math.log(0.75)]])
    l_c, s_c = ppo_with_token_is(down, zero, zero, t([-1.0]), mask, eps_low=0.2, eps_high=0.28, decoupled=False)
    l_d, _ = ppo_with_token_is(down, zero, zero, t([-1.0]), mask, eps_low=0.3, decoupled=False)
    assert l_c.item() == pytest.approx(0.8) and s_c["is/clip_frac_low"] == 1.0
    assert l_d.item() == pytest.approx(0.75)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("decoupled", [True, False])
def test_ppo_matches_loop_reference(agg, decoupled):
    logp, prox, behav, mask, _, _, adv_tok = random_batch(8)
    for adv in (adv_tok, torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, 0.0, -2.0], dtype=D)):
        kw = dict(eps_low=0.2, eps_high=0.28, decoupled=decoupled)
        loss, stats = ppo_with_token_is(logp, prox, behav, adv, mask, is_cap=1.5, agg=agg, **kw)
        ref = ref_ppo(logp, prox, behav, adv, mask, 0.2, 0.28, 1.5, decoupled, agg)
        (g,) = torch.autograd.grad(loss, logp)
        (g_ref,) = torch.autograd.grad(ref, logp)
        assert torch.allclose(loss, ref) and torch.allclose(g, g_ref)
        assert torch.isfinite(g).all() and (g[mask == 0] == 0).all()
        assert all(math.isfinite(v) for v in stats.values())
    assert 0.0 < off_policy(prox, behav, mask)["is/ess"] <= 1.0


# ---------------------------------------------------------------- OPMD


def test_opmd_hand_non_contiguous_groups():
    # group 5: responses 0, 2; group 2: responses 1, 3, 4; tau = 0.5; padding is garbage
    inf = float("inf")
    logp = t([[-0.5, -0.5], [-1.0, inf], [-0.2, -0.2], [0.0, 0.0], [-2.0, -inf]]).requires_grad_()
    behav = t([[-0.5, -0.5], [0.0, inf], [0.0, 0.0], [0.0, 0.0], [0.0, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0]])
    rewards, group = t([1.0, 1.0, 0.0, 1.0, 0.0]), torch.tensor([5, 2, 5, 2, 2])
    # S - S_behav = 0, -1, -0.4, 0, -2
    # group 5 (mean 0.5): residuals 0.5 - 0 = 0.5, -0.5 + 0.2 = -0.3 -> (0.25 + 0.09)/2 = 0.17
    # group 2 (mean 2/3): 1/3 + 0.5 = 5/6, 1/3, -2/3 + 1 = 1/3 -> (25/36 + 1/9 + 1/9)/3 = 11/36
    expected = (0.17 + 11 / 36) / 2
    loss, st = opmd_loss(logp, behav, mask, rewards, group, tau=0.5)
    assert loss.item() == pytest.approx(expected)
    assert st["opmd/residual_mean"] == pytest.approx((0.5 - 0.3 + 5 / 6 + 1 / 3 + 1 / 3) / 5)
    assert LOSSES["opmd"].units(mask, group, "token-mean") == 2.0  # the loss is a mean over 2 groups
    # d loss / d logp_t = (1/G)(1/k) * 2 * residual * (-tau) on response tokens
    (grad,) = torch.autograd.grad(loss, logp)
    g5, g2 = -0.5 * 2 / 2 / 2, -0.5 * 2 / 3 / 2
    expected_grad = t([[g5 * 0.5] * 2, [g2 * 5 / 6, 0.0], [g5 * -0.3] * 2, [g2 / 3] * 2, [g2 / 3, 0.0]])
    assert torch.allclose(grad, expected_grad)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_opmd_matches_loop_reference(tau):
    logp, _, behav, mask, rewards, group, _ = random_batch(9)  # has a group of one and an empty row
    loss, stats = opmd_loss(logp, behav, mask, rewards, group, tau=tau)
    ref = ref_opmd(logp, behav, mask, rewards, group, tau)
    (g,) = torch.autograd.grad(loss, logp)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert torch.allclose(loss, ref) and torch.allclose(g, g_ref)
    assert torch.isfinite(g).all() and (g[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in stats.values())


def test_opmd_invariant_to_group_labels_and_order():
    logp, _, behav, mask, rewards, group, _ = random_batch(10)
    base, _ = opmd_loss(logp, behav, mask, rewards, group)
    perm = torch.tensor([6, 2, 0, 5, 1, 4, 3])
    relabelled = group[perm] * 1000 - 17  # different, non-contiguous, negative ids
    other, _ = opmd_loss(logp[perm], behav[perm], mask[perm], rewards[perm], relabelled)
    assert torch.allclose(base, other)
