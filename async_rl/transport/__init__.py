"""Wire protocol: typed messages, msgpack headers + raw array frames over zmq."""

from .messages import (
    MESSAGE_TYPES,
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
from .wire import SCHEMA, RejectCounter, WireError, WireLimits, decode, encode, recv, send

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA",
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
    "WorkGrant",
    "WorkRequest",
    "decode",
    "encode",
    "recv",
    "send",
]
