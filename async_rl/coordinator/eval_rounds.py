"""Held-out evaluation rounds, handed out by the coordinator and scored by the actors
(actor/rollout/rollout.py: `Rollout.scores`), at one policy version per round.

Why on the actors: they already hold the current weights in an inference engine. The
learner then keeps no unsharded copy of the model for evaluation, never stops training
for it, and no learner rank waits in a collective while rank 0 decodes (with a large
held-out set that wait ran into `learner.timeout_s`). Evaluation costs actor time,
like generation, and shows up as such in the trace.

A round is requested at learner version v. The first actor that asks for work holding
weights of version u >= v pins the round to u; from then on, actors holding u get its
chunks (`eval.batch_size` prompts each) before anything else, also before a weight
sync, so every score of a round comes from the same weights, and the round's metrics
line is logged at step u. If no live actor holds u any more while chunks are left
(the one that held it died), the round starts over at the next version an actor
holds. Each actor scores its chunk with `eval.pass_k` samples per prompt, greedy
unless `eval.temperature` > 0, and pushes one EvalResult.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from async_rl.wire import EvalGrant, EvalResult

log = logging.getLogger("async_rl.eval")


def summarize(rewards: np.ndarray, lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    """A round's metrics from its [prompts, k] scores. A sample is correct when its
    reward is >= 1 (exact match, or a 0/1 verifier); with k samples per prompt,
    pass@k is the fraction of prompts with at least one correct sample and
    eval/accuracy the fraction of correct samples (an unbiased pass@1)."""
    correct = rewards >= 1.0
    out = {"eval/accuracy": float(correct.mean()), "eval/reward_mean": float(rewards.mean()),
           "eval/response_len_mean": float(lengths.mean()), "eval/truncated_frac": float(truncated.mean()),
           "eval/prompts": float(rewards.shape[0])}
    if rewards.shape[1] > 1:
        out[f"eval/pass@{rewards.shape[1]}"] = float(correct.any(axis=1).mean())
    return out


@dataclass
class _Round:
    requested: int  # learner version that asked for it: pinned to a version >= this
    chunks: list[tuple[int, ...]]
    id: int = 0  # a new id each time the round (re)starts, so late results of an old start are ignored
    version: int | None = None
    todo: deque = field(default_factory=deque)
    out: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # actor id -> chunks it holds
    scores: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)  # prompt id -> rows
    started: float = 0.0

    def restart(self, round_id: int) -> None:
        self.id, self.version, self.out, self.scores = round_id, None, {}, {}
        self.todo = deque(self.chunks)
        self.started = time.monotonic()


class EvalRounds:
    """The coordinator's evaluation bookkeeping: one round at a time, in request order."""

    def __init__(self, prompt_ids: list[int], batch_size: int) -> None:
        self.chunks = [tuple(prompt_ids[i:i + batch_size]) for i in range(0, len(prompt_ids), batch_size)]
        self.rounds: deque[_Round] = deque()
        self.done: list[dict[str, float]] = []  # finished rounds' metrics lines, taken by the learner
        self._ids = itertools.count()

    @property
    def pending(self) -> int:
        return len(self.rounds)

    def request(self, version: int) -> None:
        if not self.chunks:
            return
        if self.rounds and self.rounds[-1].requested == version:
            return  # asked twice for one version (the final step is also an eval.every step)
        self.rounds.append(_Round(version, self.chunks))
        if len(self.rounds) == 1:
            self.rounds[0].restart(next(self._ids))

    def grant(self, actor_id: int, actor_version: int, live_versions: set[int]) -> EvalGrant | None:
        """A chunk for this actor, if it holds the weights the current round is scored with."""
        if not self.rounds:
            return None
        r = self.rounds[0]
        if r.version is not None and r.todo and r.version not in live_versions:
            log.info("evaluation of version %d starts over: no live actor holds those weights any more", r.version)
            r.restart(next(self._ids))
        if not r.todo or actor_version < r.requested or r.version not in (None, actor_version):
            return None
        r.version = actor_version
        chunk = r.todo.popleft()
        r.out.setdefault(actor_id, []).append(chunk)
        return EvalGrant(round=r.id, version=actor_version, prompt_ids=list(chunk))

    def actor_left(self, actor_id: int) -> None:
        """A leaving actor's chunks go back to be scored by another actor."""
        if self.rounds:
            self.rounds[0].todo.extendleft(reversed(self.rounds[0].out.pop(actor_id, [])))

    def on_result(self, msg: EvalResult) -> str | None:
        """Record a result; a rejection reason when it does not answer an open grant."""
        r = self.rounds[0] if self.rounds else None
        if r is None or msg.round != r.id:
            return "stale_eval" if r is None or msg.round < r.id else "not_granted"
        chunk = tuple(msg.prompt_ids)
        if msg.version != r.version or chunk not in r.out.get(msg.actor_id, []):
            return "not_granted"
        r.out[msg.actor_id].remove(chunk)
        for i, pid in enumerate(chunk):
            r.scores[pid] = (msg.rewards[i], msg.response_lengths[i], msg.truncated[i])
        if not r.todo and not any(r.out.values()):
            self._finish(self.rounds.popleft())
        return None

    def _finish(self, r: _Round) -> None:
        rows = [r.scores[pid] for chunk in r.chunks for pid in chunk]
        line = summarize(*(np.stack([row[k] for row in rows]) for k in range(3)))
        self.done.append({"step": r.version, "version": r.version, **line,
                          "eval/seconds": time.monotonic() - r.started})
        if self.rounds:
            self.rounds[0].restart(next(self._ids))

    def take_done(self) -> list[dict[str, float]]:
        done, self.done = self.done, []
        return done


def eval_prompt_ids(task, size: int | None) -> list[int]:
    """The ids of the first `size` held-out prompts (all when None)."""
    prompts = task.eval_prompts()
    return [p.id for p in prompts[:size if size is not None else len(prompts)]]
