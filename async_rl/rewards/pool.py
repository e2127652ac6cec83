"""Reward calls in worker processes (`reward.executor: process`), so that a call past its
deadline can be stopped: its worker's whole process group is killed and a new worker
started in its place, and no core stays busy after the deadline. A thread cannot give
that guarantee (actor/guard.py: C code that never returns to Python runs on).

The pool starts its workers once, when the actor starts (`start`: the start-up cost is
paid there, and a reward that cannot even be imported fails the actor in one line).
`score` hands a batch of calls out in chunks, one chunk per idle worker; a worker
answers call by call, and each call's deadline runs from the previous answer (or from
the chunk's sending), so a slow call does not eat the next one's time. A call past its
deadline fails as `timeout`, its worker is killed, and the calls queued behind it go to
the other workers. A worker that dies (a reward that calls os._exit, a segfault, the
kernel's OOM killer) fails its call as `raised`, naming how it died.

Children a reward starts in a session of their own escape the process group, and are
not killed; the sandbox (async_rl/sandbox) is for code that must be contained.
"""
from __future__ import annotations

import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from async_rl.rewards import frames
from async_rl.rewards.components import ComponentScores
from async_rl.rewards.outcome import Failed, StepRewards, as_outcome

log = logging.getLogger("async_rl.reward")


class RewardPoolError(RuntimeError):
    """The reward's workers cannot start (the reward does not import, or they die at once)."""


class RemoteTraceback(Exception):
    """The traceback of a reward that raised in a worker, as the worker printed it."""


@dataclass
class Call:
    """One reward call: the task's reward on (prompt, response, answer, **fields); with a
    group-scope component, `response` is a prompt's group of responses."""
    prompt: str
    response: str | list[str]
    answer: str
    fields: dict = field(default_factory=dict)
    task_only: bool = False  # the task's own reward, not reward.components (an evaluation)


@dataclass
class _Worker:
    process: subprocess.Popen
    to_worker: int
    answers: frames.FrameReader
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    queue: deque = field(default_factory=deque)  # indices of the calls sent, not yet answered
    deadline: float = math.inf  # of the call it runs now

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the reward's children too
        except ProcessLookupError:
            pass
        self.process.wait()
        for fd in (self.to_worker, self.answers.fd):
            os.close(fd)

    def how_it_died(self) -> str:
        code = self.process.wait()
        return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"


class RewardPool:
    """`processes` workers running the reward of the task section `task` (a dict, as the
    config holds it) with `seed`, each call given `timeout_s`."""

    def __init__(self, task: dict, seed: int, *, processes: int, timeout_s: float, chunk: int = 64,
                 start_timeout_s: float = 120.0, components: list[dict] | None = None) -> None:
        """`components`: reward.components as dicts; each call then answers a ComponentScores."""
        self.hello = frames.encode({"task": task, "seed": seed, "components": components or [], "timeout_s": timeout_s})
        self.component_names = [c["name"] for c in components or []]
        self.component_weights = [float(c["weight"]) for c in components or []]
        self.processes, self.timeout_s, self.chunk, self.start_timeout_s = processes, timeout_s, chunk, start_timeout_s
        self.workers: list[_Worker] = []
        self.restarts = 0
        self.start_seconds: float | None = None

    def start(self) -> None:
        """Start the workers and wait until each has built the reward."""
        started = time.monotonic()
        self.workers = [self._spawn() for _ in range(self.processes)]
        self.wait_ready()
        self.start_seconds = time.monotonic() - started

    def wait_ready(self) -> None:
        """Wait until every worker (a replacement too) has built the reward."""
        while not all(w.ready for w in self.workers):
            self._wait(time.monotonic() + self.start_timeout_s)
            self._check_start()

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, calls: list[Call]) -> list[float | StepRewards | Failed | ComponentScores]:
        """Each call's reward (its components' scores, with `components`), or its failure, in order."""
        outcomes: list[float | Failed | None] = [None] * len(calls)
        todo = deque(range(len(calls)))
        while True:
            self._hand_out(calls, todo, outcomes)
            if all(outcome is not None for outcome in outcomes):
                return outcomes  # type: ignore[return-value]
            deadlines = [w.deadline for w in self.workers if w.queue]
            for worker in self._wait(min(deadlines) if deadlines else time.monotonic() + self.start_timeout_s):
                self._take_answers(worker, outcomes, todo)
            self._expire(outcomes, todo)
            self._check_start()

    def _spawn(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        process = subprocess.Popen([sys.executable, "-m", "async_rl.rewards.worker", str(to_worker_r),
                                    str(from_worker_w)], pass_fds=(to_worker_r, from_worker_w),
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(to_worker_r)
        os.close(from_worker_w)
        worker = _Worker(process, to_worker_w, frames.FrameReader(from_worker_r))
        frames.write(worker.to_worker, self.hello)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = self._spawn()
        self.restarts += 1

    def _wait(self, until: float) -> list[_Worker]:
        """The workers with something to read, waiting until `until` at most."""
        by_fd = {w.answers.fd: w for w in self.workers if w.queue or not w.ready}
        readable, _, _ = select.select(list(by_fd), [], [], max(0.0, until - time.monotonic()))
        for fd in readable:
            by_fd[fd].answers.fill()
        return [by_fd[fd] for fd in readable]

    def _check_start(self) -> None:
        """Take the workers' ready messages; a worker that cannot build the reward, or
        dies or hangs before it has, stops the pool (RewardPoolError, one line)."""
        for worker in self.workers:
            if worker.ready:
                continue
            hello = worker.answers.messages()
            if hello and hello[0].get("ready"):
                worker.ready = True
                continue
            if hello:
                raise RewardPoolError(f"the reward cannot be built: {hello[0].get('error')}")
            if worker.answers.closed:
                raise RewardPoolError(f"a reward worker {worker.how_it_died()} before it was ready")
            if time.monotonic() - worker.started > self.start_timeout_s:
                raise RewardPoolError(f"a reward worker was not ready after {self.start_timeout_s:g}s")

    def _hand_out(self, calls: list[Call], todo: deque, outcomes: list) -> None:
        idle = [w for w in self.workers if w.ready and not w.queue]
        if not idle or not todo:
            return
        size = max(1, min(self.chunk, math.ceil(len(todo) / len(idle))))
        for worker in idle:
            batch = []
            while todo and len(batch) < size:
                i = todo.popleft()
                call = calls[i]
                batch.append({"id": i, "prompt": call.prompt, "response": call.response, "answer": call.answer,
                              "fields": call.fields, "task_only": call.task_only})
            frame = self._frame(batch, outcomes)
            if frame is None:
                continue
            try:
                frames.write(worker.to_worker, frame)
            except BrokenPipeError:  # it died idle: its replacement takes the calls
                todo.extendleft(reversed([m["id"] for m in batch]))
                self._replace(worker)
                continue
            worker.queue.extend(m["id"] for m in batch)
            worker.deadline = time.monotonic() + self.timeout_s

    @staticmethod
    def _frame(batch: list[dict], outcomes: list) -> bytes | None:
        """`batch` as one frame; a call whose row fields MessagePack cannot hold fails
        alone, and leaves the batch (None when none is left)."""
        try:
            return frames.encode({"calls": batch})
        except (NotImplementedError, TypeError, OverflowError):
            pass
        for message in list(batch):  # rare: find the calls that cannot travel
            try:
                frames.encode(message)
            except (NotImplementedError, TypeError, OverflowError) as err:
                outcomes[message["id"]] = Failed("raised", f"its row's fields cannot reach a reward worker: {err}")
                batch.remove(message)
        return frames.encode({"calls": batch}) if batch else None

    def _take_answers(self, worker: _Worker, outcomes: list, todo: deque) -> None:
        if not worker.ready:
            return  # its ready message is _check_start's
        for answer in worker.answers.messages():
            if not worker.queue or answer.get("id") != worker.queue[0]:
                continue  # not the call it was given: nothing to trust in it
            outcomes[worker.queue.popleft()] = self._outcome(answer)
            worker.deadline = time.monotonic() + self.timeout_s if worker.queue else math.inf
        if worker.ready and worker.answers.closed:
            if worker.queue:  # it died in the call at the head of its queue
                outcomes[worker.queue.popleft()] = Failed("raised", f"its reward worker {worker.how_it_died()} "
                                                                    "during the call")
                todo.extendleft(reversed(worker.queue))
            self._replace(worker)

    def _outcome(self, answer: dict) -> float | Failed | ComponentScores | list[ComponentScores]:
        if self.component_names and isinstance(answer.get("group"), list):
            return [ComponentScores.from_reply(part if isinstance(part, dict) else {}, self.component_names,
                                               self.component_weights) for part in answer["group"]]
        if self.component_names and "components" in answer:
            return ComponentScores.from_reply(answer, self.component_names, self.component_weights)
        if "value" in answer and isinstance(answer["value"], float) and math.isfinite(answer["value"]):
            if "steps" not in answer:
                return answer["value"]
            try:  # checked again: nothing a worker says is trusted
                return as_outcome(StepRewards([tuple(step) for step in answer["steps"]], answer["value"]))
            except (Failed, TypeError) as failure:
                return failure if isinstance(failure, Failed) else Failed("not_a_number", "steps are not pairs")
        reason = answer.get("failure") if answer.get("failure") in ("raised", "timeout", "non_finite",
                                                                    "not_a_number") else "raised"
        failure = Failed(reason, str(answer.get("note", "failed in its worker")))
        if answer.get("traceback"):
            failure.__cause__ = RemoteTraceback(str(answer["traceback"]))
        return failure

    def _expire(self, outcomes: list, todo: deque) -> None:
        now = time.monotonic()
        for worker in [w for w in self.workers if w.queue and w.deadline <= now]:
            outcomes[worker.queue.popleft()] = Failed("timeout", f"ran past its timeout of {self.timeout_s:g}s "
                                                                 "(its worker was killed)")
            todo.extendleft(reversed(worker.queue))
            self._replace(worker)
