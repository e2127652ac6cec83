"""Wire encoding. Frame 0 is a msgpack header ``{"schema": SCHEMA, "message": {"kind": ...,
field: value, ...}}`` that msgspec decodes straight into the tagged union of
:mod:`.messages`, checking every type and range the Structs declare. An array field's
value in the header is an :class:`ArrayRef` ``{"dtype", "shape", "frame"}`` naming one of
frames 1..k, which hold raw little-endian C-contiguous bytes. Nothing is pickled: a peer
can only make us build those Structs from plain values and numeric arrays. ``decode``
raises only :class:`WireError` (``reason``: a stable code for metrics); ``recv`` counts it."""

import math
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import zmq
from msgspec import Meta

from async_rl.wire.messages import MESSAGE_TYPES, AnyMessage, ArraySpec, Message, WireLimits
from async_rl.wire.rejects import RejectCounter, WireError, array_ref_rejection, header_reason, header_rejection

SCHEMA = 3

# Byte order is pinned so that mixed-endian hosts would fail loudly, not silently.
_DTYPES = {"uint8": np.dtype("u1"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"),
           "float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


class ArrayRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An array field as the header carries it: its bytes are frame ``frame``."""

    dtype: Literal[tuple(_DTYPES)]  # type: ignore[valid-type]
    shape: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=2)]
    frame: Annotated[int, Meta(ge=1)]


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # First, as the encoder writes it: a future schema may change everything after it.
    schema: Literal[SCHEMA]  # type: ignore[valid-type]
    message: AnyMessage  # type: ignore[valid-type]


def _array_fields(cls: type) -> tuple[tuple[str, ArraySpec], ...]:
    """(name, spec) of each array field of a message class, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    found = tuple((name, spec) for name in cls.__struct_fields__
                  for spec in getattr(hints[name], "__metadata__", ()) if isinstance(spec, ArraySpec))
    if bad := [name for name, spec in found if spec.dtype not in _DTYPES]:
        raise TypeError(f"{cls.__name__}.{bad[0]}: unsupported wire dtype")
    return found


# Computed at import so that a badly declared message fails at once, not on first use.
_ARRAYS = {cls: _array_fields(cls) for cls in MESSAGE_TYPES.values()}


def _plain_value(obj: Any) -> Any:
    """msgspec's enc_hook: numpy scalars, and an ndarray given for a list field, to
    Python values (msgspec packs neither as they are)."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (np.floating, np.bool_, np.ndarray)):
        return obj.tolist()
    raise NotImplementedError  # msgspec turns this into a TypeError naming the type


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain_value)
_NO_ARRAY = np.empty(0)
# The receiver's schema without the frames: encode checks a header's types with it.
_TYPE_CHECKER = msgspec.msgpack.Decoder(_Header, dec_hook=lambda tp, obj: _NO_ARRAY)


def _frame_array(obj: Any, payload: list[memoryview], used: list[bool], limits: WireLimits) -> np.ndarray:
    """The ndarray that the ArrayRef ``obj`` names: a zero-copy view of its frame."""
    try:
        ref = msgspec.convert(obj, ArrayRef)
    except msgspec.ValidationError as err:
        raise array_ref_rejection(err) from None
    if ref.frame > len(payload) or used[ref.frame - 1]:
        raise WireError("frame_count", f"frame {ref.frame} of {len(payload)} (missing or named twice)")
    used[ref.frame - 1] = True
    if any(d > limits.max_dim for d in ref.shape):
        raise WireError("too_large", f"frame {ref.frame}: dim > {limits.max_dim}")
    dt, buf = _DTYPES[ref.dtype], payload[ref.frame - 1]
    if buf.nbytes != math.prod(ref.shape) * dt.itemsize:
        raise WireError("shape_mismatch", f"frame {ref.frame}: {buf.nbytes} bytes for {ref.shape}")
    arr = np.frombuffer(buf, dtype=dt).reshape(ref.shape)  # zero copy, aliases the frame
    arr = arr if arr.flags.aligned else arr.copy()  # rare; torch wants alignment
    if dt.kind == "f" and not np.isfinite(arr).all():
        raise WireError("non_finite", f"frame {ref.frame}")
    return arr


def _as_view(frame: Any) -> memoryview:
    """A flat byte view of a frame (bytes, memoryview or zmq.Frame), no copy."""
    try:
        view = memoryview(frame)
        return view if view.ndim == 1 and view.format == "B" and view.c_contiguous else view.cast("B")
    except (TypeError, ValueError) as exc:  # not a buffer, or not C-contiguous
        raise WireError("bad_frame", type(exc).__name__) from None


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frames for ``msg``. Arrays are cast to their declared dtype only when needed
    (a copy); otherwise the frame aliases the caller's array: don't mutate it
    until the send has completed. A field of the wrong type raises TypeError here:
    silent coercion would hide sender bugs. Values out of range are sent, for the
    receiver to reject and count."""
    arrays = _ARRAYS.get(type(msg))  # type: ignore[arg-type]
    if arrays is None:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    refs: dict[str, ArrayRef] = {}
    payload: list[bytes | memoryview] = []
    for frame, (name, spec) in enumerate(arrays, start=1):
        arr = np.ascontiguousarray(getattr(msg, name), dtype=_DTYPES[spec.dtype])
        refs[name] = ArrayRef(spec.dtype, list(arr.shape), frame)  # type: ignore[arg-type]
        # Flat uint8 view: memoryview.cast refuses shapes with a zero in them.
        payload.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = _ENCODER.encode(_Header(SCHEMA, msgspec.structs.replace(msg, **refs) if refs else msg))
    try:
        _TYPE_CHECKER.decode(header)
    except msgspec.ValidationError as err:
        if header_reason(err) != "bad_value":
            raise TypeError(f"{type(msg).__name__}: {err}") from None
    return [header, *payload]


def decode(frames: Sequence[Any], limits: WireLimits | None = None) -> Message:
    """Validate ``frames`` and build the typed message; raises only WireError."""
    limits = limits or WireLimits()
    if not frames:
        raise WireError("frame_count", "no frames")
    views = [_as_view(f) for f in frames]
    if sum(v.nbytes for v in views) > limits.max_message_bytes:
        raise WireError("too_large", "message")
    if views[0].nbytes > limits.max_header_bytes:  # before parsing: bounds parse work
        raise WireError("too_large", "header")
    payload, used = views[1:], [False] * (len(views) - 1)
    decoder = msgspec.msgpack.Decoder(_Header, dec_hook=lambda tp, obj: _frame_array(obj, payload, used, limits))
    try:
        msg = decoder.decode(views[0]).message
    except msgspec.ValidationError as err:
        raise header_rejection(err, views[0]) from None
    # Also invalid UTF-8 in a string, and absurdly nested input.
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as err:
        raise WireError("not_msgpack", f"{type(err).__name__}: {err}"[:80]) from None
    if not all(used):
        raise WireError("frame_count", f"{used.count(False)} frames not named by {msg.KIND}")
    for name, spec in _ARRAYS[type(msg)]:
        arr = getattr(msg, name)
        if arr.dtype != _DTYPES[spec.dtype]:
            raise WireError("bad_dtype", f"{msg.KIND}.{name}: {arr.dtype}")
        if arr.ndim != spec.ndim:
            raise WireError("bad_shape", f"{msg.KIND}.{name}: {arr.ndim} dims")
    if (reason := msg.check(limits)) is not None:
        raise WireError(reason, msg.KIND)
    return msg


def send(socket: zmq.Socket, msg: Message, *, identity: bytes | None = None, flags: int = 0) -> None:
    """Send ``msg``; on a ROUTER pass the peer's ``identity``. Arrays are not copied."""
    frames = encode(msg) if identity is None else [identity, *encode(msg)]
    socket.send_multipart(frames, flags=flags, copy=False)


class _Claim(msgspec.Struct, tag="experience_group", tag_field="kind"):
    actor_id: int  # every other field is skipped unread
    group: int


class _ClaimHeader(msgspec.Struct):
    message: _Claim


_CLAIM_DECODER = msgspec.msgpack.Decoder(_ClaimHeader)


def claimed_group(frames: Sequence[Any], limits: WireLimits) -> tuple[int, int] | None:
    """(actor_id, group) an experience message that failed validation says it carries,
    when its header still reads: the hub hands that grant back for another try instead
    of waiting for a group that will never be accepted. Only a hint: the hub acts on it
    only for a grant the named actor really holds."""
    try:
        header = _as_view(frames[0]) if frames else None
        if header is None or header.nbytes > limits.max_header_bytes:
            return None
        claim = _CLAIM_DECODER.decode(header).message
    except (WireError, msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return None
    return claim.actor_id, claim.group


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
