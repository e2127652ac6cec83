"""Scoring off the generation path: the actor hands a grant's generated samples to a
thread of its own, which scores them (rollout.finish), pushes one message per group and
counts them; meanwhile the actor asks for its next grant and generates. A sample enters
the experience stream when it is scored.

In flight is bounded (`reward.in_flight` grants generated, not yet pushed): past the
bound the actor waits (a `wait-for-rewards` span), so slow rewards hold generation back
instead of filling memory. `reward.in_flight: 0` scores each grant in the actor's own
thread before it asks for more work, as the actor did before it had this thread.

The thread owns the experience socket (ZeroMQ sockets are not thread-safe): evaluation
results go out through it too (`send`), in order. A failure in the thread (a push past
transport.timeout_s, a reward pool that cannot restart a worker) is raised in the actor
at its next call. Grants still queued when the actor leaves are dropped, not scored:
the hub re-issues a departed actor's grants, so no admitted prompt is lost. A thread
still at work when the actor has waited for it keeps its socket: the actor leaves
without closing it, and the process's exit ends the thread.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from async_rl.actor.rollout.rollout import Generated, Rollout
from async_rl.run.tracing import SpanRecorder
from async_rl.wire import encode

log = logging.getLogger("async_rl.actor")


class Scorer:
    """Score and push grants in order, at most `in_flight` of them at once (0: inline)."""

    def __init__(self, rollout: Rollout, push: zmq.Socket, state: dict, spans: SpanRecorder, in_flight: int) -> None:
        """`state["generated"]` counts the groups pushed (the heartbeat reports it)."""
        self.rollout, self.push, self.state, self.spans, self.in_flight = rollout, push, state, spans, in_flight
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(max(1, in_flight))
        self._error: BaseException | None = None
        self._dropping = False
        self._thread: threading.Thread | None = None
        if in_flight > 0:
            self._thread = threading.Thread(target=self._work, name="scorer", daemon=True)
            self._thread.start()

    def score(self, generated: Generated) -> None:
        """Score and push `generated` (now when inline, else in the scorer's thread)."""
        self._run(lambda: self._push([encode(g) for g in self.rollout.finish(generated, self.spans)], groups=True))

    def send(self, messages: list) -> None:
        """Push encoded messages (an evaluation result) after what is queued."""
        self._run(lambda: self._push([messages], groups=False))

    @property
    def queued(self) -> int:
        """Grants handed over whose scoring has not begun."""
        return self._jobs.qsize()

    def drop_pending(self) -> None:
        """Forget the queued grants (their prompts were re-issued to others); the one being
        scored still goes out (the hub refuses it as no longer granted)."""
        stopping = False
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:  # close's stop sign holds no slot, and stays last
                stopping = True
                continue
            self._slots.release()
        if stopping:
            self._jobs.put(None)

    def close(self, wait_s: float) -> bool:
        """Drop what is queued, let the grant being scored finish (up to `wait_s`), stop.
        False when the thread is still at work (scoring, or blocked pushing to a hub that
        does not take): its socket is then the thread's still, and must not be closed
        from another thread (ZeroMQ sockets are not thread-safe)."""
        self._dropping = True
        self.drop_pending()
        if self._thread is None:
            return True
        self._jobs.put(None)
        self._thread.join(timeout=wait_s)
        return not self._thread.is_alive()

    def _run(self, job: Callable[[], None]) -> None:
        self._raise_failure()
        if self._thread is None:
            job()
            return
        if not self._slots.acquire(blocking=False):
            with self.spans.span("wait-for-rewards"):
                while not self._slots.acquire(timeout=0.5):
                    self._raise_failure()
        self._jobs.put(job)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _push(self, messages: list, *, groups: bool) -> None:
        with self.spans.span("push", groups=len(messages) if groups else 0):
            for msg in messages:
                self.push.send_multipart(msg, copy=False)
                if groups:
                    self.state["generated"] += 1

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if not self._dropping:
                    job()
            except BaseException as err:  # noqa: BLE001 - raised in the actor's thread
                if not self._dropping:
                    self._error = err
                    log.debug("the scorer thread failed", exc_info=True)
                return
            finally:
                self._slots.release()
