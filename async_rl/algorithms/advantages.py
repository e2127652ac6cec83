"""Advantage estimators, and `ADVANTAGES`: the ones `train.advantage` can name.

All group statistics use `torch.unique(..., return_inverse=True)` + `index_add`,
so group ids may be arbitrary integers in any order and no Python loop runs over
groups. Advantages are constants for the policy gradient, so outputs are detached.
Every registry entry has one call shape, `AdvantageInputs -> Advantages`; adding an
entry adds a valid `train.advantage` value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from async_rl.algorithms.gae import gae_advantages
from async_rl.algorithms.normalization import ReduceSum

if TYPE_CHECKING:
    from async_rl.algorithms.config import GAEAdvantage, GroupAdvantage, ReinforcePPAdvantage, ReMaxAdvantage

GROUP_METHODS: tuple[str, ...] = ("grpo", "drgrpo", "rloo")
_STD_EPS = 1e-6


def _float(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, *, method: str) -> torch.Tensor:
    """Per-response advantage `[B]` from its prompt group's rewards.

    - grpo:   (r - mean) / (std + 1e-6), unbiased std as torch.std
              (GRPO, DeepSeekMath, arXiv 2402.03300).
    - drgrpo: r - mean, no std division: the std rescaling up-weights
              near-deterministic prompts (Dr.GRPO, arXiv 2503.20783).
    - rloo:   r_i - mean_{j != i} r_j, the leave-one-out baseline keeps the
              estimator unbiased (Ahmadian et al., arXiv 2402.14740; Kool et al. 2019).
    A group of one has no baseline to compare against: its advantage is 0.
    """
    if method not in GROUP_METHODS:
        expected = ", ".join(GROUP_METHODS)
        raise ValueError(f"unknown advantage method {method!r}; expected one of {expected}")
    r = _float(rewards)
    _, gid, counts = torch.unique(group, return_inverse=True, return_counts=True)
    n = counts.to(r.dtype)[gid]  # size of each response's group, [B]
    group_sum = torch.zeros(counts.numel(), dtype=r.dtype, device=r.device).index_add(0, gid, r)[gid]
    centered = r - group_sum / n
    if method == "drgrpo":
        return centered
    if method == "rloo":
        loo_mean = (group_sum - r) / (n - 1).clamp(min=1)
        return torch.where(n > 1, r - loo_mean, torch.zeros_like(r))
    # grpo; for n == 1 centered is 0 and var is 0/1, so the result is 0, not NaN.
    sq = torch.zeros(counts.numel(), dtype=r.dtype, device=r.device).index_add(0, gid, centered.square())[gid]
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    return centered / (std + _STD_EPS)


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, *, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards `[B, T]`: -kl_coef * kl_t on every response token plus the
    sequence reward on its last response token (the RLHF reward shaping of
    Ouyang et al. 2022 / REINFORCE++). Padded positions are 0."""
    m = mask.bool()
    r = _float(rewards)
    out = torch.zeros(m.shape, dtype=r.dtype, device=r.device)
    if kl is not None and kl_coef != 0.0:
        out = torch.where(m, -kl_coef * kl.detach().to(r.dtype), out)
    # last response token: where the running count of response tokens reaches the row's total
    is_last = m & (m.cumsum(dim=-1) == m.sum(dim=-1, keepdim=True))
    return out + torch.where(is_last, r[:, None], torch.zeros_like(out))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, reduce_sum: ReduceSum | None = None) -> torch.Tensor:
    """(x - mean) / (std + 1e-6) over the response tokens of the whole batch (unbiased
    std); padded positions are 0, the result has x's dtype. With `reduce_sum` the
    statistics are those of the global batch, not of one rank's shard."""
    m = mask.bool()
    # float64 moments: var = (sum x^2 - n mean^2) / (n - 1) cancels catastrophically in
    # float32 once mean/std is in the thousands (rewards 1e4 +- 5 gave var = 0 and
    # advantages ~1e6 too large); in float64 its relative error is ~1e-16 (mean/std)^2,
    # < 1e-8 at mean/std = 1e4. A centred two-pass variance would need a second
    # all_reduce per step, so one float64 reduction of raw moments is the cheaper cure.
    x64 = x.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    x64 = torch.where(m, x64, zero)  # garbage (inf/NaN) in padding must not reach the sums
    moments = torch.stack([m.sum().to(torch.float64), x64.sum(), x64.square().sum()])
    if reduce_sum is not None:
        moments = reduce_sum(moments)
    n, s1, s2 = moments.unbind()
    mean = s1 / n.clamp(min=1)
    var = ((s2 - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    out_dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return torch.where(m, (x64 - mean) / (var.sqrt() + _STD_EPS), zero).to(out_dtype)


def discounted_returns(token_r: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t+1} along the last axis."""
    returns = torch.zeros_like(token_r)
    running = torch.zeros_like(token_r[:, 0])
    for t in reversed(range(token_r.shape[1])):  # loop over time, not over samples
        running = token_r[:, t] + gamma * running
        returns[:, t] = running
    return returns


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    reduce_sum: ReduceSum | None = None,
) -> torch.Tensor:
    """REINFORCE++ token advantages `[B, T]` (J. Hu, arXiv 2501.03262).

    Token reward = -kl_coef * kl_t at every response token, plus the sequence
    reward at its last response token; advantage = discounted return-to-go,
    normalized by the mean/std (unbiased) over all response tokens of the whole
    batch. Global rather than per-group normalization is the paper's point: it
    avoids the per-prompt bias of GRPO-style baselines. Padded positions are 0.
    """
    returns = discounted_returns(token_rewards(rewards, mask, kl=kl, kl_coef=kl_coef), gamma)
    return masked_whiten(returns, mask, reduce_sum=reduce_sum)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al., arXiv 2310.10505): the greedy response's reward for the
    same prompt is the baseline; `greedy_rewards` is already expanded to `[B]`."""
    return _float(rewards) - _float(greedy_rewards)


def process_advantages(step_rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """GRPO with process supervision (DeepSeekMath, arXiv 2402.03300, section 4.1.3):
    token advantages `[B, T]`. `step_rewards` `[B, T]` holds the reward of each step at
    the position of the step's last token, NaN elsewhere. Each step reward is
    normalized within its prompt group over all the group's steps, (r - mean) /
    (std + 1e-6) with the unbiased std, as `group_advantages` does for sequence rewards,
    and a token's advantage is the sum of the normalized rewards of the steps that end
    at or after it. With one step per response, at its last token, this is GRPO.
    Positions outside `mask` are 0."""
    is_step = ~torch.isnan(step_rewards)
    r = torch.where(is_step, _float(step_rewards), 0.0)
    _, gid = torch.unique(group, return_inverse=True)
    groups = int(gid.max()) + 1 if gid.numel() else 0

    def per_group(x: torch.Tensor) -> torch.Tensor:  # [B, T] summed within each group -> [B, 1]
        return torch.zeros(groups, dtype=r.dtype, device=r.device).index_add(0, gid, x.sum(-1))[gid, None]

    n = per_group(is_step.to(r.dtype))
    mean = per_group(r) / n.clamp(min=1)
    centered = torch.where(is_step, r - mean, 0.0)
    std = (per_group(centered.square()) / (n - 1).clamp(min=1)).sqrt()
    normalized = centered / (std + _STD_EPS)
    to_go = normalized.flip(-1).cumsum(-1).flip(-1)  # sum over the steps ending at or after each position
    return torch.where(mask.bool(), to_go, 0.0)


# ---------------------------------------------------------------- the registry


@dataclass
class AdvantageInputs:
    """A rank's batch (whole groups); token tensors are `[B, T]`, per-response ones `[B]`."""

    rewards: torch.Tensor  # task reward of each response
    mask: torch.Tensor  # response tokens
    group: torch.Tensor  # prompt group ids
    baselines: torch.Tensor  # reward of the prompt's greedy response (remax), NaN otherwise
    config: GroupAdvantage | ReMaxAdvantage | ReinforcePPAdvantage | GAEAdvantage  # train.advantage
    kl_coef: float  # train.kl.coef, for a KL penalty in the reward
    # With train.kl.mode=reward: KL(behavior || reference) per response token, 0 elsewhere.
    kl: torch.Tensor | None = None
    values: torch.Tensor | None = None  # the critic's values (gae)
    reduce_sum: ReduceSum | None = None  # sums over the learner ranks, for whitening over the global batch
    step_rewards: torch.Tensor | None = None  # [B, T] each step's reward at its last token, NaN elsewhere

    def sequence_rewards(self) -> torch.Tensor:
        """Rewards less the KL penalty summed over each response: what the sequence-level
        estimators, and OPMD, see."""
        if self.kl is None:
            return self.rewards
        return self.rewards - self.kl_coef * self.kl.sum(dim=-1)


@dataclass
class Advantages:
    advantages: torch.Tensor  # [B] or [B, T]
    returns: torch.Tensor | None = None  # [B, T] the critic's regression targets (gae)


AdvantageEstimator = Callable[[AdvantageInputs], Advantages]


def _group_relative(method: str) -> AdvantageEstimator:
    def estimate(x: AdvantageInputs) -> Advantages:
        return Advantages(group_advantages(x.sequence_rewards(), x.group, method=method))

    return estimate


def _remax(x: AdvantageInputs) -> Advantages:
    return Advantages(remax_advantages(x.sequence_rewards(), x.baselines))


def _reinforce_pp(x: AdvantageInputs) -> Advantages:
    return Advantages(reinforce_pp_advantages(x.rewards, x.mask, kl=x.kl, kl_coef=x.kl_coef, gamma=x.config.gamma,
                                              reduce_sum=x.reduce_sum))


def _gae(x: AdvantageInputs) -> Advantages:
    """GAE on the critic's values (gae.py), whitened over the global batch like REINFORCE++."""
    token_r = token_rewards(x.rewards, x.mask, kl=x.kl, kl_coef=x.kl_coef)
    adv, returns = gae_advantages(token_r, x.values, x.mask, gamma=x.config.gamma, lam=x.config.lam)
    return Advantages(masked_whiten(adv, x.mask, reduce_sum=x.reduce_sum), returns)


def _grpo_process(x: AdvantageInputs) -> Advantages:
    """Process rewards (each response's reward as its one step when none are given); a
    KL penalty in the reward (kl.mode=reward) is charged to each response's last step,
    as the sequence-level estimators charge it to the sequence."""
    steps = x.step_rewards
    if steps is None:  # one step per response: its reward at its last token
        m = x.mask.bool()
        last = m & (m.cumsum(-1) == m.sum(-1, keepdim=True))
        steps = torch.where(last, _float(x.rewards)[:, None], float("nan"))
    if x.kl is not None:
        is_step = ~steps.isnan()
        last = is_step & (is_step.cumsum(-1) == is_step.sum(-1, keepdim=True))
        steps = torch.where(last, steps - x.kl_coef * x.kl.sum(-1, keepdim=True), steps)
    return Advantages(process_advantages(steps, x.mask, x.group))


ADVANTAGES: dict[str, AdvantageEstimator] = {
    **{method: _group_relative(method) for method in GROUP_METHODS},
    "grpo_process": _grpo_process,
    "reinforce_pp": _reinforce_pp,
    "remax": _remax,
    "gae": _gae,
}
