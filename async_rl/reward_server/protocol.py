"""What travels between the reward's workers and the reward server: a request of rows
for one component, and its reply, msgpack-encoded msgspec structs in one ZeroMQ frame
(the client's DEALER adds nothing; the server's ROUTER prepends the peer's identity).

A request with no rows is a ping: its reply carries the server's versions and no scores.
A frame that does not decode as a request, or is too large, is counted and refused with
a reply naming why (when it has an id), never a traceback.
"""
from __future__ import annotations

import msgspec

MAX_FRAME_BYTES = 64 << 20
MAX_ROWS = 4096


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    component: str
    prompts: list[str]
    responses: list[str]
    answers: list[str]
    timeout_s: float  # how long the caller waits: rows still queued after it are dropped


class ScoreReply(msgspec.Struct, forbid_unknown_fields=True):
    id: int
    values: list[float]  # 0 where failed
    steps: list[list[tuple[int, float]] | None]  # a process reward model's (char end, reward) per row
    failures: list[str]  # "" = scored; else "reason: what failed" (rewards/outcome.py FAILURE_REASONS)
    version: str  # the component's weights (a content hash): which model scored these rows
    batch: int = 0  # the largest batch these rows were scored in
    error: str = ""  # the whole request refused, and why


class BadRequest(ValueError):
    """A frame that is not a valid request: why, and the id when one could be read."""

    def __init__(self, why: str, request_id: int | None = None) -> None:
        super().__init__(why)
        self.request_id = request_id


_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(ScoreRequest)
_replies = msgspec.msgpack.Decoder(ScoreReply)


def encode(message: ScoreRequest | ScoreReply) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes) -> ScoreRequest:
    """The request in `frame`; BadRequest naming what is wrong with it."""
    if len(frame) > MAX_FRAME_BYTES:
        raise BadRequest(f"request of {len(frame)} bytes, more than {MAX_FRAME_BYTES}")
    try:
        request = _requests.decode(frame)
    except msgspec.DecodeError as err:
        raise BadRequest(f"not a score request: {err}", _id_of(frame)) from None
    rows = len(request.prompts)
    if not (len(request.responses) == len(request.answers) == rows):
        raise BadRequest("prompts, responses and answers differ in length", request.id)
    if rows > MAX_ROWS:
        raise BadRequest(f"{rows} rows, more than {MAX_ROWS}", request.id)
    if not request.timeout_s > 0:
        raise BadRequest(f"timeout_s must be > 0, got {request.timeout_s}", request.id)
    return request


def decode_reply(frame: bytes) -> ScoreReply:
    return _replies.decode(frame)


def _id_of(frame: bytes) -> int | None:
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None
