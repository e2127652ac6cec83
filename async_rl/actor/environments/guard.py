"""User environment code, run guarded: an environment that raises, hangs or answers
nonsense ends its episode with `reward.fallback`, is counted by reason and logged once
per reason, and never takes the actor down (as reward_guard.py does for rewards; the
counts travel in the same `reward_errors` field and feed the same stop rule,
`reward.max_error_frac`).

Reasons (reward_guard.REASONS): `raised` (the factory or `step` raised), `timeout` (the
call ran past `env.timeout_s`; the rollout stops waiting for it), `non_finite` (a
reward that is NaN, inf or beyond float32), `not_a_number` (a `step` that returned no
`Turn`, messages that are not role/content string pairs, a reward that is no real
number).
"""
from __future__ import annotations

import logging
import threading

from async_rl.tasks.base import Prompt
from async_rl.user_code import REASONS, BadReward, as_reward
from async_rl.actor.environments.base import Environment, EnvironmentFactory, Turn

log = logging.getLogger("async_rl.env")


class EnvironmentFailed(Exception):
    """An environment call failed for `reason` (one of REASONS)."""

    def __init__(self, reason: str, what: str) -> None:
        super().__init__(what)
        self.reason = reason


def checked_turn(value: object) -> Turn:
    """`value` if it is a well-formed Turn; raises EnvironmentFailed otherwise."""
    if not isinstance(value, Turn):
        raise EnvironmentFailed("not_a_number", f"returned {type(value).__name__}, not a Turn")
    messages = value.messages
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise EnvironmentFailed("not_a_number", f"returned messages {messages!r:.60}, not role/content strings")
    if value.reward is None:
        return value
    try:
        return Turn(messages, as_reward(value.reward), bool(value.done))
    except BadReward as bad:
        raise EnvironmentFailed(bad.reason, f"returned reward {value.reward!r:.60}") from None


class EnvironmentGuard:
    """`start(prompt)` and `step(env, action)` raise only EnvironmentFailed; `failed`
    logs a failure (the first of each reason) and returns `fallback`. The episode that
    failed carries the reason (Episode.failure), and its group the counts."""

    def __init__(self, factory: EnvironmentFactory, fallback: float = 0.0, name: str | None = None,
                 logger: logging.Logger = log) -> None:
        self.factory, self.fallback, self.log = factory, float(fallback), logger
        self.name = name or getattr(factory, "__qualname__", None) or repr(factory)
        self._lock = threading.Lock()
        self.totals = [0] * len(REASONS)  # since construction; decides which failure is the first

    def start(self, prompt: Prompt) -> Environment:
        try:
            env = self.factory(prompt)
        except Exception as err:
            raise EnvironmentFailed("raised", f"raised {type(err).__name__}: {err}") from err
        if not callable(getattr(env, "step", None)):
            raise EnvironmentFailed("not_a_number", f"made {type(env).__name__}, which has no step()")
        return env

    def step(self, env: Environment, action: str) -> Turn:
        try:
            value = env.step(action)
        except EnvironmentFailed:
            raise
        except Exception as err:
            raise EnvironmentFailed("raised", f"raised {type(err).__name__}: {err}") from err
        return checked_turn(value)

    def close(self, env: Environment) -> None:
        """The environment's `close()`, when it has one; a failure is logged, never raised
        (the episode is already scored)."""
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as err:
                self.log.debug("environment %s: close() raised %s: %s", self.name, type(err).__name__, err)

    def failed(self, failure: EnvironmentFailed) -> float:
        i = REASONS.index(failure.reason)
        with self._lock:
            self.totals[i] += 1
            first = self.totals[i] == 1
        if first:
            self.log.warning("environment %s %s: the episode ends, scored reward.fallback=%g; further '%s' failures "
                             "are counted (reward/errors_%s), not logged", self.name, str(failure).splitlines()[0],
                             self.fallback, failure.reason, failure.reason, exc_info=failure.__cause__)
        return self.fallback
