"""Many episodes in flight on one engine: the next turn of every episode waiting on the
policy is generated in one batch, while environments answer in worker threads.

    episodes ready for the policy  ->  one engine.generate over all of them
    each turn's text               ->  env.step, guarded (actor/guard.py)
    answers as they arrive         ->  tokens appended (turns.py); the episode is ready again

An episode whose environment is slow never holds the engine: the loop generates for
whichever episodes are ready and collects answers as they come, and waits only when no
episode is ready. Each environment call runs in a thread of its own, under env.timeout_s;
one that runs past it fails its episode (counted as `timeout`). Without an environment
(single-turn) every episode is ready at once and ends after its one turn; its reward is
the rollout's to give (rollout.py).

Episodes that share their prefix (a prompt's group at its first turn) are one prompt
sampled k times in the batch: the engine prefills it once and repeats its KV cache.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from async_rl.actor.environments.base import Turn
from async_rl.actor.guard import Call, Calls, Guard
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.rollout.turns import MAX_CHARS_PER_TOKEN, TurnFormat
from async_rl.rewards.outcome import Failed, as_reward, failure_note
from async_rl.tasks.base import Prompt

GATHER_S = 0.02  # answers that come within a moment join the same batch


@dataclass
class Limits:
    max_turns: int  # policy turns per episode
    max_tokens: int  # the episode's response: policy and environment tokens
    turn_tokens: int  # new tokens per policy turn


@dataclass
class Sampling:
    temperature: float
    top_p: float = 1.0
    greedy: bool = False


@dataclass
class Environments:
    """What an `env.name` run's episodes are played against: the factory of an
    environment per episode, the guard its calls run under, the tokens of its turns."""
    factory: Callable[[Prompt], Any]
    guard: Guard
    turns: TurnFormat
    cut_so_far: int = 0

    def answer_tokens(self, ep: Episode, messages: list[dict[str, str]], eos_token_ids) -> list[int]:
        """The tokens of the environment's answer to `ep`'s last turn; none for an answer
        of more than MAX_CHARS_PER_TOKEN characters per token the episode can still take,
        which is not tokenized at all (the cost of a huge answer stays that of counting
        its characters): `ep` is marked `observation_cut` and ends truncated, and the first
        such answer is logged."""
        limit = ep.budget() * MAX_CHARS_PER_TOKEN
        if sum(len(m["content"]) for m in messages) > limit:
            ep.observation_cut = True
            self.cut_so_far += 1
            if self.cut_so_far == 1:
                self.guard.log.warning(
                    "environment %s answered with more than %d characters, past the %d tokens its episode could "
                    "still take: the episode ends truncated, the answer untokenized; further such answers are "
                    "counted (env/observations_cut), not logged", self.guard.name, limit, ep.budget())
            return []
        last = ep.tokens[-1] if ep.tokens else None
        return self.turns.tokens(messages, last if last in eos_token_ids else None)


def checked_turn(value: object) -> Turn:
    """`value` if it is a well-formed Turn; Failed otherwise."""
    if not isinstance(value, Turn):
        raise Failed("not_a_number", f"returned {type(value).__name__}, not a Turn")
    messages = value.messages
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise Failed("not_a_number", f"returned messages {messages!r:.60}, not role/content strings")
    if value.reward is None:
        return value
    return Turn(messages, as_reward(value.reward), bool(value.done))


def has_step(env: object) -> object:
    if not callable(getattr(env, "step", None)):
        raise Failed("not_a_number", f"made {type(env).__name__}, which has no step()")
    return env


def close_quietly(env: object) -> None:
    """The environment's `close()`, when it has one; the episode is already scored."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


def run_episodes(engine, prompt_format, prompts: list[Prompt], n: int, limits: Limits, sampling: Sampling,
                 generator: torch.Generator | None = None, environments: Environments | None = None
                 ) -> tuple[list[list[Episode]], float]:
    """`n` episodes per prompt, run to their ends: (result[i][j], prompt i's episode j;
    the seconds spent generating). Each Episode's `failure` names the reason its
    environment failed, if it did."""
    groups = []
    for p in prompts:
        tokens = prompt_format.encode(p)
        groups.append([Episode(tokens, limits.max_turns, limits.max_tokens, environment=environments is not None)
                       for _ in range(n)])
    episodes = [ep for group in groups for ep in group]
    owners = [p for p, group in zip(prompts, groups) for _ in group]
    calls, envs, ready = Calls(), {}, []
    if environments is None:
        ready = list(range(len(episodes)))
    for i, prompt in enumerate(owners if environments is not None else ()):
        calls.submit([Call(("start", i), environments.guard, environments.factory, (prompt,), has_step)])
    generating = 0.0
    while ready or len(calls):
        if ready:
            started = time.monotonic()
            _policy_turns(engine, [episodes[i] for i in ready], limits, sampling, generator)
            generating += time.monotonic() - started
            for i in ready:
                if not episodes[i].done:  # its turn, as text, to its environment
                    text = prompt_format.response_text(episodes[i].last_turn())
                    calls.submit([Call(("step", i), environments.guard, envs[i].step, (text,), checked_turn)])
            ready = []
        for (kind, i), outcome in calls.answers(block=True, gather_s=GATHER_S):
            ep = episodes[i]
            if isinstance(outcome, Failed):
                ep.fail(environments.guard.failed(outcome), outcome.reason, "environment", failure_note(outcome))
            elif kind == "start":
                envs[i] = outcome
                ready.append(i)
            else:
                tokens = [] if outcome.done else environments.answer_tokens(ep, outcome.messages, engine.eos_token_ids)
                ep.add_environment_turn(outcome, tokens)
                if not ep.done:
                    ready.append(i)
        ready.sort()  # the batch in episode order, whatever order the answers came in
    closing = Calls()  # user code that may hang: nobody waits for it
    for env in envs.values():
        closing.submit([Call("close", environments.guard, close_quietly, (env,))])
    return groups, generating


def _policy_turns(engine, ready: list[Episode], limits: Limits, sampling: Sampling, generator) -> None:
    """One batched turn for every ready episode."""
    budget = max(ep.budget() for ep in ready)
    prefixes = [ep.prefix() for ep in ready]
    shared: dict[tuple[int, ...], list[int]] = {}
    for i, prefix in enumerate(prefixes):
        shared.setdefault(tuple(prefix), []).append(i)
    sizes = {len(members) for members in shared.values()}
    options = dict(max_new_tokens=min(limits.turn_tokens, budget), temperature=sampling.temperature,
                   top_p=sampling.top_p, greedy=sampling.greedy, generator=generator)
    if len(sizes) == 1 and len(shared) < len(ready):  # each prefix k times: k samples of each
        out = engine.generate([prefixes[members[0]] for members in shared.values()], n=sizes.pop(), **options)
        completions = [None] * len(ready)
        for members, samples in zip(shared.values(), out):
            for i, sample in zip(members, samples):
                completions[i] = sample
    else:
        completions = [c for [c] in engine.generate(prefixes, n=1, **options)]
    for ep, c in zip(ready, completions):
        if len(c) > ep.budget():  # the batch ran longer than this episode may: cut at its budget
            k = ep.budget()
            c = type(c)(c.tokens[:k], c.logprobs[:k], c.versions[:k], False)
        ep.add_policy_turn(c)
