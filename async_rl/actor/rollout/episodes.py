"""Many episodes in flight on one engine: the next turn of every episode waiting on the
policy is generated in one batch, while environments answer in worker threads.

    episodes ready for the policy  ->  one engine.generate over all of them
    each turn's text               ->  env.step in a worker thread (guard.py)
    answers as they arrive         ->  tokens appended (turns.py); the episode is ready again

An episode whose environment is slow never holds the engine: the loop generates for
whichever episodes are ready and collects answers as they come, and waits only when no
episode is ready. Each environment call runs in a daemon thread of its own (an episode
has at most one call pending). One that runs past `timeout_s` fails its episode
(counted as `timeout`); Python cannot stop the thread, which finishes on its own, and
being a daemon it never keeps the actor from exiting.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass

import torch

from async_rl.tasks.base import Prompt
from async_rl.actor.rollout.episode import Episode
from async_rl.actor.environments.guard import EnvironmentFailed, EnvironmentGuard
from async_rl.actor.rollout.turns import TurnFormat


GATHER_S = 0.02


@dataclass
class EpisodeLimits:
    max_turns: int  # policy turns per episode
    max_tokens: int  # the episode's response: policy and environment tokens
    turn_tokens: int  # new tokens per policy turn
    timeout_s: float  # per environment call


@dataclass
class Sampling:
    temperature: float
    top_p: float = 1.0
    greedy: bool = False


def call_in_thread(fn, *args) -> cf.Future:
    """`fn(*args)` in a new daemon thread; its Future."""
    future: cf.Future = cf.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # handed to whoever reads the result
            future.set_exception(err)

    threading.Thread(target=run, name="env-call", daemon=True).start()
    return future


def run_episodes(engine, prompt_format, turn_format: TurnFormat, guard: EnvironmentGuard, prompts: list[Prompt],
                 group_size: int, limits: EpisodeLimits, sampling: Sampling,
                 generator: torch.Generator | None = None) -> list[list[Episode]]:
    """`group_size` episodes per prompt, run to their ends; result[i][j]: prompt i's
    episode j. Each Episode's `failure` names the reason its environment failed, if it did."""
    groups = [[Episode(prompt_format.encode(p), limits.max_turns, limits.max_tokens) for _ in range(group_size)]
              for p in prompts]
    calls = _Calls(guard, limits.timeout_s)
    for p, episodes in zip(prompts, groups):
        for ep in episodes:
            calls.start(ep, p)
    stops = set(engine.eos_token_ids)
    while calls.pending:
        for ep, turn in calls.answers():
            last = ep.tokens[-1] if ep.tokens else None
            ep.add_environment_turn(turn, turn_format.tokens(turn.messages, last if last in stops else None)
                                    if not turn.done else [])
            if not ep.done:
                calls.ready.append(ep)
        if calls.ready:
            ready, calls.ready = calls.ready, []
            _policy_turns(engine, prompt_format, calls, ready, limits, sampling, generator)
    calls.close_all()
    return groups


def _policy_turns(engine, prompt_format, calls: "_Calls", ready: list[Episode], limits: EpisodeLimits,
                  sampling: Sampling, generator) -> None:
    """One batched turn for every ready episode; each turn's text goes to its environment."""
    budget = max(ep.budget() for ep in ready)
    completions = engine.generate([ep.prefix() for ep in ready], n=1, max_new_tokens=min(limits.turn_tokens, budget),
                                  temperature=sampling.temperature, top_p=sampling.top_p, greedy=sampling.greedy,
                                  generator=generator)
    for ep, [c] in zip(ready, completions):
        if len(c) > ep.budget():  # the batch ran longer than this episode may: cut at its budget
            n = ep.budget()
            c = type(c)(c.tokens[:n], c.logprobs[:n], c.versions[:n], False)
        ep.add_policy_turn(c)
        if not ep.done:
            calls.step(ep, prompt_format.response_text(c.tokens.tolist()))


class _Calls:
    """The environment calls in flight, one per episode at most: starting an episode's
    environment (its factory) or answering its last turn."""

    def __init__(self, guard: EnvironmentGuard, timeout_s: float) -> None:
        self.guard, self.timeout_s = guard, timeout_s
        self.pending: dict[cf.Future, tuple[Episode, float, bool]] = {}  # -> (episode, deadline, is_start)
        self.envs: dict[int, object] = {}
        self.ready: list[Episode] = []  # episodes waiting on the policy

    def start(self, ep: Episode, prompt: Prompt) -> None:
        self.pending[call_in_thread(self.guard.start, prompt)] = (ep, time.monotonic() + self.timeout_s, True)

    def step(self, ep: Episode, action: str) -> None:
        future = call_in_thread(self.guard.step, self.envs[id(ep)], action)
        self.pending[future] = (ep, time.monotonic() + self.timeout_s, False)

    def close_all(self) -> None:
        """Every started environment's close(), each in a daemon thread of its own (user
        code: it may hang, and no episode waits on it)."""
        for env in self.envs.values():
            call_in_thread(self.guard.close, env)
        self.envs.clear()

    def answers(self) -> list[tuple[Episode, object]]:
        """(episode, Turn) of each step answered; started environments join `ready` and
        failed episodes end. Waits (until the first answer or deadline) only when no
        episode is ready for the policy."""
        if not self.ready and self.pending:
            deadline = min(d for _, d, _ in self.pending.values())
            cf.wait(list(self.pending), timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED)
            # Answers that come within a moment join the same batch: fast environments all
            # answer together, and one slow one holds the others no longer than this.
            cf.wait(list(self.pending), timeout=GATHER_S, return_when=cf.ALL_COMPLETED)
        out, now = [], time.monotonic()
        for future in [f for f, (_, deadline, _) in self.pending.items() if f.done() or deadline <= now]:
            ep, _, is_start = self.pending.pop(future)
            try:
                if not future.done():
                    raise EnvironmentFailed("timeout", f"ran past env.timeout_s={self.timeout_s:g}s")
                value = future.result()
            except EnvironmentFailed as failure:
                ep.fail(self.guard.failed(failure), failure.reason)
                continue
            if is_start:
                self.envs[id(ep)] = value
                self.ready.append(ep)
            else:
                out.append((ep, value))
        return out
