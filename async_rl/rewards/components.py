"""Several reward sources, weighted and summed (`reward.components`).

Each component is a reward function (a built-in, `module:function`, `file.py:function`,
`task`: the task's own reward, or `reward_model`: a learned one, rewards/reward_model.py)
with a weight; the sample's reward is the weighted sum. A component of `scope: group`
scores a prompt's whole group at once, `f(prompt, responses, answer, **fields)` -> a
score per response (a pairwise or listwise judge): each call is then a group. A
component of weight 0 is scored and logged but trained on by nobody: a verifiable
reward watching a learned one. Every component of a sample is called, each timed and
guarded on its own, so that a failed one does not hide the others' values; the sample
fails (unscorable, or reward.fallback) only when a weighted one failed. A component
may score step by step (StepRewards): the sample's steps are then the weighted steps
of every weighted component, one without steps counting its value at the response's end.

The values travel to the learner per sample and component (wire `components`,
`component_ms`, `component_failures`: 0, or 1 + the FAILURE_REASONS index; a failed
one's value and, when the whole call failed, its time are 0), which logs each
component's mean and latency p50/p95 where it scored, and its errors by reason.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from async_rl.rewards.judge import JUDGE, Judge
from async_rl.rewards.outcome import RESPONSE_END, Failed, StepRewards, as_outcome, failure_note
from async_rl.rewards.reward_model import PROCESS_REWARD_MODEL, REWARD_MODEL, ProcessRewardModel, RewardModel
from async_rl.wire.messages import FAILURE_REASONS

TASK_REWARD = "task"  # a component's `reward` that means the task's own


@dataclass
class ComponentScores:
    """One sample's components: values (0 where failed), milliseconds, failure codes
    (0 = scored, 1 + FAILURE_REASONS index), notes, and the step rewards of those that
    gave them ((end, reward) pairs, rewards/outcome.py StepRewards), in the components' order."""
    names: list[str]
    weights: list[float]
    values: list[float]
    ms: list[float]
    codes: list[int]
    notes: list[str]
    steps: list[list[tuple[int, float]] | None] | None = None

    def settle(self) -> float | StepRewards | Failed:
        """The weighted sum; the first failure of a weighted component when there is one.
        When a weighted component gave step rewards, the sum comes with the weighted
        steps of all of them, a component without steps giving its value at the
        response's end."""
        for name, weight, code, note in zip(self.names, self.weights, self.codes, self.notes):
            if code and weight != 0.0:
                return Failed(FAILURE_REASONS[code - 1], f"component {name}: {note}")
        total = math.fsum(w * v for w, v in zip(self.weights, self.values) if w != 0.0)
        steps = self.steps or [None] * len(self.names)
        if not any(s is not None and w != 0.0 for s, w in zip(steps, self.weights)):
            return total
        by_end: dict[int, float] = {}
        for weight, value, own in zip(self.weights, self.values, steps):
            for end, reward in (own if own is not None else [(RESPONSE_END, value)]) if weight != 0.0 else []:
                by_end[end] = by_end.get(end, 0.0) + weight * reward
        return StepRewards(sorted(by_end.items()), total)

    def reply(self) -> dict:
        """As a reward worker sends it."""
        return {"components": self.values, "component_ms": self.ms, "component_codes": self.codes,
                "component_notes": self.notes, "component_steps": self.steps or [None] * len(self.names)}

    @classmethod
    def from_reply(cls, reply: dict, names: list[str], weights: list[float]) -> ComponentScores:
        n = len(names)

        def column(key: str, kind: type, default):
            values = reply.get(key)
            if not isinstance(values, list) or len(values) != n:
                return [default] * n
            return [v if isinstance(v, kind) else default for v in values]

        codes = [c if 0 <= c <= len(FAILURE_REASONS) else 1 for c in column("component_codes", int, 1)]
        values = column("components", float, 0.0)
        steps: list = column("component_steps", list, None)
        for j, own in enumerate(steps):  # a worker's steps are checked again: nothing it says is trusted
            if own is None or codes[j]:
                steps[j] = None
                continue
            try:
                checked = as_outcome(StepRewards([tuple(pair) for pair in own], values[j]))
                steps[j] = list(checked.steps)
            except (Failed, TypeError):
                steps[j], codes[j], values[j] = None, 1 + FAILURE_REASONS.index("not_a_number"), 0.0
        return cls(names, weights, values, column("component_ms", float, 0.0),
                   codes, [str(note) for note in column("component_notes", str, "")], steps)


class Components:
    """The reward of `reward.components`: `(name, weight, function)` triples, and the
    names of those that score a whole group at once (`grouped`)."""

    def __init__(self, parts: list[tuple[str, float, Callable]], grouped: frozenset[str] = frozenset()) -> None:
        self.names = [name for name, _, _ in parts]
        self.weights = [float(weight) for _, weight, _ in parts]
        self.functions = [fn for _, _, fn in parts]
        self.by_group = [name in grouped for name in self.names]

    @property
    def grouped(self) -> bool:
        """Whether a component scores a prompt's whole group (`scope: group`): then a call
        is a group, `score_group`."""
        return any(self.by_group)

    def score_group(self, prompt: str, responses: list[str], answer: str, **fields) -> list[ComponentScores]:
        """Every component of each of a prompt's responses: a group-scope component once,
        `f(prompt, responses, answer, **fields)` -> one score per response."""
        return self.score_batch([(prompt, response, answer, fields) for response in responses], group=True)

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> ComponentScores:
        return self.score_batch([(prompt, response, answer, fields)])[0]

    @property
    def batched(self) -> bool:
        """Whether a component scores batches (a reward model: `score_batch`)."""
        return any(hasattr(fn, "score_batch") for fn in self.functions)

    def score_batch(self, calls: list[tuple[str, str, str, dict]], group: bool = False) -> list[ComponentScores]:
        """Every component of each (prompt, response, answer, fields): a batch source
        (`score_batch(prompts, responses, answers)`: a score or an exception per row),
        and with `group` (the calls are one prompt's group) a group-scope one, once for
        all, its time shared evenly; the others call by call."""
        n = len(calls)
        values = [[0.0] * len(self.functions) for _ in range(n)]
        steps: list[list] = [[None] * len(self.functions) for _ in range(n)]
        ms = [[0.0] * len(self.functions) for _ in range(n)]
        codes = [[0] * len(self.functions) for _ in range(n)]
        notes = [[""] * len(self.functions) for _ in range(n)]

        def record(i: int, j: int, run) -> None:
            start = time.perf_counter()
            try:
                outcome = as_outcome(run())
                if isinstance(outcome, StepRewards):
                    values[i][j], steps[i][j] = outcome.value, list(outcome.steps)
                else:
                    values[i][j] = outcome
            except Exception as err:  # noqa: BLE001 - a component's failure is data
                failure = err if isinstance(err, Failed) else Failed("raised", f"raised {type(err).__name__}: {err}")
                codes[i][j], notes[i][j] = 1 + FAILURE_REASONS.index(failure.reason), failure_note(failure)
            ms[i][j] = (time.perf_counter() - start) * 1e3

        for j, fn in enumerate(self.functions):
            if self.by_group[j] and not group:
                raise ValueError(f"component {self.names[j]} scores groups: call score_group")
            if hasattr(fn, "score_batch") or self.by_group[j]:
                start = time.perf_counter()
                try:
                    if self.by_group[j]:
                        prompt, _, answer, fields = calls[0]
                        batch = list(fn(prompt, [c[1] for c in calls], answer, **fields))
                    else:
                        batch = fn.score_batch([c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls])
                    if len(batch) != n:
                        raise ValueError(f"returned {len(batch)} scores for {n} responses")
                except Exception as err:  # noqa: BLE001 - every sample's component failed
                    batch = [err] * n
                share = (time.perf_counter() - start) * 1e3 / max(n, 1)
                for i, value in enumerate(batch):
                    record(i, j, lambda value=value: _raise_or(value))
                    ms[i][j] = share
                continue
            for i, (prompt, response, answer, fields) in enumerate(calls):
                record(i, j, lambda: fn(prompt, response, answer, **fields))  # noqa: B023 - called at once
        return [ComponentScores(self.names, self.weights, values[i], ms[i], codes[i], notes[i], steps[i])
                for i in range(n)]

    def failed_whole(self, failure: Failed) -> ComponentScores:
        """Every component failed at once (the call ran past reward.timeout_s, its worker died)."""
        code = 1 + FAILURE_REASONS.index(failure.reason)
        n = len(self.names)
        return ComponentScores(self.names, self.weights, [0.0] * n, [0.0] * n, [code] * n,
                               [failure_note(failure)] * n)


def _raise_or(value):
    if isinstance(value, Exception):
        raise value
    return value


def components_from_config(components: list[dict], task_reward: Callable, timeout_s: float = 10.0,
                           load: bool = True) -> Components:
    """`reward.components` (as dicts: name, reward, weight) with `task_reward` standing for
    `task`; `timeout_s` (reward.timeout_s) bounds a remote source's wait. `load=False`:
    their names, weights and scopes alone, no source built (an actor whose reward workers
    score: no copy of a reward model in the actor itself)."""
    return Components([(c["name"], c["weight"], build_source(c, task_reward, timeout_s) if load else None)
                       for c in components], frozenset(c["name"] for c in components if c.get("scope") == "group"))


def build_source(c: dict, task_reward: Callable | None, timeout_s: float, device: str = "cpu") -> Callable:
    """What scores component `c`: in this process, or through the reward server at
    `c["server_endpoint"]` when it has placement: server (the server itself builds it
    here, on `device`). A remote source answers within 0.9 * `timeout_s`, so that it
    fails as itself before the call's deadline."""
    from async_rl.tasks import load_reward_fn
    from async_rl.tasks.rows import with_fields

    if c.get("server_endpoint"):
        from async_rl.reward_server.client import ServerScorer

        return ServerScorer(c["server_endpoint"], c["name"], 0.9 * timeout_s)
    if c["reward"] == TASK_REWARD:
        return task_reward
    if c["reward"] == JUDGE:
        judge = dict(c.get("judge") or {})  # reward.components[].judge: Judge's own keywords
        key_env = judge.pop("api_key_env", None)
        return Judge(**judge, model=None if judge.get("url") else c.get("model"), timeout_s=0.9 * timeout_s,
                     api_key=os.environ.get(key_env) if key_env else None, device=device)
    scale = {"normalize": c.get("normalize", True), "clip": c.get("clip"), "device": device}
    if c["reward"] == REWARD_MODEL:
        return RewardModel(c["model"], **scale)
    if c["reward"] == PROCESS_REWARD_MODEL:
        return ProcessRewardModel(c["model"], separator=c.get("separator", "\n\n"),
                                  aggregate=c.get("aggregate", "steps"), **scale)
    return with_fields(load_reward_fn(c["reward"]))  # a group-scope f(prompt, responses, answer, ...) alike
