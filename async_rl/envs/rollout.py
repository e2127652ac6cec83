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

from ..tasks.base import Prompt
from .episode import Episode
from .guard import EnvironmentFailed, EnvironmentGuard
from .turns import TurnFormat


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
    envs: dict[int, object] = {}
    ready: list[Episode] = []
    for p, episodes in zip(prompts, groups):
        for ep in episodes:
            try:
                envs[id(ep)] = guard.start(p)
                ready.append(ep)
            except EnvironmentFailed as failure:
                _fail(ep, guard, failure)
    pending: dict[cf.Future, tuple[Episode, float]] = {}
    stops = set(getattr(engine, "eos_token_ids", []) or [])
    while ready or pending:
        if ready:
            _policy_turns(engine, prompt_format, guard, envs, ready, limits, sampling, pending, generator)
            ready = []
        ready = _collect(turn_format, guard, pending, stops, limits, wait=not ready)
    return groups


def _policy_turns(engine, prompt_format, guard, envs, ready, limits, sampling, pending, generator) -> None:
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
        if ep.done:
            continue
        action = prompt_format.response_text(c.tokens.tolist())
        pending[call_in_thread(guard.step, envs[id(ep)], action)] = (ep, time.monotonic() + limits.timeout_s)


def _collect(turn_format, guard, pending, stops, limits, wait: bool) -> list[Episode]:
    """The episodes whose environment answered (waiting for the first answer, or the
    first deadline, when `wait`); those past their deadline fail."""
    if wait and pending:
        deadline = min(d for _, d in pending.values())
        cf.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED)
        # Answers that come within a moment join the same batch: fast environments all
        # answer together, and one slow one holds the others no longer than this.
        cf.wait(list(pending), timeout=GATHER_S, return_when=cf.ALL_COMPLETED)
    ready, now = [], time.monotonic()
    for future in [f for f in pending if f.done() or pending[f][1] <= now]:
        ep, _ = pending.pop(future)
        if not future.done():
            _fail(ep, guard, EnvironmentFailed("timeout", f"ran past env.timeout_s={limits.timeout_s:g}s"))
            continue
        try:
            turn = future.result()
        except EnvironmentFailed as failure:
            _fail(ep, guard, failure)
            continue
        last = ep.tokens[-1]
        ep.add_environment_turn(turn, turn_format.tokens(turn.messages, last if last in stops else None)
                                if not turn.done else [])
        if not ep.done:
            ready.append(ep)
    return ready


def _fail(ep: Episode, guard: EnvironmentGuard, failure: EnvironmentFailed) -> None:
    ep.fail(guard.failed(failure))
    ep.failure = failure.reason
