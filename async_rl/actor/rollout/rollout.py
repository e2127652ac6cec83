"""What an actor makes of its grants, one way for training and evaluation alike.

Every response is an episode (episodes.py): a single-turn one is one policy turn scored
by the task's reward; a multi-turn one (env.name) plays against an environment, which
gives the rewards. `experience` turns a work grant into one ExperienceGroup per prompt
(the training-sample format) in two halves, `generate` and `finish` (scoring, which the
actor runs in its scorer thread: actor/scoring.py), `scores` an evaluation grant's
held-out prompts into their rewards. All user code (the reward, the environment) runs guarded (actor/guard.py, or
the reward's worker processes, rewards/pool.py): a failure scores reward.fallback, is
counted in the message's `reward_errors` or `env_errors`, whichever code failed, and
with reward.on_failure=exclude marks its sample `unscorable` (the learner leaves it out).

ReMax's baseline is part of the same path: one greedy episode per prompt with the same
weights, scored like the samples, its reward the group's `greedy_reward`; with an
environment the greedy episode plays against one too.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from async_rl.actor.guard import Call, Calls, Guard
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.rollout.episodes import Environments, Limits, Sampling, run_episodes
from async_rl.actor.rollout.turns import TurnFormat
from async_rl.config import Config
from async_rl.reward_server.config import with_server_endpoints
from async_rl.rewards.components import Components, ComponentScores, components_from_config
from async_rl.rewards.outcome import Failed, StepRewards, as_outcome, failure_note
from async_rl.rewards.pool import Call as RewardCall
from async_rl.rewards.pool import RewardPool
from async_rl.run.tracing import SpanRecorder
from async_rl.staleness import group_version
from async_rl.tasks import PromptIndex
from async_rl.tasks.base import Prompt, Task
from async_rl.wire import ExperienceGroup, WorkGrant
from async_rl.wire.messages import FAILURE_REASONS

log = logging.getLogger("async_rl.actor")


def failures(episodes: list[Episode]) -> dict:
    """The wire's failure fields of `episodes`: failed reward and environment calls per
    reason (FAILURE_REASONS order), and how the first failure happened."""
    def counts(failed_in: str) -> list[int]:
        return [sum(ep.failure == reason and ep.failed_in == failed_in for ep in episodes)
                for reason in FAILURE_REASONS]

    first = next((ep for ep in episodes if ep.failure is not None), None)
    return {"reward_errors": counts("reward"), "env_errors": counts("environment"),
            "first_failure": f"{first.failed_in} {first.failure_note}" if first is not None else ""}


def component_fields(episodes: list[Episode]) -> dict:
    """The wire's per-component fields of a group's samples ([G, C]); none without components."""
    parts = [ep.components for ep in episodes]
    if any(p is None for p in parts) or not parts:
        return {}
    return {"components": np.array([p.values for p in parts], dtype=np.float32),
            "component_ms": np.array([p.ms for p in parts], dtype=np.float32),
            "component_failures": np.array([p.codes for p in parts], dtype=np.uint8)}


@dataclass
class Scores:
    """A chunk of held-out prompts, `k` samples each: [prompts, k] arrays, and the wire's
    failure fields (`failures`)."""
    rewards: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    failures: dict

    @classmethod
    def of(cls, groups: list[list[Episode]]) -> Scores:
        """The scores of scored episodes, groups[i] the samples of prompt i."""
        return cls(np.array([[ep.reward for ep in g] for g in groups], dtype=np.float32),
                   np.array([[len(ep.tokens) for ep in g] for g in groups], dtype=np.int32),
                   np.array([[ep.truncated for ep in g] for g in groups], dtype=np.uint8),
                   failures([ep for g in groups for ep in g]))


@dataclass
class Generated:
    """A work grant's episodes, generated with weights `version`, not yet scored."""
    grant: WorkGrant
    actor_id: int
    version: int
    prompts: list[Prompt]
    groups: list[list[Episode]]
    baselines: list[list[Episode]] | None
    seconds: float


class Rollout:
    def __init__(self, *, engine, prompt_format, task: Task, group_size: int, sampling: Sampling, limits: Limits,
                 eval_sampling: Sampling, eval_limits: Limits, eval_samples: int, reward: Guard,
                 environments: Environments | None = None, baseline: bool = False,
                 generator: torch.Generator | None = None, reward_pool: RewardPool | None = None,
                 exclude_failures: bool = False, components: Components | None = None) -> None:
        """`components`: reward.components, when set (the reward's values come per component)."""
        self.engine, self.prompt_format, self.task = engine, prompt_format, task
        self.prompts = PromptIndex(task)
        self.group_size, self.sampling, self.limits = group_size, sampling, limits
        self.eval_sampling, self.eval_limits, self.eval_samples = eval_sampling, eval_limits, eval_samples
        self.reward, self.environments, self.baseline, self.generator = reward, environments, baseline, generator
        self.reward_pool, self.exclude_failures, self.components = reward_pool, exclude_failures, components
        self._scoring = threading.Lock()  # one batch at a time through the reward's workers

    def close(self) -> None:
        """Stop the reward's worker processes, if it has any."""
        if self.reward_pool is not None:
            self.reward_pool.close()

    @classmethod
    def from_config(cls, cfg: Config, engine, prompt_format, task: Task, generator: torch.Generator | None = None,
                    logger: logging.Logger = log) -> Rollout:
        """The rollout a run's config describes (actors, env, eval, reward, train sections)."""
        a, e = cfg.actors, cfg.eval
        excluded = cfg.reward.on_failure == "exclude"
        reward = Guard(getattr(cfg.task, "reward", None) or f"{type(task).__name__}.reward",
                       timeout_s=cfg.reward.timeout_s, fallback=cfg.reward.fallback, logger=logger, excluded=excluded)
        eval_tokens = e.max_new_tokens or a.max_new_tokens
        limits, eval_limits = Limits(1, a.max_new_tokens, a.max_new_tokens), Limits(1, eval_tokens, eval_tokens)
        environments = None
        if cfg.env is not None:
            from async_rl.actor.environments.registry import environment_factory

            env = cfg.env
            guard = Guard(env.name, timeout_s=env.timeout_s, fallback=cfg.reward.fallback, kind="environment",
                          logger=logging.getLogger("async_rl.env"), excluded=excluded)
            environments = Environments(environment_factory(env.name, task, env.options, env.max_turns), guard,
                                        TurnFormat(prompt_format))
            limits = eval_limits = Limits(env.max_turns, env.max_tokens, env.turn_tokens or a.max_new_tokens)
        pool = components = None
        parts = with_server_endpoints([c.model_dump() for c in cfg.reward.components], cfg.reward_server)
        served = next((c["server_endpoint"] for c in parts if c.get("server_endpoint")), None)
        if served and environments is None:  # it may still be loading its models: no sample scored before it serves
            from async_rl.reward_server.client import wait_until_serving

            wait_until_serving(served, cfg.reward_server.start_timeout_s)
        if environments is None and cfg.reward.executor == "process":
            pool = RewardPool(cfg.task.model_dump(mode="json"), cfg.seed, processes=cfg.reward.workers,
                              timeout_s=cfg.reward.timeout_s, components=parts)
            pool.start()
        if parts and environments is None:  # in the actor too: their names, weights, a whole call's failure
            components = components_from_config(parts, task.reward, cfg.reward.timeout_s, load=pool is None)
        return cls(engine=engine, prompt_format=prompt_format, task=task, group_size=cfg.train.group_size,
                   sampling=Sampling(a.temperature, a.top_p), limits=limits,
                   eval_sampling=Sampling(e.temperature or 1.0, greedy=e.temperature == 0.0), eval_limits=eval_limits,
                   eval_samples=e.pass_k, reward=reward, environments=environments,
                   baseline=cfg.train.advantage.name == "remax", generator=generator, reward_pool=pool,
                   exclude_failures=cfg.reward.on_failure == "exclude", components=components)

    def experience(self, grant: WorkGrant, actor_id: int, spans: SpanRecorder | None = None) -> list[ExperienceGroup]:
        """One ExperienceGroup per granted prompt, its `group_size` episodes as responses;
        `spans` gets the generate and score spans."""
        return self.finish(self.generate(grant, actor_id, spans), spans)

    def generate(self, grant: WorkGrant, actor_id: int, spans: SpanRecorder | None = None) -> Generated:
        """The granted prompts' episodes, not yet scored (`finish` scores them)."""
        spans = spans if spans is not None else SpanRecorder(enabled=False)
        prompts = [self.prompts[i] for i in grant.prompt_ids]
        with spans.span("generate", groups=len(prompts)) as span_args:
            groups, seconds = self._episodes(prompts, self.group_size, self.sampling, self.limits)
            baselines = None
            if self.baseline:  # ReMax: one greedy episode per prompt, the same weights
                baselines, _ = self._episodes(prompts, 1, Sampling(1.0, greedy=True), self.limits)
            span_args["tokens"] = sum(len(ep.tokens) for group in groups for ep in group)
        return Generated(grant, actor_id, self.engine.version, prompts, groups, baselines, seconds)

    def finish(self, generated: Generated, spans: SpanRecorder | None = None) -> list[ExperienceGroup]:
        """Score `generated`'s episodes; one ExperienceGroup per prompt. Safe to call from
        another thread than `generate`'s (the actor scores off its generation path)."""
        spans = spans if spans is not None else SpanRecorder(enabled=False)
        g = generated
        with spans.span("score", groups=len(g.prompts)):
            self._score(g.prompts + (g.prompts if g.baselines else []), g.groups + (g.baselines or []))
        out = []
        for k, episodes in enumerate(g.groups):
            responses = [ep.response() for ep in episodes]
            masks = [r.policy_mask for r in responses if r.policy_mask is not None]
            greedy = None if g.baselines is None else g.baselines[k][0]
            scored = episodes + ([greedy] if greedy is not None else [])
            out.append(ExperienceGroup.from_responses(
                responses, actor_id=g.actor_id, group=g.grant.groups[k], prompt_id=g.grant.prompt_ids[k],
                version=group_version(np.concatenate([r.versions for r in responses]), default=g.version,
                                      policy_mask=np.concatenate(masks) if masks else None),
                prompt_tokens=np.asarray(episodes[0].prompt_tokens, dtype=np.int32),
                rewards=np.array([ep.reward for ep in episodes], dtype=np.float32),
                truncated=np.array([ep.truncated for ep in episodes], dtype=np.uint8),
                gen_seconds=g.seconds / max(1, len(g.prompts)), greedy_reward=None if greedy is None else greedy.reward,
                observations_cut=sum(ep.observation_cut for ep in scored),
                unscorable=self._unscorable(episodes, greedy), **failures(scored), **component_fields(episodes)))
        return out

    def _unscorable(self, episodes: list[Episode], greedy: Episode | None) -> np.ndarray:
        """The wire's `unscorable` flags: the samples whose reward or environment failed,
        with reward.on_failure=exclude; all of them when ReMax's baseline failed (no
        baseline, no advantage)."""
        failed = [ep.failure is not None for ep in episodes]
        if not self.exclude_failures or not any(failed) and (greedy is None or greedy.failure is None):
            return np.zeros(0, dtype=np.uint8)
        if greedy is not None and greedy.failure is not None:
            failed = [True] * len(episodes)
        return np.array(failed, dtype=np.uint8)

    def scores(self, prompt_ids: list[int]) -> Scores:
        """The held-out prompts' scores, eval.pass_k samples each (greedy unless eval.temperature > 0)."""
        return Scores.of(self.evaluation(prompt_ids))

    def evaluation(self, prompt_ids: list[int]) -> list[list[Episode]]:
        """The held-out prompts' episodes, scored: result[i] the samples of prompt i."""
        prompts = [self.prompts[i] for i in prompt_ids]
        groups, _ = self._episodes(prompts, self.eval_samples, self.eval_sampling, self.eval_limits)
        self._score(prompts, groups, task_only=True)
        return groups

    def _episodes(self, prompts: list[Prompt], n: int, sampling: Sampling, limits: Limits):
        return run_episodes(self.engine, self.prompt_format, prompts, n, limits, sampling, self.generator,
                            self.environments)

    def _score(self, prompts: list[Prompt], groups: list[list[Episode]], task_only: bool = False) -> None:
        """Single-turn episodes' rewards (groups[i]: prompt i's): the task's reward (or
        reward.components, unless `task_only`: an evaluation scores the task's own reward,
        so that a learned reward's gains are checked, not repeated) on each response,
        guarded: in the reward's worker processes, or one after the other in one worker
        thread. (An environment scores its own episodes.)"""
        if self.environments is not None:
            return
        with self._scoring:
            self._score_locked(prompts, groups, task_only or self.components is None)

    def _score_locked(self, prompts: list[Prompt], groups: list[list[Episode]], task_only: bool) -> None:
        if not task_only and self.components.grouped:
            self._score_groups(prompts, groups)
            return
        pairs = [(p, ep) for p, group in zip(prompts, groups, strict=True) for ep in group]
        texts = [self.prompt_format.response_text(ep.tokens) for _, ep in pairs]
        if self.reward_pool is not None:
            outcomes = dict(enumerate(self.reward_pool.score(
                [RewardCall(p.text, text, p.answer, p.fields, task_only) for (p, _), text in zip(pairs, texts)])))
        else:
            reward, check = (self.task.reward, as_outcome) if task_only else (self.components, None)
            calls = Calls()
            calls.submit([Call(i, self.reward, functools.partial(reward, **p.fields), (p.text, text, p.answer), check)
                          for i, ((p, _), text) in enumerate(zip(pairs, texts))])
            outcomes = calls.wait_all()
        for i, outcome in outcomes.items():
            self._settle(pairs[i][1], outcome, task_only)

    def _score_groups(self, prompts: list[Prompt], groups: list[list[Episode]]) -> None:
        """With a group-scope component, one call per prompt scores its whole group."""
        texts = [[self.prompt_format.response_text(ep.tokens) for ep in group] for group in groups]
        if self.reward_pool is not None:
            outcomes = dict(enumerate(self.reward_pool.score(
                [RewardCall(p.text, t, p.answer, p.fields) for p, t in zip(prompts, texts)])))
        else:
            calls = Calls()
            calls.submit([Call(k, self.reward, functools.partial(self.components.score_group, **p.fields),
                               (p.text, t, p.answer)) for k, (p, t) in enumerate(zip(prompts, texts))])
            outcomes = calls.wait_all()
        for k, outcome in outcomes.items():
            if not isinstance(outcome, Failed) and (not isinstance(outcome, list) or len(outcome) != len(groups[k])):
                outcome = Failed("raised", f"answered {type(outcome).__name__} for a group of {len(groups[k])}")
            for j, ep in enumerate(groups[k]):
                self._settle(ep, outcome if isinstance(outcome, Failed) else outcome[j])

    def _settle(self, ep: Episode, outcome, task_only: bool = False) -> None:
        """Score `ep` with its reward's `outcome` (the task's alone with `task_only`), or fail it."""
        if self.components is not None and not task_only:
            ep.components = outcome if isinstance(outcome, ComponentScores) else self.components.failed_whole(outcome)
            outcome = ep.components.settle()
        if isinstance(outcome, Failed):
            ep.fail(self.reward.failed(outcome), outcome.reason, "reward", failure_note(outcome))
        elif isinstance(outcome, StepRewards) and ep.tokens:
            ends = self.prompt_format.token_ends(ep.tokens, [end for end, _ in outcome.steps])
            ep.score(outcome.value, ends, [reward for _, reward in outcome.steps])
        else:
            ep.score(outcome.value if isinstance(outcome, StepRewards) else outcome)
