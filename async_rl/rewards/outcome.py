"""What a call of user code (a reward, an environment's step) comes to: a finite float
reward, or a failure named by one of the wire's FAILURE_REASONS, with a one-line note
short enough to travel."""
from __future__ import annotations

import math
import numbers

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


def failure_note(failure: Failed) -> str:
    """The first line of how `failure` happened, short enough to travel (wire
    MAX_FAILURE_NOTE)."""
    line = str(failure).splitlines()[0] if str(failure) else failure.reason
    return line if len(line) <= MAX_FAILURE_NOTE else line[:MAX_FAILURE_NOTE - 3] + "..."
