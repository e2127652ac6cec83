"""Wire protocol: typed msgspec messages, msgpack headers + raw array frames over zmq."""

from .messages import (
    MESSAGE_TYPES,
    EvalGrant,
    EvalResult,
    ExperienceGroup,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    SyncDone,
    SyncOrder,
    TraceSpans,
    Wait,
    Welcome,
    WorkGrant,
    WorkRequest,
)
from .rejects import RejectCounter, WireError
from .wire import SCHEMA, WireLimits, claimed_group, decode, encode, read_frames, recv, send

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA",
    "EvalGrant",
    "EvalResult",
    "ExperienceGroup",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Message",
    "RejectCounter",
    "SyncDone",
    "SyncOrder",
    "TraceSpans",
    "Wait",
    "Welcome",
    "WireError",
    "WireLimits",
    "claimed_group",
    "read_frames",
    "WorkGrant",
    "WorkRequest",
    "decode",
    "encode",
    "recv",
    "send",
]
