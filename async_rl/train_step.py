"""One learner step: the whole RL algorithm, run identically on every learner rank.

    1. no-grad forwards over this rank's rows: proximal log-probs (when the step takes
       several optimizer steps), reference log-probs (KL), values (GAE);
    2. advantages: group-relative ones are local (each rank holds whole groups);
       REINFORCE++/GAE whitening sums its moments over all ranks;
    3. for each of `train.minibatches` disjoint slices: micro-batch forward/backward of
       policy loss + KL + entropy bonus (+ critic loss), then one optimizer step;
    4. diagnostics summed over micro-batches and ranks, so every figure is global.

FSDP2 averages gradients over ranks, so each micro-batch loss is scaled by its share
of the *global* minibatch normalization times the world size: the result equals a
single process training on the whole batch (tests/test_fsdp.py checks it to 1e-6).
Micro-batches are whole groups, planned by packing.micro_batches; with `learner.pack`
the policy/reference forwards are padding-free (packing.py), with `learner.share_prompt`
each group's prompt is computed once; the critic's forward stays padded.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import algorithms, packing
from .batching import Batch
from .config import Config


@dataclass
class Models:
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None = None  # frozen initial policy, when train.kl.coef > 0
    critic: torch.nn.Module | None = None  # value model, when train.advantage = gae
    critic_optimizer: torch.optim.Optimizer | None = None


def forward_logp(model, batch: Batch, temperature: float, entropy: bool = False, entropy_grad: bool = False,
                 pack: bool = False, row_tokens: int | None = None, group_size: int | None = None):
    """Log-probs `[N, L-1]` of the batch's next tokens under `model`, at the actors'
    sampling temperature (their recorded log-probs are tempered too); optionally the
    per-token entropy of the same distribution, with a graph only when it is a loss
    term (on a large vocabulary that graph is as big as the logits). `pack`: one
    padding-free forward scoring only response tokens (0 elsewhere; see packing.py),
    with each group's prompt computed once when `group_size` is given.
    The softmax math is float32 whatever the model's compute dtype (bf16 logits
    would round log-probs to ~3 significant digits, and importance ratios with them)."""
    if pack:
        logits, layout = packing.packed_logits(model, batch, row_tokens, group_size)
        targets, place = layout.targets, lambda x: packing.scatter_scored(x, layout)
    else:
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits[:, :-1]
        targets, place = batch.tokens[:, 1:], lambda x: x
    logits = logits.float() / temperature
    logp = place(torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1))
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, place(algorithms.token_entropy(logits))


def _packing(cfg: Config) -> dict:
    lc = cfg.learner
    return {"pack": lc.pack, "row_tokens": lc.pack_row_tokens,
            "group_size": cfg.train.group_size if lc.pack and lc.share_prompt else None}


def forward_values(critic, batch: Batch) -> torch.Tensor:
    return critic(batch.tokens, batch.attention)[:, :-1]


@torch.no_grad()
def _no_grad_pass(fn, batch: Batch, micros: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([fn(batch.rows(start, stop)) for start, stop in micros])


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def compute_advantages(cfg: Config, batch: Batch, logp_ref, values):
    """(advantages `[N]` or `[N, L-1]`, critic returns or None, sequence rewards used by OPMD)."""
    t = cfg.train
    mask = batch.loss_mask
    kl_tokens = None
    rewards = batch.rewards
    if logp_ref is not None and t.kl.mode == "reward":
        # Samples come from the behavior policy, so its log-probs give an unbiased estimate.
        kl_tokens = torch.where(mask.bool(), algorithms.kl_estimate(batch.logp_behav, logp_ref, t.kl.estimator,
                                                                     clamp=t.kl.clamp), 0.0)
        rewards = rewards - t.kl.coef * kl_tokens.sum(dim=-1)
    if t.advantage in algorithms.ADVANTAGE_METHODS:
        return algorithms.group_advantages(rewards, batch.group, method=t.advantage), None, rewards
    if t.advantage == "remax":
        return algorithms.remax_advantages(rewards, batch.baselines), None, rewards
    token_r = algorithms.token_rewards(batch.rewards, mask, kl=kl_tokens, kl_coef=t.kl.coef)
    if t.advantage == "reinforce_pp":
        adv = algorithms.masked_whiten(algorithms.discounted_returns(token_r, t.gamma), mask,
                                       reduce_sum=_all_reduce_sum)
        return adv, None, rewards
    adv, returns = algorithms.gae_advantages(token_r, values, mask, gamma=t.gamma, lam=t.critic.lam)
    return algorithms.masked_whiten(adv, mask, reduce_sum=_all_reduce_sum), returns, rewards


def _denominators(cfg: Config, local: Batch, rows_per_mb: int) -> torch.Tensor:
    """Global [minibatches, 3]: policy-loss normalizer (tokens/sequences, or groups for
    OPMD), the `train.agg` normalizer for KL/entropy terms, and response tokens."""
    out = []
    for k in range(cfg.train.minibatches):
        mb = local.rows(k * rows_per_mb, (k + 1) * rows_per_mb)
        agg_d = algorithms.agg_denominator(mb.loss_mask, cfg.train.agg)
        policy_d = float(torch.unique(mb.group).numel()) if cfg.train.loss == "opmd" else agg_d
        out.append([policy_d, agg_d, float(mb.loss_mask.sum())])
    # At least 1e-12: a minibatch whose every sample was filtered out has zero tokens, and
    # its micro-batch shares (0 / denominator) must be 0, not NaN.
    return _all_reduce_sum(torch.tensor(out, dtype=torch.float64, device=local.tokens.device)).cpu().clamp(min=1e-12)


def _micro_loss(cfg: Config, models: Models, micro: Batch, adv, prox, ref, returns, old_values, denom, acc,
                is_weights: list[torch.Tensor] | None = None) -> float:
    """Backward one micro-batch; accumulate its diagnostics into `acc` (sums); return its
    share of the minibatch loss (policy + regularizers + critic) on this rank. Appends
    the micro-batch's raw importance weights (response tokens) to `is_weights` if given."""
    t, world = cfg.train, dist.get_world_size()
    m = micro.loss_mask
    mb = m.bool()
    logp, entropy = forward_logp(models.policy, micro, cfg.actors.temperature, entropy=True,
                                 entropy_grad=t.entropy_coef > 0, **_packing(cfg))
    if prox is None:  # one optimizer step per batch: the proximal policy is the current one
        prox = logp.detach()
    policy_d, agg_d, tokens = denom.tolist()
    d_agg = algorithms.agg_denominator(m, t.agg)
    n_tok = float(m.sum())
    if t.loss == "ppo":
        p = t.ppo
        policy, stats = algorithms.ppo_clip_loss(
            logp, prox, micro.logp_behav, adv, m, eps_low=p.eps_low, eps_high=p.eps_high, is_cap=p.is_cap,
            decoupled=p.decoupled, agg=t.agg, dual_clip=p.dual_clip, is_mode=p.is_mode,
            log_ratio_clamp=p.log_ratio_clamp)
        d_policy = d_agg
    else:
        policy, stats = algorithms.opmd_loss(logp, micro.logp_behav, m, micro.rewards, micro.group,
                                             tau=t.opmd.tau, length_norm=t.opmd.length_norm)
        d_policy = float(torch.unique(micro.group).numel())
    terms = {"loss/policy": policy * (d_policy / policy_d)}
    if ref is not None:
        # Clamped as it enters the loss, so policy/kl_ref logs what is penalized.
        kl = algorithms.kl_estimate(logp, ref, t.kl.estimator, clamp=t.kl.clamp)
        acc["policy/kl_ref"] += float(torch.where(mb, kl.detach(), 0.0).sum())
        if t.kl.mode == "loss":
            terms["loss/kl"] = t.kl.coef * algorithms.aggregate(kl, m, t.agg) * (d_agg / agg_d)
    if t.entropy_coef > 0:
        terms["loss/entropy"] = -t.entropy_coef * algorithms.aggregate(entropy, m, t.agg) * (d_agg / agg_d)
    total = sum(terms.values())
    (total * world).backward()
    value_share = 0.0
    if models.critic is not None:
        values = forward_values(models.critic, micro)
        vloss, vstats = algorithms.value_loss(values, old_values, returns, m, clip=t.critic.value_clip)
        (vloss * (n_tok / tokens) * world).backward()
        value_share = float(vloss.detach()) * n_tok / tokens
        acc["loss/value"] += value_share
        acc["critic/value_mean"] += vstats["value_mean"] * n_tok
        acc["critic/clip_frac"] += vstats["value_clip_frac"] * n_tok

    for name, term in terms.items():
        acc[name] += float(term.detach())
    acc["loss/total"] += float(total.detach())
    acc["policy/entropy"] += float(torch.where(mb, entropy.detach(), 0.0).sum())
    for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "is/capped_frac"):
        acc[key] += stats.get(key, 0.0) * n_tok
    # k3 of KL(behavior || proximal), for every loss: how far the data is from the policy.
    acc["mismatch_kl"] += float(torch.where(mb, algorithms.kl_estimate(micro.logp_behav, prox, "k3"), 0.0).sum())
    # Importance weights behavior -> proximal over the whole batch, before any cap:
    # how off-policy the data is, whichever loss uses (or ignores) them.
    # float64: the ESS is a ratio of sums over the whole batch, float32 rounding can push it past 1.
    raw_w = torch.exp(torch.where(mb, prox - micro.logp_behav, 0.0).double())
    acc["w_sum"] += float(torch.where(mb, raw_w, 0.0).sum())
    acc["w_sq_sum"] += float(torch.where(mb, raw_w.square(), 0.0).sum())
    if is_weights is not None:
        is_weights.append(raw_w[mb].cpu())
    acc["tokens"] += n_tok
    acc["rows"] += micro.tokens.shape[0]
    for key in ("opmd/residual_mean", "opmd/residual_abs_mean", "opmd/log_ratio_mean"):
        if key in stats:  # means over the micro-batch's samples: weighted by samples, not tokens
            acc[key] += stats[key] * micro.tokens.shape[0]
    return float(total.detach()) + value_share


def _grad_norm(model, grad_clip: float) -> torch.Tensor:
    """Clip to `grad_clip` and return the global (all-rank) norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def _finite_everywhere(*values: torch.Tensor | float) -> bool:
    """True when every value is finite on every rank (one all_reduce, so all ranks agree)."""
    bad = torch.tensor([0.0 if all(math.isfinite(float(v)) for v in values) else 1.0],
                       device=values[0].device if isinstance(values[0], torch.Tensor) else "cpu")
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0.0)


def _optimizer_steps(models: Models, grad_clip: float, local_loss: float, acc) -> None:
    """Step the policy (and critic), or skip both when any loss or gradient is non-finite:
    one bad batch (an overflowing reward, a corrupt sample) must not poison the weights."""
    world = dist.get_world_size()
    norms = [_grad_norm(models.policy, grad_clip)]
    if models.critic is not None:
        norms.append(_grad_norm(models.critic, grad_clip))
    ok = _finite_everywhere(*norms, local_loss)
    for optimizer in (models.optimizer, models.critic_optimizer):
        if optimizer is None:
            continue
        if ok:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    acc["learner/skipped_steps"] += 0.0 if ok else 1.0 / world
    acc["learner/grad_norm"] += float(norms[0]) / world if ok else 0.0
    if models.critic is not None:
        acc["critic/grad_norm"] += float(norms[1]) / world if ok else 0.0


def train_step(cfg: Config, models: Models, local: Batch, is_weights: list[torch.Tensor] | None = None
               ) -> dict[str, float]:
    """One learner step on this rank's rows (whole groups); returns global diagnostics.
    `is_weights`, if given, receives this rank's per-token behavior->proximal importance
    weights (uncapped), for the TensorBoard histogram: local tokens only, no collective."""
    t, lc = cfg.train, cfg.learner
    models.policy.train()
    if t.overlong.penalty_tokens:  # on the response length, before the filter empties any row
        local.rewards = local.rewards + algorithms.overlong_penalty(
            local.loss_mask.sum(-1), cfg.actors.max_new_tokens, t.overlong.penalty_tokens, t.overlong.penalty)
    if t.overlong.filter:
        local.loss_mask = algorithms.overlong_filter(local.loss_mask, local.truncated)
    N = local.tokens.shape[0]
    rows_per_micro = max(1, lc.micro_batch_size // t.group_size) * t.group_size
    rows_per_mb = N // t.minibatches
    # Per minibatch, its micro-batches (row ranges of whole groups).
    shared = local.prompt_len if lc.pack and lc.share_prompt else None
    plan = [packing.micro_batches(local.attention, k * rows_per_mb, (k + 1) * rows_per_mb, t.group_size,
                                  rows_per_micro, lc.micro_batch_tokens, lc.pack, shared)
            for k in range(t.minibatches)]
    micros = [m for mb in plan for m in mb]

    def logp_of(model):
        return lambda b: forward_logp(model, b, cfg.actors.temperature, **_packing(cfg))[0]

    prox = ref = values = None
    if t.minibatches > 1:
        prox = _no_grad_pass(logp_of(models.policy), local, micros)
    if models.reference is not None:
        ref = _no_grad_pass(logp_of(models.reference), local, micros)
    if models.critic is not None:
        values = _no_grad_pass(lambda b: forward_values(models.critic, b), local, micros)
    adv, returns, rewards = compute_advantages(cfg, local, ref, values)
    local.rewards = rewards  # OPMD regresses on the (possibly KL-penalized) rewards
    denominators = _denominators(cfg, local, rows_per_mb)

    acc: dict[str, float] = collections.defaultdict(float)
    for k in range(t.minibatches):
        local_loss = 0.0  # this minibatch only: one bad minibatch must not condemn the next
        for start, stop in plan[k]:
            rows = slice(start, stop)
            local_loss += _micro_loss(cfg, models, local.rows(start, stop), adv[rows],
                                      None if prox is None else prox[rows], None if ref is None else ref[rows],
                                      None if returns is None else returns[rows],
                                      None if values is None else values[rows], denominators[k], acc,
                                      is_weights)
        _optimizer_steps(models, t.grad_clip, local_loss, acc)

    # One all_reduce for every diagnostic; every rank built the same keys in the same order.
    keys = sorted(acc)
    summed = dict(zip(keys, _all_reduce_sum(torch.tensor([acc[k] for k in keys], dtype=torch.float64,
                                                         device=local.tokens.device)).tolist()))
    n_tok, rows = max(summed.pop("tokens"), 1e-12), max(summed.pop("rows"), 1.0)
    w_sum, w_sq_sum = summed.pop("w_sum"), summed.pop("w_sq_sum")
    out = {}
    for key, value in summed.items():
        if key == "learner/skipped_steps":
            out[key] = round(value)  # optimizer steps skipped in this learner step
        elif key.startswith(("loss/", "learner/", "critic/grad")):
            out[key] = value / t.minibatches  # mean over the step's optimizer steps
        elif key.startswith("opmd/"):
            out[key] = value / rows  # sample means
        else:
            out[key if "/" in key else f"is/{key}"] = value / n_tok  # token means
    out["is/ess"] = w_sum * w_sum / max(n_tok * w_sq_sum, 1e-12)
    return out
