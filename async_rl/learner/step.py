"""One learner step: the whole RL algorithm, run identically on every learner rank.

    plan        micro-batches of whole groups, for each of `train.minibatches` disjoint slices;
                with `learner.pack`, each micro-batch's packed layout, made once
    no grad     proximal log-probs (when the step takes several optimizer steps),
                reference log-probs (KL), values (GAE)
    advantages  ADVANTAGES[train.advantage]: group-relative ones are local (each rank
                holds whole groups), REINFORCE++/GAE whitening sums its moments over ranks
    for each minibatch:
        for each micro-batch:
            weights = CORRECTIONS[train.correction] (behavior -> proximal)
            loss = LOSSES[train.loss] + KL + entropy bonus (+ critic loss), each term
                   this micro-batch's share of the global minibatch mean -> backward
        optimizer step (skipped on every rank when a loss or gradient is non-finite)
    metrics     reduced over micro-batches and ranks once: every figure is global

How the shares are formed, and why each backward is scaled by the world size, is
algorithms/normalization.py: the step equals a single process training on the whole
batch (tests/integration/test_fsdp.py checks it in float64, up to float32 rounding).
With `learner.pack` the policy/reference forwards are padding-free (packing.py), with
`learner.share_prompt` each group's prompt is computed once; the critic's forward stays
padded. The loss math stays in the padded [N, L-1] layout of batching.py, where every
algorithm is written and tested: packed log-probs are placed back into it.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from async_rl.algorithms.advantages import ADVANTAGES, AdvantageInputs
from async_rl.algorithms.aggregation import aggregate
from async_rl.algorithms.corrections import correct, sequence_log_ratio
from async_rl.algorithms.gae import value_loss as critic_loss
from async_rl.algorithms.importance import off_policy_figures
from async_rl.algorithms.kl import kl_estimate
from async_rl.algorithms.losses import LOSSES, LossInputs
from async_rl.algorithms.normalization import Shares, Units, backward_share, global_units
from async_rl.algorithms.overlong import overlong_filter, overlong_penalty
from async_rl.algorithms.step_metrics import Count, Mean, StepMetrics
from async_rl.algorithms.token_logp import chosen_logp
from async_rl.config import Config
from async_rl.learner import packing
from async_rl.learner.batching import Batch
from async_rl.learner.models import Models

Micro = tuple[int, int]  # a micro-batch: [start, stop) rows of whole groups


def forward_logp(model, batch: Batch, temperature: float, entropy: bool = False, entropy_grad: bool = False,
                 layout: packing.Packed | None = None):
    """Log-probs `[N, L-1]` of the batch's next tokens under `model`, at the actors'
    sampling temperature (their recorded log-probs are tempered too); optionally the
    per-token entropy of the same distribution, differentiable only when it is a loss
    term. `layout`: the batch's packed layout, for one padding-free forward scoring only
    response tokens (0 elsewhere; see packing.py).
    The softmax math is float32 whatever the model's compute dtype (bf16 logits would
    round log-probs to ~3 significant digits, and importance ratios with them), in
    chunks of tokens (algorithms/token_logp.py): no float32 [tokens, V] tensor exists whole."""
    if layout is not None:
        logits = packing.packed_logits(model, layout)
        targets, place = layout.targets, lambda x: packing.scatter_scored(x, layout)
    else:
        # Scored over all L positions, so the logits stay contiguous (no [N, L-1, V] copy);
        # the last position's dummy target is dropped.
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits
        targets = torch.nn.functional.pad(batch.tokens[:, 1:], (0, 1))

        def place(x):
            return x[:, :-1]
    grad = entropy and entropy_grad and torch.is_grad_enabled()
    logp, ent = chosen_logp(logits, targets, temperature, entropy=entropy)
    if ent is None:
        return place(logp), None
    return place(logp), place(ent if grad else ent.detach())


def _layouts(cfg: Config, model, local: Batch, micros: list[Micro]) -> dict[Micro, packing.Packed | None]:
    """Each micro-batch's packed layout (learner.pack), made once for all its forwards."""
    lc = cfg.learner
    if not lc.pack:
        return dict.fromkeys(micros)
    group_size = cfg.train.group_size if lc.share_prompt else None
    return {m: packing.layout(model, local.rows(*m), lc.pack_row_tokens, group_size) for m in micros}


def forward_values(critic, batch: Batch) -> torch.Tensor:
    return critic(batch.tokens, batch.attention)[:, :-1]


@dataclass
class Prepared:
    """A batch's rows with what was computed for them before the optimizer steps."""

    batch: Batch
    advantages: torch.Tensor  # [N] or [N, L-1]
    returns: torch.Tensor | None  # the critic's regression targets (gae)
    prox: torch.Tensor | None  # proximal log-probs, when train.minibatches > 1
    ref: torch.Tensor | None  # reference log-probs (KL)
    values: torch.Tensor | None  # the critic's values the advantages came from

    def rows(self, start: int, stop: int) -> Prepared:
        return self.take(slice(start, stop))

    def take(self, index: torch.Tensor | slice) -> Prepared:
        def cut(x):
            return None if x is None else x[index]

        return Prepared(self.batch.take(index), cut(self.advantages), cut(self.returns), cut(self.prox), cut(self.ref),
                        cut(self.values))


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def _all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def _with_overlong(cfg: Config, local: Batch) -> Batch:
    """DAPO's overlong penalty and filter (algorithms/overlong.py), when configured."""
    o = cfg.train.overlong
    if o.penalty_tokens:  # on the response length, before the filter empties any row
        local = replace(local, rewards=local.rewards + overlong_penalty(
            local.loss_mask.sum(-1), cfg.actors.max_new_tokens, o.penalty_tokens, o.penalty))
    if o.filter:
        local = replace(local, loss_mask=overlong_filter(local.loss_mask, local.truncated))
    return local


def micro_batch_plan(cfg: Config, local: Batch) -> list[list[Micro]]:
    """Per minibatch (equal disjoint row slices), its micro-batches: row ranges of whole groups."""
    t, lc = cfg.train, cfg.learner
    rows_per_micro = max(1, lc.micro_batch_size // t.group_size) * t.group_size
    rows_per_mb = local.tokens.shape[0] // t.minibatches
    shared = local.prompt_len if lc.pack and lc.share_prompt else None
    return [packing.micro_batches(local.attention, k * rows_per_mb, (k + 1) * rows_per_mb, t.group_size,
                                  rows_per_micro, lc.micro_batch_tokens, lc.pack, shared)
            for k in range(t.minibatches)]


@torch.no_grad()
def _no_grad_pass(fn, batch: Batch, layouts: dict[Micro, packing.Packed | None]) -> torch.Tensor:
    return torch.cat([fn(batch.rows(*m), layout) for m, layout in layouts.items()])


def _prepare(cfg: Config, models: Models, local: Batch, layouts: dict[Micro, packing.Packed | None]) -> Prepared:
    """No-grad forwards over this rank's rows, then advantages."""
    t = cfg.train

    def logp_of(model):
        return lambda b, layout: forward_logp(model, b, cfg.actors.temperature, layout=layout)[0]

    prox = ref = values = kl = None
    if t.minibatches > 1:
        prox = _no_grad_pass(logp_of(models.policy), local, layouts)
    if models.reference is not None:
        ref = _no_grad_pass(logp_of(models.reference), local, layouts)
    elif models.reference_is_base:
        from async_rl.lora.adapters import base_only

        with base_only(models.policy):
            ref = _no_grad_pass(logp_of(models.policy), local, layouts)
    if models.critic is not None:
        values = _no_grad_pass(lambda b, _: forward_values(models.critic, b), local, layouts)
    if ref is not None and t.kl.mode == "reward":
        # The behavior policy sampled the tokens, so its log-probs give an unbiased estimate.
        kl = torch.where(local.loss_mask.bool(), kl_estimate(local.logp_behav, ref, t.kl.estimator,
                                                                         clamp=t.kl.clamp), 0.0)
    x = AdvantageInputs(local.rewards, local.loss_mask, local.group, local.baselines, t.advantage, t.kl.coef, kl,
                        values, _all_reduce_sum, step_rewards=local.step_rewards)
    est = ADVANTAGES[t.advantage.name](x)
    # OPMD regresses on the rewards the sequence-level estimators saw (KL-penalized).
    return Prepared(replace(local, rewards=x.sequence_rewards()), est.advantages, est.returns, prox, ref, values)


def _units(cfg: Config, batch: Batch) -> Units:
    return Units.of(LOSSES[cfg.train.loss.name], batch.loss_mask, batch.group, cfg.train.agg)


Histograms = dict[str, list[torch.Tensor]]


def _backward_micro(cfg: Config, models: Models, x: Prepared, layout: packing.Packed | None, minibatch: Units,
                    metrics: StepMetrics, histograms: Histograms | None, padding: bool = False
                    ) -> dict[str, float]:
    """Forward and backward one micro-batch's share of the minibatch loss and record its
    diagnostics; return its loss terms (this rank's shares). Appends the micro-batch's raw
    importance weights (response tokens) and sequence log-ratios to `histograms` if given.
    A `padding` micro-batch only keeps this rank's collectives in step with the other
    ranks': its loss is scaled by 0, and its diagnostics and loss terms count as zeros."""
    t, b, world = cfg.train, x.batch, dist.get_world_size()
    if padding:
        metrics, histograms = metrics.zeros_into(), None
    mask = b.loss_mask
    units = _units(cfg, b)
    share = Shares.of(units, minibatch)
    logp, entropy = forward_logp(models.policy, b, cfg.actors.temperature, entropy=True,
                                 entropy_grad=t.entropy_coef > 0, layout=layout)
    prox = logp.detach() if x.prox is None else x.prox  # one optimizer step: the proximal policy is the current one
    correction = correct(t.correction, prox, b.logp_behav, mask)
    out = LOSSES[t.loss.name](LossInputs(logp, prox, b.logp_behav, x.advantages, mask, b.rewards, b.group, t.loss,
                                         t.agg, correction))
    metrics.update(out.metrics)
    metrics.add("policy/entropy", Mean(float(torch.where(mask.bool(), entropy.detach(), 0.0).sum()), units.tokens))
    weights, off_policy = off_policy_figures(prox, b.logp_behav, mask, correction)
    metrics.update(off_policy)
    if histograms is not None:
        m = mask.bool()
        histograms.setdefault("is/weight", []).append(weights[m].cpu())
        log_ratio = torch.where(m, prox.double() - b.logp_behav.double(), 0.0)
        histograms.setdefault("is/seq_log_ratio", []).append(sequence_log_ratio(log_ratio, m)[m.any(-1)].cpu())

    terms = {"loss/policy": out.loss * share.policy}
    if x.ref is not None:
        # Clamped as it enters the loss, so policy/kl_ref logs what is penalized.
        kl = kl_estimate(logp, x.ref, t.kl.estimator, clamp=t.kl.clamp)
        metrics.add("policy/kl_ref", Mean(float(torch.where(mask.bool(), kl.detach(), 0.0).sum()), units.tokens))
        if t.kl.mode == "loss":
            terms["loss/kl"] = t.kl.coef * aggregate(kl, mask, t.agg) * share.regularizer
    if t.entropy_coef > 0:
        terms["loss/entropy"] = -t.entropy_coef * aggregate(entropy, mask, t.agg) * share.regularizer
    loss = sum(terms.values()) * (0.0 if padding else 1.0)
    backward_share(loss, world)
    losses = {**{name: float(term.detach()) for name, term in terms.items()}, "loss/total": float(loss.detach())}

    if models.critic is not None:  # after the policy's backward: one model's activations alive at a time
        value_loss, critic_metrics = critic_loss(forward_values(models.critic, b), x.values, x.returns,
                                                           mask, clip=t.advantage.value_clip)
        backward_share(value_loss * share.value * (0.0 if padding else 1.0), world)
        losses["loss/value"] = float(value_loss.detach()) * share.value
        metrics.update({key: Mean.of(value, units.tokens) for key, value in critic_metrics.items()})
    return {key: 0.0 for key in losses} if padding else losses


def clipped_grad_norm(model, grad_clip: float) -> torch.Tensor:
    """Clip to `grad_clip` and return the global (all-rank) norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    return grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm


def _finite_everywhere(*values: torch.Tensor | float) -> bool:
    """True when every value is finite on every rank (one all_reduce, so all ranks agree)."""
    bad = torch.tensor([0.0 if all(math.isfinite(float(v)) for v in values) else 1.0],
                       device=values[0].device if isinstance(values[0], torch.Tensor) else "cpu")
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item() == 0.0)


def _optimizer_step(models: Models, grad_clip: float, losses: dict[str, float], metrics: StepMetrics) -> None:
    """Step the policy (and critic), or skip both when any loss or gradient is non-finite:
    one bad batch (an overflowing reward, a corrupt sample) must not poison the weights.
    `losses`: this minibatch's loss terms on this rank."""
    world = dist.get_world_size()
    norms = {"learner/grad_norm": clipped_grad_norm(models.policy, grad_clip)}
    if models.critic is not None:
        norms["critic/grad_norm"] = clipped_grad_norm(models.critic, grad_clip)
    ok = _finite_everywhere(*norms.values(), *losses.values())
    for optimizer in (models.optimizer, models.critic_optimizer):
        if optimizer is None:
            continue
        if ok:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # Means over the step's optimizer steps, each rank holding 1/world of every one:
    # its share of the losses, 1/world of the (global) gradient norms.
    for key, value in losses.items():
        metrics.add(key, Mean(value, 1.0 / world))
    for key, norm in norms.items():
        metrics.add(key, Mean(float(norm) / world if ok else 0.0, 1.0 / world))
    metrics.add("learner/skipped_steps", Count(0.0 if ok else 1.0 / world))


def _skips_zero_advantage(cfg: Config, models: Models) -> bool:
    """Whether a group whose advantages are all 0 adds nothing to the step's gradient: the
    PPO, GSPO and CISPO losses are A times a function of the log-probs, and no other term
    reads the group."""
    t = cfg.train
    return (cfg.learner.skip_zero_advantage and t.loss.name in ("ppo", "gspo", "cispo") and t.minibatches == 1
            and t.entropy_coef == 0 and models.reference is None and not models.reference_is_base
            and models.critic is None)


def _group_signal(x: Prepared, group_size: int) -> torch.Tensor:
    """bool [groups]: whether the group has a nonzero advantage on a scored token."""
    adv = x.advantages if x.advantages.dim() == 2 else x.advantages[:, None]
    return ((adv != 0) & x.batch.loss_mask.bool()).any(-1).view(-1, group_size).any(-1)


def _signal_first(x: Prepared, signal: torch.Tensor, group_size: int) -> tuple[Prepared, int]:
    """x's rows with the groups that have a signal first (each part in admission order),
    and how many rows those are."""
    groups = torch.cat([signal.nonzero(), (~signal).nonzero()]).squeeze(-1)
    rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)
    return x.take(rows), int(signal.sum()) * group_size


def _in_step_with_ranks(plan: list[list[Micro]], group_size: int, device) -> list[list[tuple[Micro, bool]]]:
    """Each minibatch's micro-batches, padded so that every rank runs as many as the rank
    with the most (FSDP's collectives run per forward and backward): (micro, is_padding).
    A padding micro-batch is this rank's first group with its loss scaled by 0."""
    counts = torch.tensor([len(micros) for micros in plan], dtype=torch.int64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return [[(m, False) for m in micros] + [((0, group_size), True)] * (int(n) - len(micros))
            for micros, n in zip(plan, counts.tolist())]


def _any_signal(signal: torch.Tensor) -> bool:
    """Whether some group on some rank has a gradient (one all-reduce with several ranks)."""
    count = signal.sum().to(torch.int64).reshape(1)
    if dist.get_world_size() > 1:
        dist.all_reduce(count)
    return bool(count.item() > 0)


def train_step(cfg: Config, models: Models, local: Batch, histograms: Histograms | None = None
               ) -> dict[str, float]:
    """One learner step on this rank's rows (whole groups); returns global diagnostics.
    `histograms`, if given, receives this rank's per-token behavior->proximal importance
    weights (uncapped, "is/weight") and per-response sequence log-ratios
    ("is/seq_log_ratio") for TensorBoard: local values only, no collective."""
    t = cfg.train
    models.policy.train()
    local = _with_overlong(cfg, local)
    # Each loss term is a mean over its whole minibatch on every rank: count the units first.
    per_mb = local.tokens.shape[0] // t.minibatches
    minibatch_units = global_units([_units(cfg, local.rows(k * per_mb, (k + 1) * per_mb))
                                               for k in range(t.minibatches)], _all_reduce_sum, local.tokens.device)
    if _skips_zero_advantage(cfg, models):  # advantages first: no forward is needed for them
        prepared = _prepare(cfg, models, local, {})
        signal = _group_signal(prepared, t.group_size)
        if _any_signal(signal):
            prepared, signal_rows = _signal_first(prepared, signal, t.group_size)
            plan = [micro_batch_plan(cfg, prepared.batch.rows(0, signal_rows))[0] if signal_rows else []]
        else:  # one group per rank, of loss 0: AdamW steps on zero gradients, and diagnostics are real
            plan = [[(0, t.group_size)]]
        layouts = _layouts(cfg, models.policy, prepared.batch, [m for micros in plan for m in micros])
    else:
        plan = micro_batch_plan(cfg, local)
        layouts = _layouts(cfg, models.policy, local, [m for micros in plan for m in micros])
        prepared = _prepare(cfg, models, local, layouts)
        signal = _group_signal(prepared, t.group_size)
    metrics = StepMetrics()
    metrics.add("train/zero_adv_group_frac", Mean(float((~signal).sum()), float(signal.numel())))

    padded = _in_step_with_ranks(plan, t.group_size, local.tokens.device)
    for m, _ in (m for micros in padded for m in micros):
        if m not in layouts:  # a padding micro-batch's
            layouts[m] = _layouts(cfg, models.policy, prepared.batch, [m])[m]
    for micros, units in zip(padded, minibatch_units):
        losses: dict[str, float] = collections.Counter()
        for m, padding in micros:
            losses.update(_backward_micro(cfg, models, prepared.rows(*m), layouts[m], units, metrics, histograms,
                                          padding))
        _optimizer_step(models, t.grad_clip, losses, metrics)
    return metrics.reduce(_all_reduce_sum, local.tokens.device, _all_reduce_max)
