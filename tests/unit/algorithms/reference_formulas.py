"""Independent references and random padded batches shared by the test_reference_* modules.

Not a test module. The `ref_*` functions are written from the formulas of docs/algorithms.md
("Notation and formulas") and the module docstrings only: plain Python floats, one loop over
samples and tokens, gradients derived by hand (no autograd, no async_rl code). `batch` builds
float64 right-padded batches that contain groups of one, non-contiguous out-of-order group ids,
a fully padded row and inf/nan garbage in every padded position (`garbage_pad`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

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


def ref_ppo(logp, prox, behav, adv, mask, *, eps_low, eps_high, is_cap, decoupled, agg, dual_clip=None,
            is_mode="truncate", log_ratio_clamp=20.0):
    """(loss, d loss / d logp, stats). r = exp(logp - anchor), w = min(exp(prox - behav), cap)
    (decoupled, is_mode truncate; mask: w = 0 above the cap, the token still counted in the
    denominator) or anchor = behav, w = 1 (naive); every log-ratio clamped to +-log_ratio_clamp
    before exp; obj = min(rA, clip(r)A), for A<0 with dual clip obj = max(obj, dual*A);
    loss_t = -w*obj. d obj/d logp = rA unless a clip (or the log-ratio clamp) is active, else 0."""
    B, T = mask.shape
    logp = logp.detach()
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    n_clip = n_low = n_high = n_dual = n_capped = 0
    ws, ratios = [], []
    coef = agg_coef(mask, agg)
    for (b, s), c in coef.items():
        lp, px, bh = float(logp[b, s]), float(prox[b, s]), float(behav[b, s])
        a = float(adv[b, s]) if adv.dim() == 2 else float(adv[b])
        def clamp(x):
            return min(max(x, -log_ratio_clamp), log_ratio_clamp)

        if decoupled:
            log_r, raw = lp - px, math.exp(clamp(px - bh))
            w = min(raw, is_cap) if is_mode == "truncate" else (0.0 if raw > is_cap else raw)
            n_capped += raw > is_cap
        else:
            log_r, w = lp - bh, 1.0
        r = math.exp(clamp(log_r))
        rc = min(max(r, 1 - eps_low), 1 + eps_high)
        obj = min(r * a, rc * a)
        clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
        dobj = 0.0 if clipped or abs(log_r) > log_ratio_clamp else r * a
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
    n = len(coef)
    stats = {
        "is/clip_frac": n_clip / n, "is/clip_frac_low": n_low / n, "is/clip_frac_high": n_high / n,
        "is/dual_clip_frac": n_dual / n, "is/capped_frac": n_capped / n, "is/weight_mean": sum(ws) / n,
        "is/ratio_mean": sum(ratios) / n,
    }
    return t(loss), t(grad), stats


def ref_off_policy(prox, behav, mask):
    """is/ess = (sum w)^2 / (N sum w^2) of the raw weights w = exp(prox - behav) and
    is/mismatch_kl = mean k3 with d = logp_behav - logp_prox, over the N response tokens."""
    B, T = mask.shape
    pairs = [(float(prox[b, s]), float(behav[b, s])) for b in range(B) for s in resp(mask, b)]
    ws = [math.exp(px - bh) for px, bh in pairs]
    return {"is/ess": sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws)),
            "is/mismatch_kl": sum(k3(bh - px) for px, bh in pairs) / len(pairs)}


def ref_opmd(logp, behav, mask, rewards, group, *, tau, length_norm):
    """(loss, d loss / d logp): mean over groups of (1/k) sum_j (r_j - mean r - tau*x_j)^2 with
    x_j = (S_j - S_j^behav) [/ max(len_j, 1)]; d/d logp_t of row j = 2*res_j*(-tau)/(G*k)[/len_j].
    G counts the groups with a response token: one without (a sample the learner left
    out, alone in its group) has nothing to learn from."""
    B, T = mask.shape
    logp = logp.detach()
    groups: dict[int, list[int]] = {}
    for b in range(B):
        groups.setdefault(int(group[b]), []).append(b)
    learning = sum(any(resp(mask, j) for j in members) for members in groups.values())
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for members in groups.values():
        k = len(members)
        r_mean = sum(float(rewards[j]) for j in members) / k
        for j in members:
            idx = resp(mask, j)
            scale = max(len(idx), 1) if length_norm else 1
            x = (sum(float(logp[j, s]) for s in idx) - sum(float(behav[j, s]) for s in idx)) / scale
            res = float(rewards[j]) - r_mean - tau * x
            loss += res * res / (k * learning)
            for s in idx:
                grad[j][s] = 2 * res * -tau / (k * learning * scale)
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
