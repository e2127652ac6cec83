"""How a weight transfer fails, as its callers see it."""
from __future__ import annotations

import re


class SyncAbandoned(RuntimeError):
    """Rank 0 gave up on an epoch before its group formed (membership changed, or a
    member never came); the parameters are untouched."""


class EpochRejected(ValueError):
    """Rank 0 cannot serve the members as they announced themselves (engines mixed, or
    a vLLM member whose wire layout differs from the learner's); it abandons the epoch."""


class WeightMismatch(RuntimeError):
    """The weights a member received are not what rank 0 sent (fingerprint.py): the
    message names the version and the tensor; the member does not use them."""


def describe(err: BaseException) -> str:
    """One short log line for a failed sync: gloo's messages open with a source location
    and end with a paragraph of advice."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]
