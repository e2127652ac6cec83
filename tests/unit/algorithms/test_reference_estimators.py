"""Advantage / return estimators and the remaining formulas against hand arithmetic and
independent references: group advantages, ReMax, token rewards, discounted returns, whitening
and REINFORCE++ (with sharded reduce_sum), GAE, the value loss, entropy and KL gradients.

The references (tests/reference_formulas.py) are written from the formulas of docs/algorithms.md (Notation and formulas)
without calling async_rl code; comparisons are in float64 on random right-padded batches with
inf/nan garbage in every padded position.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference_formulas import (
    AGGS,
    INF,
    NAN,
    STD_EPS,
    D,
    batch,
    close,
    garbage_pad,
    grad_of,
    ref_discounted,
    ref_entropy,
    ref_gae,
    ref_token_rewards,
    ref_value_loss,
    ref_whiten,
    resp,
    t,
)

from async_rl.algorithms.advantages import (
    discounted_returns,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
    token_rewards,
)
from async_rl.algorithms.entropy import token_entropy
from async_rl.algorithms.gae import gae_advantages, value_loss
from async_rl.algorithms.kl import kl_estimate

# ============================================================== group / ReMax advantages


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo"])
def test_group_advantages_singletons_and_ties(method):
    # groups: 9 alone, 4 = {1, 1, 1} tie, 0 = {2, 2} tie, -1 alone, 6 = {0, 1}
    rewards = torch.tensor([3, 1, 0, 1, 2, 2, 5, 1, 1])  # integer rewards
    group = torch.tensor([9, 4, 6, 4, 0, 0, -1, 4, 6])
    got = group_advantages(rewards, group, method=method)
    assert got.is_floating_point() and torch.isfinite(got).all()
    # group 6: mean 0.5; grpo: std = sqrt((0.25 + 0.25) / 1) = 0.70711 -> -/+ 0.5/0.70711;
    # drgrpo -/+ 0.5; rloo: 0 - 1 = -1, 1 - 0 = +1. Everything else (singletons, ties) is 0.
    dev = {"grpo": 0.5 / (math.sqrt(0.5) + STD_EPS), "drgrpo": 0.5, "rloo": 1.0}[method]
    expected = [0.0, 0.0, -dev, 0.0, 0.0, 0.0, 0.0, 0.0, dev]
    close(got.to(D), expected, atol=1e-6)
    # all singletons -> all 0 exactly
    assert (group_advantages(t([0.3, -2.0, 7.0]), torch.tensor([5, 3, 1]), method=method) == 0).all()


def test_remax_matches_reference():
    g = torch.Generator().manual_seed(5)
    r, greedy = torch.randn(6, generator=g, dtype=D), torch.randn(6, generator=g, dtype=D)
    close(remax_advantages(r, greedy), [float(r[i]) - float(greedy[i]) for i in range(6)])
    out = remax_advantages(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 0]))  # integer rewards
    assert out.is_floating_point() and out.tolist() == [0.0, -1.0, 1.0]


# ============================================================== token rewards, returns, whitening


def test_token_rewards_hand():
    # prompt positions before the response, padding after; row 2 fully padded (its reward is dropped)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    kl = t([[NAN, 0.5, 1.0, -0.2, INF], [0.3, 0.4, NAN, -INF, INF], [NAN] * 5])
    # coef 0.1: row0 -0.05, -0.1, +0.02 + 2 = 2.02; row1 -0.03, -0.04 - 1 = -1.04
    got = token_rewards(t([2.0, -1.0, 7.0]), mask, kl=kl, kl_coef=0.1)
    close(got, [[0, -0.05, -0.1, 2.02, 0], [-0.03, -1.04, 0, 0, 0], [0] * 5])
    close(token_rewards(t([2.0, -1.0, 7.0]), mask), [[0, 0, 0, 2, 0], [0, -1, 0, 0, 0], [0] * 5])
    close(token_rewards(torch.tensor([2, -1, 7]), mask, kl=kl, kl_coef=0.0),
          [[0, 0, 0, 2, 0], [0, -1, 0, 0, 0], [0] * 5])


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("kl_coef", [0.0, 0.25])
def test_token_rewards_matches_reference(prompt, kl_coef):
    x = batch(6, prompt=prompt)
    got = token_rewards(x.rewards, x.mask, kl=x.kl, kl_coef=kl_coef)
    close(got, ref_token_rewards(x.rewards, x.mask, x.kl, kl_coef))


def test_discounted_returns_hand():
    r = t([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    # gamma 0.5: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75; row1 0.25, 0.5, 1
    close(discounted_returns(r, 0.5), [[2.75, 3.5, 3.0], [0.25, 0.5, 1.0]])
    close(discounted_returns(r, 1.0), [[6.0, 5.0, 3.0], [1.0, 1.0, 1.0]])
    close(discounted_returns(r, 0.0), r)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_matches_reference(gamma):
    x = batch(7, prompt=True)
    tok = ref_token_rewards(x.rewards, x.mask, x.kl, 0.3)  # clean (0 off the response), as in use
    close(discounted_returns(tok, gamma), ref_discounted(tok, gamma))


def test_masked_whiten_hand():
    # response values 1, 2, 3: mean 2, unbiased std 1 -> (-1, 0, 1) / (1 + 1e-6); garbage padding -> 0
    x = t([[1.0, 2.0, NAN], [3.0, INF, -INF]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_whiten(x, mask), [[-1 / (1 + STD_EPS), 0, 0], [1 / (1 + STD_EPS), 0, 0]])


def sharded(run, shards):
    """Simulate an all_reduce over len(shards) ranks. `run(rows, reduce_sum)` computes one shard.
    A first pass records each shard's local moment vector (whatever its layout); the second
    passes reduce_sum = own + the other shards' vectors, as an all_reduce(SUM) would return."""
    local = []
    for rows in shards:
        run(rows, lambda v: local.append(v.clone()) or v)
    others = [sum(local) - mine for mine in local]  # each shard's view of the other's sums
    outs = [run(rows, lambda v, o=others[i]: v + o) for i, rows in enumerate(shards)]
    return torch.cat(outs)


SHARDS = [slice(0, 3), slice(3, 4), slice(4, 8)]  # the middle shard is the fully padded row alone


@pytest.mark.parametrize("prompt", [False, True])
def test_masked_whiten_reference_and_shards(prompt):
    x = batch(8, prompt=prompt)
    full = masked_whiten(x.returns, x.mask)
    close(full, ref_whiten(x.returns, x.mask))
    close(sharded(lambda rows, rs: masked_whiten(x.returns[rows], x.mask[rows], reduce_sum=rs), SHARDS), full)
    # without reduce_sum each shard is normalized on its own statistics: different
    alone = torch.cat([masked_whiten(x.returns[s], x.mask[s]) for s in SHARDS])
    assert not torch.allclose(alone, full)


@pytest.mark.parametrize("offset", [0.0, 1e2, 1e3, 1e4])
@pytest.mark.parametrize("spread", [1.0, 5.0])
def test_masked_whiten_float32_far_from_zero(offset, spread):
    # Rewards 1e4 +- 5 in float32: E[x^2] - E[x]^2 in float32 sums cancelled to a variance of 0
    # (advantages ~1e6 too large). The float64 reference whitens the same float32 values.
    g = torch.Generator().manual_seed(22)
    B, T = 32, 12
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    x = (offset + spread * torch.randn(B, T, generator=g, dtype=D)).to(torch.float32)
    x = torch.where(mask.bool(), x, t(NAN).float())  # garbage padding
    m = mask.bool()
    vals = x.to(D)[m]
    expected = torch.where(m, (x.to(D) - vals.mean()) / (vals.std() + STD_EPS), t(0.0))  # two-pass, unbiased
    got = masked_whiten(x, mask)
    assert got.dtype == torch.float32
    assert (got.to(D) - expected).abs().max() / expected.abs().max() < 1e-4
    shards = [slice(0, 5), slice(5, 6), slice(6, B)]
    split = sharded(lambda rows, rs: masked_whiten(x[rows], mask[rows], reduce_sum=rs), shards)
    assert (split.to(D) - expected).abs().max() / expected.abs().max() < 1e-4


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_pp_reference_and_shards(gamma):
    x = batch(9, prompt=True)
    kw = dict(kl=x.kl, kl_coef=0.2, gamma=gamma)
    full = reinforce_pp_advantages(x.rewards, x.mask, **kw)
    close(full, ref_whiten(ref_discounted(ref_token_rewards(x.rewards, x.mask, x.kl, 0.2), gamma), x.mask))

    def run(rows, rs):
        return reinforce_pp_advantages(x.rewards[rows], x.mask[rows], kl=x.kl[rows], kl_coef=0.2, gamma=gamma,
                                       reduce_sum=rs)

    close(sharded(run, SHARDS), full)


# ============================================================== GAE and value loss


def test_gae_hand():
    # two prompt positions, a 3-token response, one padded position; gamma 0.9, lam 0.5
    # r = 0.1, -0.2, 1.0 ; V = 0.5, 0.6, 0.8 ; V after the response = 0
    # delta2 = 1.0 + 0 - 0.8 = 0.2            A2 = 0.2
    # delta1 = -0.2 + 0.9*0.8 - 0.6 = -0.08   A1 = -0.08 + 0.45*0.2 = 0.01
    # delta0 = 0.1 + 0.9*0.6 - 0.5 = 0.14     A0 = 0.14 + 0.45*0.01 = 0.1445
    # returns A + V = 0.6445, 0.61, 1.0
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])  # row 1 fully padded
    r = t([[NAN, INF, 0.1, -0.2, 1.0, -INF], [NAN] * 6])
    v = t([[INF, NAN, 0.5, 0.6, 0.8, INF], [INF] * 6])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.5)
    close(adv, [[0, 0, 0.1445, 0.01, 0.2, 0], [0] * 6])
    close(ret, [[0, 0, 0.6445, 0.61, 1.0, 0], [0] * 6])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (0.7, 0.0)])
def test_gae_matches_reference(gamma, lam):
    x = batch(10, prompt=True)
    adv, ret = gae_advantages(x.token_r, x.values, x.mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(x.token_r, x.values, x.mask, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_limits_monte_carlo_and_td():
    x = batch(11, prompt=True)
    B, T = x.mask.shape
    # lam = 1, gamma = 1: returns = reward-to-go, advantages = reward-to-go - V
    _, ret = gae_advantages(x.token_r, x.values, x.mask, gamma=1.0, lam=1.0)
    # lam = 0: one-step TD, A_t = r_t + gamma * V_{t+1} - V_t (V_{t+1} = 0 past the last token)
    td, _ = gae_advantages(x.token_r, x.values, x.mask, gamma=0.9, lam=0.0)
    mc, one_step = torch.zeros(B, T, dtype=D), torch.zeros(B, T, dtype=D)
    for b in range(B):
        idx = resp(x.mask, b)
        for i, s in enumerate(idx):
            mc[b, s] = sum(float(x.token_r[b, u]) for u in idx[i:])
            v_next = float(x.values.detach()[b, idx[i + 1]]) if i + 1 < len(idx) else 0.0
            one_step[b, s] = float(x.token_r[b, s]) + 0.9 * v_next - float(x.values.detach()[b, s])
    close(ret, mc)
    close(td, one_step)


@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_hand(agg):
    # c = 0.2; tokens (V, V_old, R):
    #   (1.5, 1.0, 2.0): (V-R)^2 = 0.25, V_clip = 1.2 -> 0.64 larger: clipped, loss 0.32, grad 0
    #   (0.0, 1.0, 2.0): 4, V_clip = 0.8 -> 1.44: loss 2, grad V-R = -2
    #   (1.0, 0.0, 0.5): 0.25, V_clip = 0.2 -> 0.09: loss 0.125, grad 0.5
    # row 1: (0.25, 0.25, 1.25): 1, V_clip = V -> loss 0.5, grad -1; row 2 fully padded
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    values = garbage_pad(t([[1.5, 0.0, 1.0], [0.25, 0, 0], [0] * 3]), mask).requires_grad_()
    old = garbage_pad(t([[1.0, 1.0, 0.0], [0.25, 0, 0], [0] * 3]), mask)
    ret = garbage_pad(t([[2.0, 2.0, 0.5], [1.25, 0, 0], [0] * 3]), mask)
    loss, st = value_loss(values, old, ret, mask, clip=0.2, agg=agg)
    row0, row1, g0, g1 = 0.32 + 2 + 0.125, 0.5, t([0.0, -2.0, 0.5]), -1.0
    value, c0, c1 = {"token-mean": ((row0 + row1) / 4, 1 / 4, 1 / 4),  # 2.945 / 4 = 0.73625
                     "seq-mean-token-mean": ((row0 / 3 + row1) / 2, 1 / 6, 1 / 2),  # 0.6575
                     "seq-mean-token-sum": ((row0 + row1) / 2, 1 / 2, 1 / 2)}[agg]  # 1.4725
    close(loss, value)
    expected = torch.zeros(3, 3, dtype=D)
    expected[0], expected[1, 0] = g0 * c0, g1 * c1
    close(grad_of(loss, values), expected)
    assert st["critic/clip_frac"] == pytest.approx(0.25)
    # clip=None: plain 1/2 (V-R)^2 -> row0 0.125 + 2 + 0.125, grads -0.5, -2, 0.5
    loss, st = value_loss(values, old, ret, mask, clip=None, agg="token-mean")
    close(loss, (0.125 + 2 + 0.125 + 0.5) / 4)
    close(grad_of(loss, values), [[-0.5 / 4, -2 / 4, 0.5 / 4], [-1 / 4, 0, 0], [0, 0, 0]])
    assert st["critic/clip_frac"] == 0.0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip", [None, 0.2, 0.05])
def test_value_loss_matches_reference(agg, clip):
    for seed in (12, 13):
        x = batch(seed, prompt=True)
        loss, _ = value_loss(x.values, x.old_values, x.returns, x.mask, clip=clip, agg=agg)
        ref_loss, ref_grad, _ = ref_value_loss(x.values, x.old_values, x.returns, x.mask, clip=clip, agg=agg)
        close(loss, ref_loss)
        close(grad_of(loss, x.values), ref_grad)


@pytest.mark.parametrize("clip", [0.2, 0.05])
def test_value_clip_frac_matches_reference(clip):
    # values on a dyadic grid (k/64), where V_old + (V - V_old) == V exactly (see test_value_clip_frac_ignores_rounding)
    total = 0.0
    for seed in (14, 15):
        x = batch(seed, prompt=True)
        grid = [garbage_pad(torch.round(z.detach() * 64) / 64, x.mask) for z in (x.values, x.old_values, x.returns)]
        _, st = value_loss(*grid, x.mask, clip=clip)
        _, _, ref_frac = ref_value_loss(*grid, x.mask, clip=clip, agg="token-mean")
        assert st["critic/clip_frac"] == pytest.approx(ref_frac, rel=1e-6)
        total += ref_frac
    assert total > 0


def test_value_clip_frac_ignores_rounding():
    # |V - V_old| = 0.14 < c = 0.2: the clip is not active, yet 0.08 + (-0.06 - 0.08) = -0.06000000000000001
    _, st = value_loss(t([[-0.06]]), t([[0.08]]), t([[0.6]]), torch.ones(1, 1), clip=0.2)
    assert st["critic/clip_frac"] == 0.0


# ============================================================== entropy


def test_entropy_hand():
    logits = t([[0.0, 0.0, -INF, -INF], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, -INF, -INF], [5.0, -INF, -INF, -INF]])
    # uniform over 2 -> ln 2; uniform over 4 -> ln 4; p = (e, 1)/(e + 1) -> -p ln p - q ln q; one token -> 0
    p = math.e / (math.e + 1)
    expected = [math.log(2), math.log(4), -p * math.log(p) - (1 - p) * math.log(1 - p), 0.0]
    h = token_entropy(logits)
    assert torch.isfinite(h).all()
    close(h.to(D), expected, atol=1e-6)  # the library computes in float32


def test_entropy_matches_categorical_and_reference():
    g = torch.Generator().manual_seed(16)
    logits = 3 * torch.randn(3, 4, 6, generator=g, dtype=D)
    logits[0, 1, 2] = logits[2, 3, :4] = logits[1, 0, 5] = -INF
    h = token_entropy(logits)
    assert h.shape == (3, 4) and torch.isfinite(h).all()
    close(h.to(D), torch.distributions.Categorical(logits=logits).entropy(), atol=1e-5)
    ref = [[ref_entropy(logits[i, j].tolist())[0] for j in range(4)] for i in range(3)]
    close(h.to(D), ref, atol=1e-5)


def test_entropy_gradient_matches_reference():
    g = torch.Generator().manual_seed(17)
    logits = (3 * torch.randn(5, 7, generator=g, dtype=D)).requires_grad_()
    weights = torch.randn(5, generator=g, dtype=D)
    (grad,) = torch.autograd.grad((token_entropy(logits).to(D) * weights).sum(), logits)
    ref = [[float(weights[i]) * gi for gi in ref_entropy(logits[i].tolist())[1]] for i in range(5)]
    close(grad.to(D), ref, atol=1e-5)


def test_entropy_gradient_finite_with_masked_logits():
    logits = t([[0.5, -1.0, -INF, 2.0], [0.0, 1.0, 2.0, 3.0]]).requires_grad_()
    (grad,) = torch.autograd.grad(token_entropy(logits).sum(), logits)
    ref = [ref_entropy(row)[1] for row in logits.tolist()]  # 0 on the -inf logit
    close(grad.to(D), ref, atol=1e-5)


# ============================================================== KL estimators: gradients


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_gradients_match_reference(kind):
    # d = logp - logp_ref; d/d logp: k1 1, k2 d, k3 1 - exp(-d); d/d logp_ref is the negative
    g = torch.Generator().manual_seed(18)
    logp = (-2 * torch.rand(4, 6, generator=g, dtype=D)).requires_grad_()
    logp_ref = (logp.detach() + torch.randn(4, 6, generator=g, dtype=D)).requires_grad_()
    weights = torch.randn(4, 6, generator=g, dtype=D)
    g_logp, g_ref = torch.autograd.grad((kl_estimate(logp, logp_ref, kind) * weights).sum(), (logp, logp_ref))
    deriv = {"k1": lambda d: 1.0, "k2": lambda d: d, "k3": lambda d: 1 - math.exp(-d)}[kind]
    lp, lr = logp.detach(), logp_ref.detach()
    expected = t([[float(weights[i, j]) * deriv(float(lp[i, j]) - float(lr[i, j])) for j in range(6)]
                  for i in range(4)])
    close(g_logp, expected)
    close(g_ref, -expected)


# ============================================================== KL estimators: clamp


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_clamp_hand_values(kind):
    # d = logp - logp_ref = 50, -50, 0.3, -0.4. Unclamped: k1 = d; k2 = d^2/2 = 1250, 1250, 0.045, 0.08;
    # k3 = e^-d - 1 + d = 49 + e^-50, e^50 - 51, 0.040818, 0.091825. Clamped at 10: the extreme tokens
    # become +-10 (k1 keeps its sign), the normal ones are unchanged.
    d = t([[50.0, -50.0, 0.3, -0.4]])
    logp, ref = d.clone().requires_grad_(), torch.zeros_like(d)
    normal = {"k1": [0.3, -0.4], "k2": [0.045, 0.08],
              "k3": [math.exp(-0.3) - 0.7, math.exp(0.4) - 1.4]}[kind]
    extreme = {"k1": [10.0, -10.0], "k2": [10.0, 10.0], "k3": [10.0, 10.0]}[kind]
    got = kl_estimate(logp, ref, kind, clamp=10.0)
    assert torch.allclose(got, t([extreme + normal]), rtol=0, atol=1e-12)
    # d/d logp: 0 where clamped; k1 1, k2 d, k3 1 - e^-d elsewhere
    (grad,) = torch.autograd.grad(got.sum(), logp)
    deriv = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[kind]
    assert torch.allclose(grad, t([[0.0, 0.0, deriv(0.3), deriv(-0.4)]]), rtol=0, atol=1e-12)
    unclamped = {"k1": [50.0, -50.0], "k2": [1250.0, 1250.0], "k3": [49.0 + math.exp(-50), math.exp(50) - 51]}[kind]
    assert torch.allclose(kl_estimate(d, ref, kind), t([unclamped + normal]), rtol=1e-12, atol=1e-12)


def test_kl_clamp_keeps_normal_values_and_float32_gradients_finite():
    # Normal: |d| below ~2.6, where k3 = e^-d - 1 + d reaches 10 (the policy giving a token
    # e^2.6 ~ 13x less probability than the reference); k1, k2 stay below 10 for |d| < 4.4.
    g = torch.Generator().manual_seed(3)
    a, b = 0.3 * torch.randn(16, 8, generator=g), 0.3 * torch.randn(16, 8, generator=g)
    for kind in ("k1", "k2", "k3"):
        unclamped = kl_estimate(a, b, kind)
        assert unclamped.abs().max() < 10.0
        assert torch.equal(kl_estimate(a, b, kind, clamp=10.0), unclamped)
    # float32 e^200 = inf: the clamped k3 is 10 with gradient 0, not 0 * inf = NaN
    logp = torch.tensor([[-200.0, 0.5]], requires_grad=True)
    got = kl_estimate(logp, torch.zeros(1, 2), "k3", clamp=10.0)
    (grad,) = torch.autograd.grad(got.sum(), logp)
    assert got[0, 0].item() == 10.0 and torch.isfinite(grad).all() and grad[0, 0].item() == 0.0
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate(a, b, "k3", clamp=0.0)
