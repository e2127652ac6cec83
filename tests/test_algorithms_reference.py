"""Every formula of async_rl.algorithms against hand arithmetic and independent references.

The references at the top are written from DESIGN.md ("Losses (notation)") and the module
docstrings only: plain Python floats, one loop over samples and tokens, gradients derived by
hand (no autograd, no async_rl code). The tests compare the library's values *and*
`torch.autograd.grad` of its losses against them in float64 on random right-padded batches
that contain groups of one, non-contiguous out-of-order group ids, a fully padded row and
inf/nan garbage in every padded position.

tests/test_algorithms.py already covers the basic PPO / OPMD / group-advantage loop references
(values, autograd-vs-autograd); this file adds dual clip, every PPO statistic, OPMD
length_norm, token rewards / returns / whitening (with sharded reduce_sum), GAE, the value
loss, entropy and KL gradients.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from async_rl.algorithms import (
    discounted_returns,
    gae_advantages,
    group_advantages,
    kl_estimate,
    masked_whiten,
    opmd_loss,
    ppo_clip_loss,
    reinforce_pp_advantages,
    remax_advantages,
    token_entropy,
    token_rewards,
    value_loss,
)

D = torch.float64
INF, NAN = float("inf"), float("nan")
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
ATOL = 1e-10
STD_EPS = 1e-6


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def close(got, expected, atol=ATOL):
    torch.testing.assert_close(got, torch.as_tensor(expected, dtype=got.dtype), atol=atol, rtol=0)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(g).all(), "garbage leaked into the gradient"
    return g


# ============================================================== references (plain Python)


def resp(mask, b) -> list[int]:
    """Response positions of row b."""
    return [s for s in range(mask.shape[1]) if mask[b, s]]


def agg_coef(mask, agg) -> dict[tuple[int, int], float]:
    """Every aggregation is linear: loss = sum_bt c_bt * loss_bt. token-mean: c = 1/N (N response
    tokens); seq-mean-token-mean: 1/(S*n_b); seq-mean-token-sum: 1/S (S non-empty rows)."""
    rows = [resp(mask, b) for b in range(mask.shape[0])]
    n_tok, n_seq = sum(len(r) for r in rows), sum(1 for r in rows if r)
    coef = {}
    for b, idx in enumerate(rows):
        for s in idx:
            coef[b, s] = {"token-mean": 1 / n_tok, "seq-mean-token-mean": 1 / (n_seq * len(idx)),
                          "seq-mean-token-sum": 1 / n_seq}[agg]
    return coef


def k3(d: float) -> float:
    return math.exp(-d) - 1 + d


def ref_ppo(logp, prox, behav, adv, mask, *, eps_low, eps_high, is_cap, decoupled, agg, dual_clip=None):
    """(loss, d loss / d logp, stats). r = exp(logp - anchor), w = min(exp(prox - behav), cap)
    (decoupled) or anchor = behav, w = 1 (naive); obj = min(rA, clip(r)A), for A<0 with dual clip
    obj = max(obj, dual*A); loss_t = -w*obj. d obj/d logp = rA unless a clip is active, else 0."""
    B, T = mask.shape
    logp = logp.detach()
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    n_clip = n_low = n_high = n_dual = n_capped = 0
    ws, ratios, kls = [], [], []
    coef = agg_coef(mask, agg)
    for (b, s), c in coef.items():
        lp, px, bh = float(logp[b, s]), float(prox[b, s]), float(behav[b, s])
        a = float(adv[b, s]) if adv.dim() == 2 else float(adv[b])
        if decoupled:
            r, raw = math.exp(lp - px), math.exp(px - bh)
            w = min(raw, is_cap)
            n_capped += raw > is_cap
        else:
            r, w = math.exp(lp - bh), 1.0
        rc = min(max(r, 1 - eps_low), 1 + eps_high)
        obj = min(r * a, rc * a)
        clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
        dobj = 0.0 if clipped else r * a
        if dual_clip is not None and a < 0 and dual_clip * a > obj:
            obj, dobj = dual_clip * a, 0.0
            n_dual += 1
        loss += c * -w * obj
        grad[b][s] = c * -w * dobj
        n_clip += clipped
        n_low += clipped and r < 1
        n_high += clipped and r > 1
        ws.append(w)
        ratios.append(r)
        kls.append(k3(bh - px))  # k3 with d = logp_behav - logp_prox
    n = len(coef)
    stats = {
        "clip_frac": n_clip / n, "clip_frac_low": n_low / n, "clip_frac_high": n_high / n,
        "dual_clip_frac": n_dual / n,
        "is/ess": sum(ws) ** 2 / (n * sum(w * w for w in ws)) if decoupled else 1.0,
        "is/capped_frac": n_capped / n, "is/weight_mean": sum(ws) / n,
        "mismatch_kl": sum(kls) / n, "ratio_mean": sum(ratios) / n,
    }
    return t(loss), t(grad), stats


def ref_opmd(logp, behav, mask, rewards, group, *, tau, length_norm):
    """(loss, d loss / d logp): mean over groups of (1/k) sum_j (r_j - mean r - tau*x_j)^2 with
    x_j = (S_j - S_j^behav) [/ max(len_j, 1)]; d/d logp_t of row j = 2*res_j*(-tau)/(G*k)[/len_j]."""
    B, T = mask.shape
    logp = logp.detach()
    groups: dict[int, list[int]] = {}
    for b in range(B):
        groups.setdefault(int(group[b]), []).append(b)
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for members in groups.values():
        k = len(members)
        r_mean = sum(float(rewards[j]) for j in members) / k
        for j in members:
            idx = resp(mask, j)
            scale = max(len(idx), 1) if length_norm else 1
            x = (sum(float(logp[j, s]) for s in idx) - sum(float(behav[j, s]) for s in idx)) / scale
            res = float(rewards[j]) - r_mean - tau * x
            loss += res * res / (k * len(groups))
            for s in idx:
                grad[j][s] = 2 * res * -tau / (k * len(groups) * scale)
    return t(loss), t(grad)


def ref_token_rewards(rewards, mask, kl=None, kl_coef=0.0):
    B, T = mask.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = resp(mask, b)
        for s in idx:
            out[b][s] = -kl_coef * float(kl[b, s]) if kl is not None else 0.0
        if idx:
            out[b][idx[-1]] += float(rewards[b])
    return t(out)


def ref_discounted(token_r, gamma):
    B, T = token_r.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        g = 0.0
        for s in reversed(range(T)):
            g = float(token_r[b, s]) + gamma * g
            out[b][s] = g
    return t(out)


def ref_whiten(x, mask):
    B, T = mask.shape
    vals = [float(x[b, s]) for b in range(B) for s in resp(mask, b)]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return t([[(float(x[b, s]) - mean) / (std + STD_EPS) if mask[b, s] else 0.0 for s in range(T)]
              for b in range(B)])


def ref_gae(token_r, values, mask, gamma, lam):
    """delta_t = r_t + gamma*V_{t+1} - V_t (V past the last response token = 0),
    A_t = delta_t + gamma*lam*A_{t+1}, R_t = A_t + V_t; 0 off the response."""
    B, T = mask.shape
    values = values.detach()
    adv, ret = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for b in range(B):
        a_next = v_next = 0.0
        for s in reversed(resp(mask, b)):
            v = float(values[b, s])
            a_next = float(token_r[b, s]) + gamma * v_next - v + gamma * lam * a_next
            adv[b][s], ret[b][s], v_next = a_next, a_next + v, v
    return t(adv), t(ret)


def ref_value_loss(values, old, returns, mask, *, clip, agg):
    """(loss, d loss / d values, clip_frac). loss_t = 1/2 max((V-R)^2, (V_clip-R)^2),
    V_clip = V_old + clip(V - V_old, -c, c). The clip is active when |V - V_old| > c and
    the clipped error is the larger one; then the gradient is 0 (V_clip is constant in V)."""
    B, T = mask.shape
    values = values.detach()
    loss, grad, n_clip = 0.0, [[0.0] * T for _ in range(B)], 0
    coef = agg_coef(mask, agg)
    for (b, s), c in coef.items():
        v, vo, r = float(values[b, s]), float(old[b, s]), float(returns[b, s])
        err, dv = (v - r) ** 2, v - r
        if clip is not None:
            v_clip = vo + min(max(v - vo, -clip), clip)
            if abs(v - vo) > clip and (v_clip - r) ** 2 > err:
                err, dv = (v_clip - r) ** 2, 0.0
                n_clip += 1
        loss += c * 0.5 * err
        grad[b][s] = c * dv
    return t(loss), t(grad), n_clip / len(coef)


def ref_entropy(row: list[float]) -> tuple[float, list[float]]:
    """H = -sum p log p; dH/dz_i = -p_i (log p_i + H), 0 where p_i = 0 (logit -inf)."""
    mx = max(row)
    lse = mx + math.log(sum(math.exp(z - mx) for z in row if z != -INF))
    logp = [z - lse if z != -INF else None for z in row]
    h = -sum(math.exp(lp) * lp for lp in logp if lp is not None)
    grad = [0.0 if lp is None else -math.exp(lp) * (lp + h) for lp in logp]
    return h, grad


# ============================================================== random padded batches

LENGTHS = [4, 7, 1, 0, 3, 6, 2, 5]  # row 3 fully padded, row 1 full
GROUPS = [30, -4, 30, 8, 11, -4, 30, 8]  # non-contiguous, out of order; 11 is a group of one
PROMPT = [2, 0, 1, 0, 3, 1, 0, 2]  # prompt positions before the response (GAE batches)


def garbage_pad(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with every non-response position replaced by inf, -inf, nan, inf, ..."""
    cycle = t([INF, -INF, NAN]).repeat(x.numel() // 3 + 1)[: x.numel()].view_as(x)
    return torch.where(mask.bool(), x, cycle)


def batch(seed: int, prompt: bool = False) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), 9 if prompt else 7
    mask = torch.zeros(B, T)
    for b, n in enumerate(LENGTHS):
        start = PROMPT[b] if prompt else 0
        mask[b, start:start + n] = 1.0

    def rnd(scale=1.0):
        return scale * torch.randn(B, T, generator=g, dtype=D)

    logp = -2 * torch.rand(B, T, generator=g, dtype=D)
    prox = logp + rnd(0.8)
    behav = prox + rnd(0.7)
    adv_seq = torch.randn(B, generator=g, dtype=D)
    adv_seq[3] = NAN  # the fully padded row's advantage is never used
    values = rnd(0.5)
    return SimpleNamespace(
        mask=mask,
        group=torch.tensor(GROUPS),
        logp=garbage_pad(logp, mask).requires_grad_(),
        prox=garbage_pad(prox, mask),
        behav=garbage_pad(behav, mask),
        adv_tok=garbage_pad(rnd(), mask),
        adv_seq=adv_seq,
        rewards=torch.randint(0, 3, (B,), generator=g).to(D),
        kl=garbage_pad(torch.rand(B, T, generator=g, dtype=D), mask),
        token_r=garbage_pad(rnd(0.3), mask),
        values=garbage_pad(values, mask).requires_grad_(),
        old_values=garbage_pad(values + rnd(0.15), mask),
        returns=garbage_pad(rnd(0.5), mask),
    )


# ============================================================== PPO


def check_ppo_stats(got: dict, ref: dict):
    for key, value in ref.items():
        # the library divides integer counts in float32: fractions agree to ~1e-7 only
        tol = dict(rel=1e-6, abs=1e-7) if "frac" in key else dict(rel=0, abs=ATOL)
        assert got[key] == pytest.approx(value, **tol), key


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "naive"])
@pytest.mark.parametrize("dual_clip", [None, 2.0], ids=["no-dual", "dual2"])
@pytest.mark.parametrize("adv_kind", ["seq", "tok"])
def test_ppo_matches_reference(agg, decoupled, dual_clip, adv_kind):
    seen = {k: 0.0 for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "is/capped_frac")}
    for seed in (0, 1):
        x = batch(seed)
        adv = x.adv_seq if adv_kind == "seq" else x.adv_tok
        kw = dict(eps_low=0.15, eps_high=0.28, is_cap=1.5, decoupled=decoupled, agg=agg, dual_clip=dual_clip)
        loss, stats = ppo_clip_loss(x.logp, x.prox, x.behav, adv, x.mask, **kw)
        ref_loss, ref_grad, ref_stats = ref_ppo(x.logp, x.prox, x.behav, adv, x.mask, **kw)
        close(loss, ref_loss)
        close(grad_of(loss, x.logp), ref_grad)  # includes exact 0 on padding
        check_ppo_stats(stats, ref_stats)
        for k in seen:
            seen[k] += stats[k]
    # the batches really exercise both clip sides, the IS cap and the dual clip
    assert seen["clip_frac_low"] > 0 and seen["clip_frac_high"] > 0
    assert (seen["is/capped_frac"] > 0) == decoupled
    assert (seen["dual_clip_frac"] > 0) == (dual_clip is not None)


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
    loss, st = ppo_clip_loss(logp, prox, behav, adv, mask, eps_low=0.15, eps_high=0.2, is_cap=2.0, agg=agg)
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
    # w = 2, 0.5, 1, 1.5: sum 5, sum w^2 = 7.5 -> ESS = 25 / (4 * 7.5) = 0.8333
    # mismatch k3(d = behav - prox = -ln raw) = raw - 1 - ln raw, raw = 3, 0.5, 1, 1.5
    mismatch = sum(raw - 1 - math.log(raw) for raw in (3.0, 0.5, 1.0, 1.5)) / 4  # 0.29727
    check_ppo_stats(st, {"clip_frac": 0.5, "clip_frac_low": 0.25, "clip_frac_high": 0.25, "dual_clip_frac": 0.0,
                         "is/ess": 25 / 30, "is/capped_frac": 0.25, "is/weight_mean": 1.25,
                         "mismatch_kl": mismatch, "ratio_mean": (1.5 + 0.7 + 1.1 + 0.6) / 4})


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
    loss, st = ppo_clip_loss(logp, zero, zero, adv, mask, decoupled=False, dual_clip=3.0)
    close(loss, 1.15)
    close(grad_of(loss, logp), [[0.0, 0.5, 0.0, 0.0]])
    assert st["dual_clip_frac"] == pytest.approx(0.25)
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["clip_frac_low"] == pytest.approx(0.25) and st["clip_frac_high"] == pytest.approx(0.25)
    loss, st = ppo_clip_loss(logp, zero, zero, adv, mask, decoupled=False)
    close(loss, 1.4)
    close(grad_of(loss, logp), [[1.0, 0.5, 0.0, 0.0]])
    assert st["dual_clip_frac"] == 0.0
    # decoupled with w = 2 on every token (prox - behav = ln 2, cap 3): every loss doubles
    loss, _ = ppo_clip_loss(logp, zero, zero - math.log(2.0), adv, mask, is_cap=3.0, dual_clip=3.0)
    close(loss, 2.3)
    close(grad_of(loss, logp), [[0.0, 1.0, 0.0, 0.0]])


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0])
def test_ppo_dual_clip_must_exceed_one(bad):
    z = torch.zeros(1, 1, dtype=D)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(z, z, z, torch.zeros(1, dtype=D), torch.ones(1, 1), dual_clip=bad)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_ppo_zero_staleness_decoupled_equals_standard_ppo(agg, dual_clip):
    # logp_behav == logp_prox (no staleness), logp != logp_prox (later minibatch step): w = 1 and
    # the trust region is centred on the same policy, so decoupled == naive PPO, value and gradient.
    x = batch(2)
    # is_cap = 1 = the raw weight: "capped" means raw > cap strictly, so capped_frac stays 0
    kw = dict(eps_low=0.15, eps_high=0.28, is_cap=1.0, agg=agg, dual_clip=dual_clip)
    dec, st = ppo_clip_loss(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=True, **kw)
    naive, _ = ppo_clip_loss(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=False, **kw)
    g_dec = grad_of(dec, x.logp)
    close(dec, naive)
    close(g_dec, grad_of(naive, x.logp))
    ref_loss, ref_grad, _ = ref_ppo(x.logp, x.prox, x.prox, x.adv_tok, x.mask, decoupled=False, **kw)
    close(dec, ref_loss)
    close(g_dec, ref_grad)
    assert st["is/ess"] == pytest.approx(1.0) and st["mismatch_kl"] == 0.0 and st["is/capped_frac"] == 0.0
    assert st["clip_frac"] > 0  # the ratios are far from 1: clipping is in play


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("adv_kind", ["seq", "tok"])
def test_ppo_one_step_decoupled_is_weighted_policy_gradient(agg, adv_kind):
    # logp_prox = logp.detach(), stale behav: r = 1, no clipping, gradient = -c_bt * w * A (d r / d logp = 1)
    x = batch(3)
    adv = x.adv_seq if adv_kind == "seq" else x.adv_tok
    loss, st = ppo_clip_loss(x.logp, x.logp.detach(), x.behav, adv, x.mask, is_cap=1.5, agg=agg, dual_clip=2.0)
    expected_grad, expected_loss = torch.zeros_like(x.prox), 0.0
    for (b, s), c in agg_coef(x.mask, agg).items():
        w = min(math.exp(float(x.logp.detach()[b, s]) - float(x.behav[b, s])), 1.5)
        a = float(adv[b]) if adv_kind == "seq" else float(adv[b, s])
        expected_grad[b, s] = -c * w * a
        expected_loss += -c * w * a
    close(loss, expected_loss)
    close(grad_of(loss, x.logp), expected_grad)
    assert st["clip_frac"] == 0.0 and st["dual_clip_frac"] == 0.0 and st["ratio_mean"] == pytest.approx(1.0)
    assert st["is/capped_frac"] > 0  # the cap is exercised


@pytest.mark.parametrize("decoupled", [True, False])
def test_ppo_all_padding_batch(decoupled):
    mask = torch.zeros(2, 3)
    logp = garbage_pad(torch.zeros(2, 3, dtype=D), mask).requires_grad_()
    junk = garbage_pad(torch.zeros(2, 3, dtype=D), mask)
    loss, st = ppo_clip_loss(logp, junk, junk, t([NAN, INF]), mask, decoupled=decoupled, dual_clip=2.0)
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
    assert st["opmd/groups"] == 2.0


@pytest.mark.parametrize("length_norm", [False, True])
@pytest.mark.parametrize("tau", [1.0, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_opmd_matches_reference(length_norm, tau, seed):
    x = batch(seed)
    loss, stats = opmd_loss(x.logp, x.behav, x.mask, x.rewards, x.group, tau=tau, length_norm=length_norm)
    ref_loss, ref_grad = ref_opmd(x.logp, x.behav, x.mask, x.rewards, x.group, tau=tau, length_norm=length_norm)
    close(loss, ref_loss)
    close(grad_of(loss, x.logp), ref_grad)
    assert stats["opmd/groups"] == 4.0 and all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("length_norm", [False, True])
def test_opmd_groups_of_one(length_norm):
    # every group has one member: mean(r) = r, residual = -tau * x, loss = mean_j (tau * x_j)^2
    x = batch(4)
    singles = torch.arange(len(LENGTHS)) * 7 - 20
    loss, _ = opmd_loss(x.logp, x.behav, x.mask, x.rewards, singles, tau=0.4, length_norm=length_norm)
    terms = []
    for b in range(len(LENGTHS)):
        idx = resp(x.mask, b)
        lr = sum(float(x.logp.detach()[b, s]) - float(x.behav[b, s]) for s in idx)
        terms.append((0.4 * lr / (max(len(idx), 1) if length_norm else 1)) ** 2)
    close(loss, sum(terms) / len(terms))
    _, ref_grad = ref_opmd(x.logp, x.behav, x.mask, x.rewards, singles, tau=0.4, length_norm=length_norm)
    close(grad_of(loss, x.logp), ref_grad)


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
    close(token_rewards(torch.tensor([2, -1, 7]), mask, kl=kl, kl_coef=0.0), [[0, 0, 0, 2, 0], [0, -1, 0, 0, 0], [0] * 5])


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
    outs = [run(rows, lambda v, o=sum(local) - local[i]: v + o) for i, rows in enumerate(shards)]
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
    assert st["value_clip_frac"] == pytest.approx(0.25)
    # clip=None: plain 1/2 (V-R)^2 -> row0 0.125 + 2 + 0.125, grads -0.5, -2, 0.5
    loss, st = value_loss(values, old, ret, mask, clip=None, agg="token-mean")
    close(loss, (0.125 + 2 + 0.125 + 0.5) / 4)
    close(grad_of(loss, values), [[-0.5 / 4, -2 / 4, 0.5 / 4], [-1 / 4, 0, 0], [0, 0, 0]])
    assert st["value_clip_frac"] == 0.0


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
        assert st["value_clip_frac"] == pytest.approx(ref_frac, rel=1e-6)
        total += ref_frac
    assert total > 0


def test_value_clip_frac_ignores_rounding():
    # |V - V_old| = 0.14 < c = 0.2: the clip is not active, yet 0.08 + (-0.06 - 0.08) = -0.06000000000000001
    _, st = value_loss(t([[-0.06]]), t([[0.08]]), t([[0.6]]), torch.ones(1, 1), clip=0.2)
    assert st["value_clip_frac"] == 0.0


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
