"""An actor's side of multi-turn episodes: the environment, its guard and the turn
format, made once per actor; a work grant's episodes as
ExperienceGroups, an evaluation chunk's as scores."""
from __future__ import annotations

import time

import numpy as np

from async_rl.staleness import group_version
from async_rl.user_code import REASONS
from async_rl.wire import ExperienceGroup
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.environments.guard import EnvironmentGuard
from async_rl.actor.environments.registry import environment_factory
from async_rl.actor.rollout.episodes import EpisodeLimits, Sampling, run_episodes
from async_rl.actor.rollout.turns import TurnFormat


def reward_errors(episodes: list[Episode]) -> list[int]:
    """Failed environment calls per reason (REASONS order) among `episodes`."""
    return [sum(ep.failure == reason for ep in episodes) for reason in REASONS]


class EpisodeRunner:
    def __init__(self, cfg, task, prompt_format, logger=None) -> None:
        e = cfg.env
        factory = environment_factory(e.name, task, e.options, e.max_turns)
        self.guard = EnvironmentGuard(factory, fallback=cfg.reward.fallback, name=e.name,
                                      **({"logger": logger} if logger is not None else {}))
        self.prompt_format, self.turns = prompt_format, TurnFormat(prompt_format)
        self.limits = EpisodeLimits(e.max_turns, e.max_tokens, e.turn_tokens or cfg.actors.max_new_tokens, e.timeout_s)

    def episodes(self, engine, prompts, group_size: int, sampling: Sampling, generator) -> list[list[Episode]]:
        return run_episodes(engine, self.prompt_format, self.turns, self.guard, prompts, group_size, self.limits,
                            sampling, generator)

    def experience(self, engine, prompts, grant, actor_id: int, group_size: int, sampling: Sampling,
                   generator) -> list[ExperienceGroup]:
        """One ExperienceGroup per granted prompt, its G episodes as responses."""
        started = time.monotonic()
        groups = self.episodes(engine, prompts, group_size, sampling, generator)
        gen_seconds = (time.monotonic() - started) / max(1, len(prompts))
        out = []
        for k, episodes in enumerate(groups):
            responses = [ep.response() for ep in episodes]
            mask = np.concatenate([r.policy_mask for r in responses])
            out.append(ExperienceGroup.from_responses(
                responses, actor_id=actor_id, group=grant.groups[k], prompt_id=grant.prompt_ids[k],
                version=group_version(np.concatenate([r.versions for r in responses]), default=engine.version,
                                      policy_mask=mask),
                prompt_tokens=np.asarray(episodes[0].prompt_tokens, dtype=np.int32),
                rewards=np.array([ep.reward for ep in episodes], dtype=np.float32),
                truncated=np.array([ep.truncated for ep in episodes], dtype=np.uint8), gen_seconds=gen_seconds,
                reward_errors=reward_errors(episodes)))
        return out

    def scores(self, engine, prompts, samples: int, sampling: Sampling, generator
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """(rewards, response lengths, truncated) [len(prompts), samples] of held-out
        episodes, as evaluation.score_prompts gives for single responses, and the
        environment's failures."""
        groups = self.episodes(engine, prompts, samples, sampling, generator)
        rewards = np.array([[ep.reward for ep in g] for g in groups], dtype=np.float32)
        lengths = np.array([[len(ep.tokens) for ep in g] for g in groups], dtype=np.int32)
        truncated = np.array([[ep.truncated for ep in g] for g in groups], dtype=np.uint8)
        return rewards, lengths, truncated, reward_errors([ep for g in groups for ep in g])
