"""A guard around user reward code: a reward that fails becomes data, not a crash.

The actors call the reward on every sampled response. A reward that raises, hangs, or
returns NaN or None on one strange response would otherwise kill the actor (its
prompts re-issued to a reward that fails the same way) or reach the wire as a value the
hub must reject; either way the run stalls. `RewardGuard` instead scores such a
response `reward.fallback`, counts the failure by reason, and logs the first failure of
each reason once. The counts travel with every message (`reward_errors`), the learner
logs them (`reward/errors*`) and stops the run when too many of a step's samples were
scored by the fallback (`reward.max_error_frac`).

`async-rl train` stays strict at launch (launch_checks.check_task): a reward that fails on
the sample answer is a config error there, not something to count.
"""
from __future__ import annotations

import logging
import math
import numbers
import signal
import threading
import time
from typing import Callable

import numpy as np

log = logging.getLogger("async_rl.reward")

# Every failure is one of these; the wire's `reward_errors` lists counts in this order.
REASONS = ("raised", "timeout", "non_finite", "not_a_number")
# Rewards travel as float32: a larger magnitude arrives as inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class BadReward(ValueError):
    """A value that is no usable reward, for `reason` (non_finite or not_a_number)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def as_reward(value: object) -> float:
    """`value` as a float reward (a bool counts as 0/1); raises BadReward for None, str,
    bytes, a complex, a list... (`not_a_number`), NaN, inf or beyond float32 (`non_finite`)."""
    if isinstance(value, bool):
        return float(value)
    if (value is None or isinstance(value, (str, bytes, bytearray))
            or (isinstance(value, numbers.Number) and not isinstance(value, numbers.Real))):
        raise BadReward("not_a_number")
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float range
        raise BadReward("non_finite") from None
    except Exception:  # float() refuses it (a list, an object without __float__)
        raise BadReward("not_a_number") from None
    if not math.isfinite(number) or abs(number) > _FLOAT32_MAX:
        raise BadReward("non_finite")
    return number


class _Timeout(BaseException):
    """Raised by our SIGALRM handler inside the reward. A BaseException, so that a
    reward's own `except Exception:` cannot swallow it and go on hanging."""


def _on_alarm(signum, frame):
    raise _Timeout()


class RewardGuard:
    """`guard(prompt, response, answer)` is `fn(...)` as a float, or `fallback` when
    the call fails: it raises (`raised`), runs past `timeout_s` (`timeout`), returns
    NaN or inf, or a magnitude beyond float32 (`non_finite`), or returns something that
    is not a real number: None, str, bytes, a list, a complex (`not_a_number`; a bool
    counts as 0/1).

    The timeout is a SIGALRM timer (`signal.setitimer`), so it applies only on the main
    thread; off it the reward runs without one. It interrupts Python code (a loop,
    `time.sleep`, a blocking read, a backtracking regex), not C code that holds the GIL
    without checking for signals (one long call into an extension). A timer or SIGALRM
    handler set by someone else is restored afterwards, the timer with its remaining
    time less the call's duration (one that came due during the call fires as the call
    returns).
    """

    def __init__(self, fn: Callable[[str, str, str], object], *, timeout_s: float | None = 10.0,
                 fallback: float = 0.0, name: str | None = None, logger: logging.Logger = log) -> None:
        """`name`: how log lines call the reward (default: the function's name)."""
        self.fn, self.timeout_s, self.fallback, self.log = fn, timeout_s, float(fallback), logger
        self.name = name or getattr(fn, "__qualname__", None) or repr(fn)
        self._lock = threading.Lock()
        self._pending = [0] * len(REASONS)  # since the last take_counts()
        self.totals = [0] * len(REASONS)  # since construction; also decides which failure is first

    @classmethod
    def for_task(cls, task, cfg, logger: logging.Logger = log) -> "RewardGuard":
        """A guard around `task.reward` as the run's config (its `reward` section) says."""
        return cls(task.reward, timeout_s=cfg.reward.timeout_s, fallback=cfg.reward.fallback, logger=logger,
                   name=getattr(cfg.task, "reward", None) or f"{type(task).__name__}.reward")

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        try:
            value = self._call(prompt, response, answer)
        except _Timeout:
            return self._failed("timeout", response, f"ran past reward.timeout_s={self.timeout_s:g}s")
        except Exception as err:
            return self._failed("raised", response, f"raised {type(err).__name__}: {err}", exc_info=err)
        try:
            return as_reward(value)
        except BadReward as bad:
            return self._failed(bad.reason, response, f"returned {value!r:.60}")

    def take_counts(self) -> list[int]:
        """Failures per reason (REASONS order) since the previous call."""
        with self._lock:
            counts, self._pending = self._pending, [0] * len(REASONS)
        return counts

    def _call(self, prompt: str, response: str, answer: str):
        timed = (self.timeout_s is not None and self.timeout_s > 0 and hasattr(signal, "setitimer")
                 and threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGALRM) is not None)  # None: a C handler we could not put back
        if not timed:
            return self.fn(prompt, response, answer)
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        started = time.monotonic()
        outer_delay, outer_interval = signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        try:
            try:
                return self.fn(prompt, response, answer)
            finally:
                # An alarm that lands after the reward returned but before this line still
                # raises _Timeout (the call took about timeout_s anyway); the timer is
                # one-shot, so the outer finally always runs to the end.
                signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, previous)
            if outer_delay > 0:  # an outer timer that came due meanwhile fires at once
                remaining = max(outer_delay - (time.monotonic() - started), 1e-6)
                signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)

    def _failed(self, reason: str, response: str, what: str, exc_info: BaseException | None = None) -> float:
        i = REASONS.index(reason)
        with self._lock:
            self._pending[i] += 1
            self.totals[i] += 1
            first = self.totals[i] == 1
        if first:
            self.log.warning("reward %s %s on response %r: scored reward.fallback=%g; further '%s' failures are "
                             "counted (reward/errors_%s), not logged", self.name, what.splitlines()[0] if what else "",
                             response[:60] if isinstance(response, str) else response, self.fallback, reason, reason,
                             exc_info=exc_info)
        return self.fallback


def zero_counts() -> list[int]:
    """Per-reason counts of a message whose samples all scored."""
    return [0] * len(REASONS)


def step_errors(groups) -> tuple[list[int], float]:
    """(failures per reason, fraction of scored responses that got the fallback) of a
    step's ExperienceGroups; a ReMax baseline counts as one more scored response."""
    counts = [sum(col) for col in zip(*(g.reward_errors for g in groups))] if groups else zero_counts()
    scored = sum(len(g.rewards) + (g.greedy_reward is not None) for g in groups)
    return counts, sum(counts) / max(scored, 1)


def describe(counts) -> str:
    """`raised 3, timeout 0, ...`: counts in REASONS order, for a log line."""
    return ", ".join(f"{reason} {n}" for reason, n in zip(REASONS, counts))
