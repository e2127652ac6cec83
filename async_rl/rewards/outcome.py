"""What a call of user code (a reward, an environment's step) comes to: a finite float
reward, a reward given step by step (StepRewards: a process reward), or a failure named
by one of the wire's FAILURE_REASONS, with a one-line note short enough to travel."""
from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from async_rl.wire.messages import MAX_FAILURE_NOTE

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards travel as float32: beyond it they arrive as inf


class Failed(Exception):
    """A guarded call failed for `reason` (one of FAILURE_REASONS); `what` says how."""

    def __init__(self, reason: str, what: str) -> None:
        super().__init__(what)
        self.reason = reason


def as_reward(value: object) -> float:
    """`value` as a float reward (a bool counts as 0/1); Failed for None, str, bytes, a
    complex, a list... (`not_a_number`), NaN, inf or beyond float32 (`non_finite`)."""
    if isinstance(value, bool):
        return float(value)
    if (value is None or isinstance(value, (str, bytes, bytearray))
            or (isinstance(value, numbers.Number) and not isinstance(value, numbers.Real))):
        raise Failed("not_a_number", f"returned {value!r:.60}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float range
        raise Failed("non_finite", f"returned {value!r:.60}") from None
    except Exception:  # float() refuses it (a list, an object without __float__)
        raise Failed("not_a_number", f"returned {value!r:.60}") from None
    if not math.isfinite(number) or abs(number) > _FLOAT32_MAX:
        raise Failed("non_finite", f"returned {value!r:.60}")
    return number


MAX_STEPS = 4096  # steps of one response: more than any response has tokens
RESPONSE_END = 1 << 62  # a step end at or past the response's length: its last token


@dataclass(frozen=True)
class StepRewards:
    """A reward given step by step, as a reward may return it: `steps` are (end, reward)
    pairs in increasing order of `end`, the character offset in the response text where
    the step ends (exclusive: the step is `response[previous end:end]`); `value` is the
    sample's reward (the steps' sum when None). The actor puts each step's reward on
    the token where its text ends (an end at or past the text's length: the response's
    last token), and `train.advantage.name: grpo_process` trains on them; the other
    estimators use `value`."""
    steps: Sequence[tuple[int, float]]
    value: float | None = None

    @classmethod
    def split(cls, response: str, rewards: Sequence[float], separator: str = "\n\n",
              value: float | None = None) -> StepRewards:
        """One reward per step of `response` cut at each `separator` (a step ends where
        its separator begins; the last at the end)."""
        pieces = response.split(separator)
        if len(pieces) != len(rewards):
            raise ValueError(f"{len(rewards)} step rewards for {len(pieces)} steps")
        ends, end = [], 0
        for piece in pieces:
            end += len(piece)
            ends.append(end)
            end += len(separator)
        return cls(list(zip(ends, rewards)), value)


def as_outcome(value: object) -> float | StepRewards:
    """A reward call's result: a float (as_reward), or StepRewards checked (ends ints,
    positive, increasing; rewards as as_reward takes them; at most MAX_STEPS; `value`
    filled in); Failed (`not_a_number`, `non_finite`) otherwise."""
    if not isinstance(value, StepRewards):
        return as_reward(value)
    try:
        steps = [(end, as_reward(reward)) for end, reward in value.steps]
    except Failed as failure:
        raise Failed(failure.reason, f"a step reward: {failure}") from None
    except (TypeError, ValueError):
        raise Failed("not_a_number", f"steps are not (end, reward) pairs: {value.steps!r:.60}") from None
    if not steps or len(steps) > MAX_STEPS:
        raise Failed("not_a_number", f"{len(steps)} steps (1 to {MAX_STEPS})")
    ends = [end for end, _ in steps]
    if any(isinstance(end, bool) or not isinstance(end, numbers.Integral) for end in ends):
        raise Failed("not_a_number", f"step ends are not character offsets: {ends!r:.60}")
    if ends[0] < 1 or any(b <= a for a, b in zip(ends, ends[1:])):
        raise Failed("not_a_number", f"step ends are not positive and increasing: {ends!r:.60}")
    total = math.fsum(reward for _, reward in steps) if value.value is None else value.value
    return StepRewards([(int(end), reward) for end, reward in steps], as_reward(total))


def failure_note(failure: Failed) -> str:
    """The first line of how `failure` happened, short enough to travel (wire
    MAX_FAILURE_NOTE)."""
    line = str(failure).splitlines()[0] if str(failure) else failure.reason
    return line if len(line) <= MAX_FAILURE_NOTE else line[:MAX_FAILURE_NOTE - 3] + "..."
