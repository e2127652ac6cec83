"""Online policy mirror descent, squared-loss form of Kimi k1.5 (arXiv 2501.12599).

For a prompt's k responses with rewards r_j and sequence log-probs
S_j = sum_t logp, S_j^behav = sum_t logp_behav:

    loss_group = (1/k) * sum_j (r_j - mean(r) - tau * (S_j - S_j^behav))^2

mean(r) stands in for tau * log Z of the KL-regularized optimum; the sampler's
own log-probabilities are the reference, so stale samples need no importance
weight. The batch loss is the mean over the prompt groups present.

length_norm=True divides each log-ratio by the response length (S_j becomes a
per-token mean), so long responses do not dominate the residual and tau keeps
one meaning across lengths.

The sampler's log-probs being the reference, OPMD needs no importance weight; a
`train.correction` still applies, at the sequence level: tokens it masks leave S_j and
S_j^behav, and response j's squared residual is weighted by W_j, the mean of its
tokens' weights (0 for a masked token). A sequence-level correction gives every token
of a response the same weight, so W_j is that weight; with `none`, W_j = 1.
"""

from __future__ import annotations

import torch


def learning_group_count(mask: torch.Tensor, group: torch.Tensor) -> int:
    """The groups (ids in `group` [B]) with at least one response token in `mask` [B, T]."""
    return int(torch.unique(group[mask.bool().any(dim=-1)]).numel())


def opmd_loss(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group: torch.Tensor,
    *,
    tau: float = 1.0,
    length_norm: bool = False,
    weights: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`logp`, `logp_behav`, `mask` are `[B, T]`; `rewards` and `group` are `[B]`
    (group ids arbitrary, any order); `weights` and `keep` the correction's (None: 1
    and every response token). Returns (scalar loss with grad, {metric key: mean over
    the responses})."""
    response = mask.bool()
    m = response if keep is None else response & keep.bool()
    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # torch.where, not multiplication: garbage (inf/NaN) in padding must not reach sums or grads.
    seq_logp = torch.where(m, logp.to(dtype), zero).sum(dim=-1)
    seq_logp_behav = torch.where(m, logp_behav.detach().to(dtype), zero).sum(dim=-1)
    r = rewards.detach().to(dtype)

    _, gid, counts = torch.unique(group, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    k = counts.to(dtype)[gid]  # size of each response's group, [B]
    r_mean = torch.zeros(n_groups, dtype=dtype, device=r.device).index_add(0, gid, r)[gid] / k

    log_ratio = seq_logp - seq_logp_behav
    if length_norm:
        log_ratio = log_ratio / response.sum(dim=-1).clamp(min=1).to(dtype)
    residual = r - r_mean - tau * log_ratio
    seq_weight = torch.ones_like(r)
    if weights is not None:  # an empty response (no gradient) keeps weight 1: its residual is still a loss value
        mean_weight = torch.where(response, weights.detach().to(dtype), zero).sum(-1) / response.sum(-1).clamp(min=1)
        seq_weight = torch.where(response.any(-1), mean_weight, seq_weight)
    # (1/k) sum over the group, then mean over groups == sum_j residual_j^2 / (k_j * G),
    # G counting the groups with a response token (a left-out sample is a group of one
    # without any: it has nothing to learn from).
    learning_groups = learning_group_count(response, group)
    loss = (seq_weight * residual.square() / k).sum() / max(learning_groups, 1)

    with torch.no_grad():
        stats = {
            "opmd/residual_mean": float(residual.mean()),
            "opmd/residual_abs_mean": float(residual.abs().mean()),
            "opmd/log_ratio_mean": float(log_ratio.mean()),
        }
    return loss, stats
