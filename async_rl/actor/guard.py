"""User code, run guarded: rewards, environments (their factory, `step`, `close`) and
the tools inside them. A call that raises, runs too long or returns nonsense becomes
data, not a crash: its sample scores the fallback (reward.fallback), the failure is
counted by reason (the wire's FAILURE_REASONS travel with every message, and feed the
learner's reward.max_error_frac stop rule), and the first of each reason is logged
once, with its traceback when it raised.

One timeout mechanism for all of it: every call runs in a worker thread, and the actor
waits for it until its deadline (its own start + the guard's timeout) and no longer.
Calls submitted together run one after the other in one thread (a grant's rewards: a
thread per grant, not per call); calls that must not wait on each other (one episode's
environment and another's) are submitted apart. A call past its deadline is failed as
`timeout`, the calls queued behind it move to a new thread, and the late one is
interrupted: an exception is raised in its thread at its next Python instruction
(PyThreadState_SetAsyncExc), which stops a runaway loop at once and a blocking call
(a sleep, a read) when it returns. C code that never returns to Python cannot be
interrupted by any in-process means; its thread (a daemon) is left to finish. The
exception is a BaseException, so a user's `except Exception:` does not swallow it.
Without signals, this works on any thread, and leaves SIGALRM to its owner.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from async_rl.rewards.outcome import Failed
from async_rl.wire.messages import FAILURE_REASONS

log = logging.getLogger("async_rl.reward")
METRIC_PREFIX = {"reward": "reward", "environment": "env"}  # where each kind's failures are counted


class Guard:
    """One piece of user code (a reward, an environment): its timeout and fallback, and
    its failures counted by reason since construction (`totals`)."""

    def __init__(self, name: str, *, timeout_s: float, fallback: float = 0.0, kind: str = "reward",
                 logger: logging.Logger = log, excluded: bool = False) -> None:
        """`kind`: how log lines call it ("reward", "environment"); `excluded`: a failed
        sample is left out of training (reward.on_failure=exclude), the fallback scoring
        it in evaluations only."""
        self.name, self.timeout_s, self.fallback, self.kind, self.log = name, timeout_s, float(fallback), kind, logger
        self.excluded = excluded
        self.totals = [0] * len(FAILURE_REASONS)
        self._lock = threading.Lock()

    def failed(self, failure: Failed) -> float:
        """Count `failure`, log it if it is the first of its reason, return the fallback."""
        i = FAILURE_REASONS.index(failure.reason)
        with self._lock:
            self.totals[i] += 1
            first = self.totals[i] == 1
        if first:
            fate = (f"its sample is left out of training (reward.on_failure=exclude) and scores "
                    f"reward.fallback={self.fallback:g} in evaluations" if self.excluded
                    else f"scored reward.fallback={self.fallback:g}")
            self.log.warning("%s %s %s: %s; further '%s' failures are counted (%s/errors_%s), not logged", self.kind,
                             self.name, str(failure).splitlines()[0], fate, failure.reason, METRIC_PREFIX[self.kind],
                             failure.reason, exc_info=failure.__cause__)
        return self.fallback


class _Interrupted(BaseException):
    """Raised in a worker thread whose call ran past its deadline."""


def _interrupt(thread: threading.Thread) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupted))


@dataclass
class Call:
    """`fn(*args)`, then `check` on its value, under `guard`; `key` names it in the outcome."""
    key: Hashable
    guard: Guard
    fn: Callable[..., Any]
    args: tuple = ()
    check: Callable[[Any], Any] | None = None


@dataclass
class _Worker:
    id: int
    calls: list[Call]
    thread: threading.Thread | None = None
    started: int = 0  # calls begun so far
    deadline: float | None = None  # of the call running now
    done: set = field(default_factory=set)


class Calls:
    """User-code calls in flight, answered as they finish (`answers`)."""

    def __init__(self) -> None:
        # Lock-free for the workers: an interrupt may land anywhere in their code.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: dict[int, _Worker] = {}
        self._ids = 0

    def __len__(self) -> int:
        """Calls not yet answered."""
        return sum(len(w.calls) - len(w.done) for w in self._workers.values())

    def submit(self, calls: list[Call]) -> None:
        """Run `calls` one after the other in a thread of their own."""
        if not calls:
            return
        self._ids += 1
        worker = _Worker(self._ids, list(calls))
        worker.thread = threading.Thread(target=self._work, args=(worker.id, worker.calls), name="user-code",
                                         daemon=True)
        self._workers[worker.id] = worker
        worker.thread.start()

    def _work(self, wid: int, calls: list[Call]) -> None:
        try:
            for i, call in enumerate(calls):
                self._inbox.put((wid, i, time.monotonic(), None))
                try:
                    value = call.fn(*call.args)
                    outcome = call.check(value) if call.check is not None else value
                except Failed as failure:
                    outcome = failure
                except Exception as err:
                    outcome = Failed("raised", f"raised {type(err).__name__}: {err}")
                    outcome.__cause__ = err
                self._inbox.put((wid, i, None, outcome))
        except _Interrupted:  # past its deadline: the caller has moved on
            return

    def answers(self, block: bool = True, gather_s: float = 0.0) -> list[tuple[Hashable, Any]]:
        """(key, value or Failed) of each call finished (or past its deadline) since the
        last time. With `block`, waits for at least one while calls are in flight, then
        `gather_s` more for others that finish at about the same time."""
        out: list[tuple[Hashable, Any]] = []
        gather_until = None
        while len(self):
            now = time.monotonic()
            deadlines = [w.deadline for w in self._workers.values() if w.deadline is not None]
            if out or not block:
                gather_until = gather_until or now + gather_s
                wait = gather_until - now
            else:
                wait = min(deadlines) - now if deadlines else 1.0
            try:
                message = self._inbox.get(timeout=max(0.0, wait)) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                message = None
            if message is not None:
                self._take(message, out)
            self._expire(time.monotonic(), out)
            if message is None and (out or not block):
                break
        return out

    def wait_all(self) -> dict[Hashable, Any]:
        """Every call's outcome, by key, once all have finished or timed out."""
        outcomes: dict[Hashable, Any] = {}
        while len(self):
            outcomes.update(self.answers())
        return outcomes

    def _take(self, message: tuple, out: list) -> None:
        wid, i, started, outcome = message
        worker = self._workers.get(wid)
        if worker is None:
            return  # a worker given up on: its call timed out
        call = worker.calls[i]
        if started is not None:
            worker.started, worker.deadline = i + 1, started + call.guard.timeout_s
            return
        worker.done.add(i)
        worker.deadline = None
        out.append((call.key, outcome))
        if len(worker.done) == len(worker.calls):
            del self._workers[wid]

    def _expire(self, now: float, out: list) -> None:
        """Fail the calls past their deadlines; their queued successors move to new threads."""
        for worker in [w for w in self._workers.values() if w.deadline is not None and w.deadline <= now]:
            late = worker.started - 1
            call = worker.calls[late]
            del self._workers[worker.id]
            _interrupt(worker.thread)
            out.append((call.key, Failed("timeout", f"ran past its timeout of {call.guard.timeout_s:g}s")))
            self.submit(worker.calls[late + 1:])
