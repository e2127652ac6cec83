"""What the learner's rank 0 knows of a step's batch, besides its tensors.

The figures about the step's data under their metric names (docs/observability.md),
and what the learner needs besides: sample and token counts for its throughput, the
reward failures for its stop rule, TensorBoard's histograms and texts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from async_rl.config import Config
from async_rl.coordinator.replay_buffer import Taken
from async_rl.learner.batching import unscorable
from async_rl.learner.health import RunHealth
from async_rl.run.metrics import batch_histograms, generations_table, version_mix
from async_rl.run.samples import sample_records
from async_rl.wire.messages import FAILURE_REASONS, zero_counts


@dataclass
class StepData:
    metrics: dict[str, float]
    samples: int
    gen_tokens: float
    waited: float  # seconds the learner waited for the batch
    errors: StepErrors  # the user-code calls that failed
    histograms: dict[str, Any]
    texts: dict[str, str] | None
    dumped: list[dict[str, Any]] | None = None  # whole samples for RUN/samples.jsonl (run/samples.py)


def measure_step(cfg: Config, taken: Taken, learner_version: int, waited: float, prompt_format,
                 health: RunHealth) -> StepData:
    """The StepData of the batch `taken` by the learner at `learner_version` (before the
    step); `health` is fed the batch, and warns when a run has nothing to learn from."""
    groups = taken.groups
    staleness = [learner_version - v for v in taken.versions]
    lengths = np.concatenate([g.response_lengths for g in groups])
    truncated = np.concatenate([g.truncated for g in groups])
    gen_seconds = sum(g.gen_seconds for g in groups)
    rewards = np.concatenate([g.rewards for g in groups])
    left_out = [unscorable(g) for g in groups]
    scored = ~np.concatenate(left_out)
    errors = step_errors(groups)
    health.check(rewards, lengths, truncated, cfg.train.group_size)
    metrics = {
        # Over the samples trained on: an unscorable sample's reward is no reward.
        "train/reward_mean": float(rewards[scored if scored.any() else slice(None)].mean()),
        "reward/unscorable_frac": float(1.0 - scored.mean()),
        "reward/groups_dropped": sum(bool(flags.all()) for flags in left_out),
        "train/response_len_mean": float(lengths.mean()),
        "train/response_len_max": float(lengths.max()), "train/truncated_frac": float(truncated.mean()),
        "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
        # The step's staleness histogram, in samples.
        **{f"staleness/count_{k}": staleness.count(k) * cfg.train.group_size for k in sorted(set(staleness))},
        # What a capacity model needs: the actors' generation time per group, and
        # their speed while generating.
        "actors/gen_seconds_per_group": gen_seconds / len(groups),
        "actors/gen_tokens_per_s": float(lengths.sum()) / max(gen_seconds, 1e-9),
        **version_mix(groups, learner_version),  # in-flight updates: actors/mixed_version_frac, ...
        "reward/error_frac": errors.frac,
        **component_metrics(cfg.reward.components, groups)}
    watched = {c.name: metrics[f"reward/{c.name}/mean"] for c in cfg.reward.components
               if c.weight == 0.0 and f"reward/{c.name}/mean" in metrics}
    if watched:
        health.check_hacking(learner_version + 1, metrics["train/reward_mean"], watched)
    if any(len(g.policy_mask) for g in groups):  # multi-turn episodes
        turns = policy_turns(groups)
        metrics.update({"env/turns_mean": float(turns.mean()), "env/turns_max": float(turns.max()),
                        "env/multi_turn_frac": float((turns > 1).mean()),
                        "env/policy_token_frac": float(np.concatenate([g.policy_mask for g in groups]).mean()),
                        "env/observations_cut": sum(g.observations_cut for g in groups)})
        health.check_observations(learner_version + 1, metrics["env/observations_cut"], cfg.env.name,
                                  cfg.env.max_tokens)
    stepped = [g for g in groups if len(g.step_ends) and not len(g.policy_mask)]
    if stepped:  # a reward that scores step by step (a process reward)
        metrics["reward/steps_mean"] = sum(len(g.step_ends) for g in stepped) / sum(len(g.rewards) for g in stepped)
        health.check_steps(learner_version + 1, cfg.train.advantage.name)
    texts = dumped = None
    if cfg.metrics.text_every and (learner_version + 1) % cfg.metrics.text_every == 0:
        texts = {"samples/generations": generations_table(groups, prompt_format)}
    if cfg.metrics.samples_every and (learner_version + 1) % cfg.metrics.samples_every == 0:
        dumped = sample_records(groups, prompt_format, learner_version + 1, cfg.metrics.samples_per_dump)
    return StepData(metrics, samples=len(lengths), gen_tokens=float(lengths.sum()), waited=waited,
                    errors=errors, histograms=batch_histograms(groups, staleness), texts=texts, dumped=dumped)


def component_metrics(components, groups) -> dict[str, float]:
    """Per reward.components entry, over the step's samples: its mean, its correlation
    with response length (a learned reward that pays for length is being gamed) and
    latency p50/p95 (where it scored), the share of failed calls and their count per
    reason, and the share of samples it left unscorable (its failures, when it carries
    weight)."""
    carried = [g for g in groups if g.components.shape[1:] == (len(components),)]
    if not components or not carried:
        return {}
    values, ms = np.concatenate([g.components for g in carried]), np.concatenate([g.component_ms for g in carried])
    codes = np.concatenate([g.component_failures for g in carried])
    lengths = np.concatenate([g.response_lengths for g in carried]).astype(np.float64)
    out: dict[str, float] = {}
    for i, component in enumerate(components):
        key, failed = f"reward/{component.name}", codes[:, i] > 0
        timed = ms[~failed, i]
        if (~failed).any():
            out[f"{key}/mean"] = float(values[~failed, i].mean())
        scored_values, scored_lengths = values[~failed, i].astype(np.float64), lengths[~failed]
        if scored_values.size > 2 and scored_values.std() > 0 and scored_lengths.std() > 0:
            out[f"{key}/length_corr"] = float(np.corrcoef(scored_values, scored_lengths)[0, 1])
        if timed.size:
            p50, p95 = np.percentile(timed, [50, 95])
            out[f"{key}/latency_p50_ms"], out[f"{key}/latency_p95_ms"] = float(p50), float(p95)
        out[f"{key}/error_frac"] = float(failed.mean())
        out[f"{key}/unscorable_frac"] = float(failed.mean()) if component.weight != 0.0 else 0.0
        for code in np.unique(codes[failed, i]):
            out[f"{key}/errors_{FAILURE_REASONS[int(code) - 1]}"] = int((codes[:, i] == code).sum())
    return out


def policy_turns(groups) -> np.ndarray:
    """Policy turns of each response: the runs of policy tokens in its mask (a response
    without a mask is one turn)."""
    out = []
    for g in groups:
        for r in g.responses():
            m = r.policy_mask
            out.append(1 if m is None else int(m[:1].sum() + ((m[1:] == 1) & (m[:-1] == 0)).sum()))
    return np.array(out)


@dataclass
class StepErrors:
    """A step's failed user-code calls: per reason (FAILURE_REASONS order) in the task's
    reward and in the environment, the fraction of scored responses that got the
    fallback for either, and the first failure's note ("environment raised ...")."""
    reward: list[int]
    env: list[int]
    frac: float
    first: str

    def in_environment(self) -> bool:
        """Whether the environment, rather than the reward, failed most."""
        return sum(self.env) > sum(self.reward)


def step_errors(groups) -> StepErrors:
    """The StepErrors of a step's ExperienceGroups; a ReMax baseline counts as one more
    scored response."""
    def total(field: str) -> list[int]:
        return [sum(col) for col in zip(*(getattr(g, field) for g in groups))] if groups else zero_counts()

    reward, env = total("reward_errors"), total("env_errors")
    scored = sum(len(g.rewards) + (g.greedy_reward is not None) for g in groups)
    first = next((g.first_failure for g in groups if g.first_failure), "")
    return StepErrors(reward, env, (sum(reward) + sum(env)) / max(scored, 1), first)


def describe(counts) -> str:
    """`raised 3, timeout 0, ...`: counts in FAILURE_REASONS order, for a log line."""
    return ", ".join(f"{reason} {n}" for reason, n in zip(FAILURE_REASONS, counts))
