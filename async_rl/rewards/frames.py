"""Messages between an actor and its reward workers over a pipe: a 4-byte length, then
one MessagePack map (msgspec). Nothing is pickled: a worker runs user code, and what
it says back is read as data."""
from __future__ import annotations

import os
import struct
from collections import deque
from typing import Any

import msgspec
import numpy as np

_LENGTH = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a request carries one response and its row's fields


def _encodable(value: Any) -> Any:
    """Row fields as MessagePack holds them: numpy arrays and scalars as lists and numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"a {type(value).__name__} cannot travel to a reward worker")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encodable)
_decoder = msgspec.msgpack.Decoder()


def encode(message: dict) -> bytes:
    """`message` framed; NotImplementedError for a value MessagePack cannot hold."""
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def write(fd: int, frame: bytes) -> None:
    view = memoryview(frame)
    while view:
        view = view[os.write(fd, view):]


class FrameReader:
    """Messages from a pipe, as many as one read brings: a worker answers call by call,
    and taking its answers a batch at a time keeps the cost per call low."""

    def __init__(self, fd: int) -> None:
        self.fd, self.closed = fd, False
        self._buffer, self._ready = bytearray(), deque()

    def fill(self) -> None:
        """One read of what the pipe holds (blocking while it holds nothing); `closed` at
        its end."""
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.closed = True
            return
        self._buffer += chunk
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_FRAME:
                raise ValueError(f"a frame of {length} bytes is over the limit of {MAX_FRAME}")
            end = _LENGTH.size + length
            if len(self._buffer) < end:
                break
            message = _decoder.decode(memoryview(self._buffer)[_LENGTH.size:end])
            del self._buffer[:end]
            if not isinstance(message, dict):
                raise ValueError(f"expected a map, got {type(message).__name__}")
            self._ready.append(message)

    def messages(self) -> list[dict]:
        """The messages read so far, taken."""
        out = list(self._ready)
        self._ready.clear()
        return out

    def next(self) -> dict | None:
        """The next message, waiting for it; None once the pipe has closed."""
        while not self._ready and not self.closed:
            self.fill()
        return self._ready.popleft() if self._ready else None
