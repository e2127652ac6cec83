"""Several reward sources, weighted and summed (`reward.components`).

Each component is a reward function (a built-in, `module:function`, `file.py:function`,
or `task`: the task's own reward) with a weight; the sample's reward is the weighted
sum. A component of weight 0 is scored and logged but trained on by nobody: a
verifiable reward watching a learned one. Every component of a sample is called, each
timed and guarded on its own, so that a failed one does not hide the others' values;
the sample fails (unscorable, or reward.fallback) only when a weighted one failed.

The values travel to the learner per sample and component (wire `components`,
`component_ms`, `component_failures`: 0, or 1 + the FAILURE_REASONS index; a failed
one's value and, when the whole call failed, its time are 0), which logs each
component's mean and latency p50/p95 where it scored, and its errors by reason.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from async_rl.rewards.outcome import Failed, as_reward, failure_note
from async_rl.wire.messages import FAILURE_REASONS

TASK_REWARD = "task"  # a component's `reward` that means the task's own


@dataclass
class ComponentScores:
    """One sample's components: values (0 where failed), milliseconds, failure codes
    (0 = scored, 1 + FAILURE_REASONS index) and notes, in the components' order."""
    names: list[str]
    weights: list[float]
    values: list[float]
    ms: list[float]
    codes: list[int]
    notes: list[str]

    def settle(self) -> float | Failed:
        """The weighted sum; the first failure of a weighted component when there is one."""
        for name, weight, code, note in zip(self.names, self.weights, self.codes, self.notes):
            if code and weight != 0.0:
                return Failed(FAILURE_REASONS[code - 1], f"component {name}: {note}")
        return math.fsum(w * v for w, v in zip(self.weights, self.values) if w != 0.0)

    def reply(self) -> dict:
        """As a reward worker sends it."""
        return {"components": self.values, "component_ms": self.ms, "component_codes": self.codes,
                "component_notes": self.notes}

    @classmethod
    def from_reply(cls, reply: dict, names: list[str], weights: list[float]) -> ComponentScores:
        n = len(names)

        def column(key: str, kind: type, default):
            values = reply.get(key)
            if not isinstance(values, list) or len(values) != n:
                return [default] * n
            return [v if isinstance(v, kind) else default for v in values]

        codes = [c if 0 <= c <= len(FAILURE_REASONS) else 1 for c in column("component_codes", int, 1)]
        return cls(names, weights, column("components", float, 0.0), column("component_ms", float, 0.0),
                   codes, [str(note) for note in column("component_notes", str, "")])


class Components:
    """The reward of `reward.components`: `(name, weight, function)` triples."""

    def __init__(self, parts: list[tuple[str, float, Callable]]) -> None:
        self.names = [name for name, _, _ in parts]
        self.weights = [float(weight) for _, weight, _ in parts]
        self.functions = [fn for _, _, fn in parts]

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> ComponentScores:
        values, ms, codes, notes = [], [], [], []
        for fn in self.functions:
            start = time.perf_counter()
            try:
                values.append(as_reward(fn(prompt, response, answer, **fields)))
                codes.append(0)
                notes.append("")
            except Exception as err:  # noqa: BLE001 - a component's failure is data
                failure = err if isinstance(err, Failed) else Failed("raised", f"raised {type(err).__name__}: {err}")
                values.append(0.0)
                codes.append(1 + FAILURE_REASONS.index(failure.reason))
                notes.append(failure_note(failure))
            ms.append((time.perf_counter() - start) * 1e3)
        return ComponentScores(self.names, self.weights, values, ms, codes, notes)

    def failed_whole(self, failure: Failed) -> ComponentScores:
        """Every component failed at once (the call ran past reward.timeout_s, its worker died)."""
        code = 1 + FAILURE_REASONS.index(failure.reason)
        n = len(self.names)
        return ComponentScores(self.names, self.weights, [0.0] * n, [0.0] * n, [code] * n,
                               [failure_note(failure)] * n)


def components_from_config(components: list[dict], task_reward: Callable) -> Components:
    """`reward.components` (as dicts: name, reward, weight) with `task_reward` standing for `task`."""
    from async_rl.tasks import load_reward_fn
    from async_rl.tasks.rows import with_fields

    return Components([(c["name"], c["weight"], task_reward if c["reward"] == TASK_REWARD
                        else with_fields(load_reward_fn(c["reward"]))) for c in components])
