"""Wire encoding: frame 0 = msgpack ``{"schema", "kind", "body", "arrays": [{"name",
"dtype", "shape"}]}``, frames 1..k = raw little-endian C-contiguous array bytes, in
``arrays`` order. Nothing is pickled: a peer can only make us build the dataclasses
of :mod:`.messages` from plain values and numeric arrays. ``decode`` raises only
:class:`WireError` (``reason``: a stable code for metrics); ``recv`` counts it."""

import logging
import math
import operator
import threading
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, Sequence, Union

import msgpack
import numpy as np
import zmq

from .messages import MESSAGE_TYPES, Message

SCHEMA = 1

# Byte order is pinned so that mixed-endian hosts would fail loudly, not silently.
_DTYPES = {"uint8": np.dtype("u1"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"),
           "float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
_HEADER_KEYS = frozenset({"schema", "kind", "body", "arrays"})
_ARRAY_KEYS = frozenset({"name", "dtype", "shape"})
_INT64_BOUND = 1 << 63  # ints must fit int64 so numpy/torch never overflow later

log = logging.getLogger("async_rl.wire")


class WireError(Exception):
    """An invalid message; ``reason`` is a stable code, ``detail`` free text."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 64 << 20
    max_header_bytes: int = 64 << 10
    max_dim: int = 1 << 20
    max_group_size: int = 1024
    max_tokens: int = 65536
    # Spans per TraceSpans message: 1024 of the longest name keep the header far below
    # max_header_bytes; an actor ships at most this many per heartbeat.
    max_trace_spans: int = 1024


@dataclass(frozen=True)
class _Field:  # one message field, compiled from its type hint and metadata
    name: str
    kind: str  # int | float | str | bool | list[int] | list[str] | dict | array
    optional: bool  # None is an allowed value
    required: bool  # must be present in the body (no default)
    lo: float | None = None
    hi: float | None = None
    dtype: str = ""
    ndim: int = 0


_HINT_KINDS: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool",
                               list[int]: "list[int]", list[str]: "list[str]",
                               dict[str, Any]: "dict", np.ndarray: "array"}


def _compile(cls: type) -> tuple[dict[str, _Field], dict[str, _Field]]:
    """Turn a message dataclass's type hints into (body fields, array fields)."""
    hints = typing.get_type_hints(cls)
    body: dict[str, _Field] = {}
    arrays: dict[str, _Field] = {}
    for f in fields(cls):  # ClassVars (KIND) are not dataclass fields
        hint, optional = hints[f.name], False
        if typing.get_origin(hint) in (Union, types.UnionType):
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            hint, optional = (args[0] if len(args) == 1 else None), True
        kind = _HINT_KINDS.get(hint)
        if kind is None or (optional and kind == "array"):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported wire type {hints[f.name]}")
        required, m = f.default is MISSING and f.default_factory is MISSING, f.metadata
        spec = _Field(f.name, kind, optional, required, m.get("min"), m.get("max"),
                      m.get("dtype", ""), m.get("ndim", 0))
        if kind == "array" and spec.dtype not in _DTYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: array fields need array(dtype, ndim)")
        (arrays if kind == "array" else body)[f.name] = spec
    return body, arrays


# Compiled at import so that a badly declared message fails at once, not on first use.
_SPECS = {kind: _compile(cls) for kind, cls in MESSAGE_TYPES.items()}
_PLAIN_TYPES: dict[str, type] = {"str": str, "bool": bool, "dict": dict}


def _check_range(f: _Field, v: float) -> None:
    if (f.lo is not None and v < f.lo) or (f.hi is not None and v > f.hi) \
            or (type(v) is int and not -_INT64_BOUND <= v < _INT64_BOUND):
        raise WireError("bad_value", f.name)


def _check_value(f: _Field, v: Any) -> Any:
    """Validate one decoded body value against its field; return the value to store."""
    if v is None and f.optional:
        return None
    # `type(...) is` rather than isinstance: bool is an int subclass and must not pass.
    if f.kind == "int" and type(v) is int:
        _check_range(f, v)
    elif f.kind == "float" and type(v) in (int, float):  # some encoders pack 1.0 as 1
        if not math.isfinite(v := float(v)):
            raise WireError("non_finite", f.name)
        _check_range(f, v)
    elif f.kind == "list[int]" and type(v) is list and all(type(x) is int for x in v):
        for x in v:
            _check_range(f, x)
    elif not (f.kind in _PLAIN_TYPES and type(v) is _PLAIN_TYPES[f.kind]) and not (
            f.kind == "list[str]" and type(v) is list and all(type(x) is str for x in v)):
        raise WireError("bad_field_type", f.name)
    return v


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"ext type {code}")


def _str_keys(obj: dict) -> dict:
    # strict_map_key still lets bytes keys through; field names are always str.
    if any(type(key) is not str for key in obj):
        raise ValueError("non-str map key")
    return obj


def _unpack_header(view: memoryview, limits: WireLimits) -> Any:
    """Unpack the subset of msgpack we accept: str keys, no ext types, bounded sizes."""
    n = limits.max_header_bytes
    try:
        return msgpack.unpackb(view, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                               object_hook=_str_keys, max_str_len=n, max_bin_len=n,
                               max_array_len=n, max_map_len=n, max_ext_len=0)
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}"[:80]) from None


def _as_view(frame: Any) -> memoryview:
    """A flat byte view of a frame (bytes, memoryview or zmq.Frame), no copy."""
    try:
        view = memoryview(frame)
        return view if view.ndim == 1 and view.format == "B" and view.c_contiguous else view.cast("B")
    except (TypeError, ValueError) as exc:  # not a buffer, or not C-contiguous
        raise WireError("bad_frame", type(exc).__name__) from None


# Coerce to plain msgpack types (numpy scalars are not packable). operator.index
# refuses floats for int fields: silent truncation would hide sender bugs.
_TO_WIRE: dict[str, Any] = {"int": operator.index, "float": float, "bool": bool, "list[str]": list,
                            "list[int]": lambda v: [operator.index(x) for x in v]}


def _to_wire(f: _Field, v: Any) -> Any:
    return None if v is None else _TO_WIRE.get(f.kind, lambda x: x)(v)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``. Arrays are cast to their declared dtype only when needed
    (a copy); otherwise the frame aliases the caller's array: don't mutate it
    until the send has completed."""
    cls = MESSAGE_TYPES.get(getattr(msg, "KIND", None))  # type: ignore[arg-type]
    if cls is None or type(msg) is not cls:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    body_spec, array_spec = _SPECS[msg.KIND]
    body = {name: _to_wire(f, getattr(msg, name)) for name, f in body_spec.items()}
    descs: list[dict[str, Any]] = []
    payload: list[bytes | memoryview] = []
    for name, f in array_spec.items():
        arr = np.ascontiguousarray(getattr(msg, name), dtype=_DTYPES[f.dtype])
        descs.append({"name": name, "dtype": f.dtype, "shape": list(arr.shape)})
        # Flat uint8 view: memoryview.cast refuses shapes with a zero in them.
        payload.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = {"schema": SCHEMA, "kind": msg.KIND, "body": body, "arrays": descs}
    return [msgpack.packb(header, use_bin_type=True), *payload]


def _decode_arrays(descs: Any, payload: list[memoryview], spec: dict[str, _Field],
                   limits: WireLimits) -> dict[str, np.ndarray]:
    if type(descs) is not list:
        raise WireError("bad_header", "arrays is not a list")
    if len(descs) != len(payload):  # before per-array checks: a truncated send is common
        raise WireError("frame_count", f"{len(descs)} arrays, {len(payload)} frames")
    out: dict[str, np.ndarray] = {}
    for desc, buf in zip(descs, payload):
        if type(desc) is not dict or desc.keys() != _ARRAY_KEYS:
            raise WireError("bad_header", "array descriptor")
        name, dtype, shape = desc["name"], desc["dtype"], desc["shape"]
        f = spec.get(name) if type(name) is str else None
        if f is None or name in out:
            raise WireError("unknown_field", f"{name!r:.60} (unknown or repeated)")
        if type(dtype) is not str or dtype != f.dtype:
            raise WireError("bad_dtype", f"{name}: {repr(dtype)[:30]}")
        if type(shape) is not list or len(shape) != f.ndim or len(shape) > 2 \
                or any(type(d) is not int or d < 0 for d in shape):
            raise WireError("bad_shape", name)
        if any(d > limits.max_dim for d in shape):
            raise WireError("too_large", f"{name}: dim > {limits.max_dim}")
        dt = _DTYPES[dtype]
        if buf.nbytes != math.prod(shape) * dt.itemsize:
            raise WireError("shape_mismatch", f"{name}: {buf.nbytes} bytes for {shape}")
        arr = np.frombuffer(buf, dtype=dt).reshape(shape)  # zero copy, aliases the frame
        arr = arr if arr.flags.aligned else arr.copy()  # rare; torch wants alignment
        if dt.kind == "f" and not np.isfinite(arr).all():
            raise WireError("non_finite", name)
        out[name] = arr
    if missing := spec.keys() - out.keys():
        raise WireError("missing_field", min(missing))
    return out


def decode(frames: Sequence[Any], limits: WireLimits | None = None) -> Message:
    """Validate ``frames`` and build the typed message; raises only WireError."""
    limits = limits or WireLimits()
    if not frames:
        raise WireError("frame_count", "no frames")
    views = [_as_view(f) for f in frames]
    if sum(v.nbytes for v in views) > limits.max_message_bytes:
        raise WireError("too_large", "message")
    if views[0].nbytes > limits.max_header_bytes:  # before unpacking: bounds parse work
        raise WireError("too_large", "header")
    header = _unpack_header(views[0], limits)
    if type(header) is not dict:
        raise WireError("bad_header", "not a map")
    # Schema first: a future schema may legitimately change the other keys.
    if type(header.get("schema")) is not int or header["schema"] != SCHEMA:
        raise WireError("bad_schema", repr(header.get("schema"))[:30])
    if header.keys() != _HEADER_KEYS:
        raise WireError("bad_header", "header keys")
    cls = MESSAGE_TYPES.get(kind) if type(kind := header["kind"]) is str else None
    if cls is None:
        raise WireError("unknown_kind", repr(kind)[:60])
    body_spec, array_spec = _SPECS[kind]
    if type(body := header["body"]) is not dict:
        raise WireError("bad_header", "body is not a map")
    if not body.keys() <= body_spec.keys():
        raise WireError("unknown_field", f"{kind}: {sorted(body.keys() - body_spec.keys())!r:.60}")
    if missing := [n for n, f in body_spec.items() if f.required and n not in body]:
        raise WireError("missing_field", f"{kind}.{missing[0]}")
    values = {name: _check_value(body_spec[name], v) for name, v in body.items()}
    values.update(_decode_arrays(header["arrays"], views[1:], array_spec, limits))
    msg = cls(**values)
    if (reason := msg.check(limits)) is not None:
        raise WireError(reason, kind)
    return msg


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


def send(socket: zmq.Socket, msg: Message, *, identity: bytes | None = None, flags: int = 0) -> None:
    """Send ``msg``; on a ROUTER pass the peer's ``identity``. Arrays are not copied."""
    frames = encode(msg) if identity is None else [identity, *encode(msg)]
    socket.send_multipart(frames, flags=flags, copy=False)


def claimed_group(frames: Sequence[Any], limits: WireLimits) -> tuple[int, int] | None:
    """(actor_id, group) an experience message that failed validation says it carries,
    when its header still reads: the hub hands that grant back for another try instead
    of waiting for a group that will never be accepted. Only a hint: the hub acts on it
    only for a grant the named actor really holds."""
    try:
        header = _unpack_header(_as_view(frames[0]), limits) if frames else None
    except WireError:
        return None
    body = header.get("body") if type(header) is dict and header.get("kind") == "experience_group" else None
    if type(body) is not dict or type(body.get("actor_id")) is not int or type(body.get("group")) is not int:
        return None
    return body["actor_id"], body["group"]


def recv(socket: zmq.Socket, limits: WireLimits, counter: RejectCounter, *, routed: bool,
         flags: int = 0, on_reject: Callable[[list], None] | None = None) -> tuple[bytes | None, Message | None]:
    """One message: (identity if ``routed`` else None, message or None when invalid,
    counted in ``counter``; ``on_reject(frames)`` then sees the frames). zmq errors
    (zmq.Again on timeout) propagate."""
    return read_frames(socket.recv_multipart(flags=flags, copy=False), limits, counter, routed=routed,
                       on_reject=on_reject)


def read_frames(parts: list, limits: WireLimits, counter: RejectCounter, *, routed: bool,
                on_reject: Callable[[list], None] | None = None) -> tuple[bytes | None, Message | None]:
    """`recv` for frames already received (a caller that also wants zmq's frame properties)."""
    # A ROUTER prepends the sending DEALER's identity frame.
    identity, parts = (parts[0].bytes, parts[1:]) if routed else (None, parts)
    try:
        return identity, decode(parts, limits)
    except WireError as err:
        counter.record(err)
        if on_reject is not None:
            on_reject(parts)
        return identity, None
