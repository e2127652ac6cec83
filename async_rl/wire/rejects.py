"""Rejected wire messages: :class:`WireError` and its stable reason codes, how msgspec's
validation errors map onto them, and the per-reason :class:`RejectCounter`.

Reasons (identifiers in metrics and logs, so never renamed): ``not_msgpack`` (not the
msgpack subset we accept: malformed, trailing bytes, bad UTF-8, ext types, non-str map
keys), ``bad_header``, ``bad_schema``, ``unknown_kind``, ``missing_field``,
``unknown_field``, ``bad_field_type``, ``bad_value``, ``non_finite``, ``bad_dtype``,
``bad_shape``, ``too_large``, ``frame_count``, ``bad_frame``, and the cross-field ones
of each message's ``check`` (``shape_mismatch``, ``version_mismatch``,
``unknown_span``, ...). Receivers add their own through :meth:`RejectCounter.reject`.
"""

import logging
import math
import re
import threading

import msgspec

log = logging.getLogger("async_rl.wire")


class WireError(Exception):
    """An invalid message; ``reason`` is a stable code, ``detail`` free text."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


# msgspec.ValidationError text: "what - at `$.path`", or "what - at `key` in `$.path`".
_ERROR = re.compile(r"(?P<what>.*?)(?: - at `(?P<path>[^`]*)`(?: in `(?P<outer>[^`]*)`)?)?", re.S)
_BOUND = re.compile(r"Expected `\w+` (>=|<=|>|<|of length)")  # a Meta constraint, not a type


def _parse(err: msgspec.ValidationError) -> tuple[str, str]:
    """(what is wrong, where) of a msgspec.ValidationError."""
    m = _ERROR.fullmatch(str(err))
    return m["what"], m["path"] or "$"


def _outside_subset(what: str, path: str) -> bool:
    """An ext type, or a map key that is not a str: msgpack we never accept."""
    return "got `ext`" in what or path == "key"


def header_reason(err: msgspec.ValidationError) -> str:
    """The reason for a ``{"schema", "message"}`` header that msgspec refused."""
    what, path = _parse(err)
    if _outside_subset(what, path):
        return "not_msgpack"
    if path == "$.schema" or what.endswith("field `schema`"):
        return "bad_schema"
    if path == "$.message.kind":
        return "unknown_kind"
    if path == "$.message" and what.startswith("Object contains unknown field"):
        return "unknown_field"
    if path == "$.message" and what.startswith("Object missing required field") and not what.endswith("`kind`"):
        return "missing_field"
    if not path.startswith("$.message."):
        return "bad_header"
    return "bad_value" if _BOUND.match(what) or what.startswith("Invalid enum value") else "bad_field_type"


def header_rejection(err: msgspec.ValidationError, header: memoryview) -> WireError:
    """The WireError for a header msgspec refused. msgspec reports a NaN or an infinity
    that a bound refused like any other value out of range: look at the value itself."""
    reason, detail = header_reason(err), str(err)[:80]
    if reason == "bad_value" and detail.startswith("Expected `float`"):
        name = _parse(err)[1].removeprefix("$.message.")
        try:
            value = msgspec.msgpack.decode(header)["message"][name]
        except Exception:  # unreadable as plain msgpack: not a value we can look at
            value = None
        if type(value) is float and not math.isfinite(value):
            reason = "non_finite"
    return WireError(reason, detail)


_ARRAY_REF_REASONS = {"$.dtype": "bad_dtype", "$.shape": "bad_shape", "$.frame": "frame_count"}


def array_ref_rejection(err: msgspec.ValidationError) -> WireError:
    """The WireError for an array reference ``{"dtype", "shape", "frame"}`` msgspec refused."""
    what, path = _parse(err)
    reason = "not_msgpack" if _outside_subset(what, path) else _ARRAY_REF_REASONS.get(path.split("[")[0],
                                                                                     "bad_header")
    return WireError(reason, str(err)[:80])


class RejectCounter:
    """Thread-safe count of rejected messages by reason. Only the first of each
    reason is logged: a misbehaving peer would otherwise flood the log."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._lock, self._log = threading.Lock(), logger
        self._counts: dict[str, int] = {}

    def record(self, error: WireError) -> None:
        with self._lock:
            first = error.reason not in self._counts
            self._counts[error.reason] = self._counts.get(error.reason, 0) + 1
        if first:
            self._log.warning("rejected wire message: %s (%s); further '%s' rejections "
                              "are counted, not logged", error.reason, error.detail, error.reason)

    def reject(self, reason: str, detail: str = "") -> None:
        """Count a message the wire layer accepted but the receiver's state refuses."""
        self.record(WireError(reason, detail))

    def preload(self, counts: dict[str, int]) -> None:
        """Continue the counts of a resumed run (those reasons were logged already)."""
        with self._lock:
            for reason, n in counts.items():
                self._counts[reason] = self._counts.get(reason, 0) + int(n)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
