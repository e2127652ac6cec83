"""What the sync store holds: its keys, and their values as typed MessagePack records.

Learner rank 0 hosts a TCPStore that every member reaches (`transport.store_port`).
Members write into it too, so every value read from it is network input: it is
decoded with a strict msgspec decoder (exact types, no unknown fields, bounded sizes,
never pickle), and a malformed value raises `ValueError` naming what was malformed.

    transport                    LearnerInfo   rank 0's transport, backend and identity
    arrived/<epoch>/<rank>       Arrival       a member is there, and how it receives
    decision/<epoch>             Go | Abandon  rank 0's decision for the epoch
    sync/<epoch>/...             (torch)       the epoch's process group (collective.py)
    ipc/handles/<set>            IpcHandles    one bucket set's CUDA-IPC handles
    ipc/<epoch>/<seq>            IpcOrder      "copy this set now"
    ipc/<epoch>/<seq>/done/<r>   (empty)       member r copied it; the key is the message
"""
from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

Rank = Annotated[int, Meta(ge=1)]  # a member's rank in its epoch; rank 0 is the learner
Count = Annotated[int, Meta(ge=0)]
Transport = Literal["gloo", "nccl", "cuda_ipc", "vllm"]


class _Record(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class LearnerInfo(_Record):
    """Rank 0's entry: the configured `sync.transport`, its group's backend, and its own
    host and GPU, from which each actor decides how it receives (transports.py)."""
    transport: Literal["auto", "gloo", "nccl", "cuda_ipc"]
    backend: Literal["gloo", "nccl"]
    host: Annotated[str, Meta(max_length=255)]
    gpu: Annotated[str, Meta(max_length=64)] | None  # the GPU's UUID; None on CPU


class Arrival(_Record):
    """A member announces itself: the transport it receives by and, for vLLM, its NCCL
    ranks per engine and the fingerprint of the wire layout it expects (plan.layout_id)."""
    transport: Transport
    workers: Annotated[int, Meta(ge=1, le=4096)] = 1
    layout: Annotated[str, Meta(pattern="^[0-9a-f]{1,64}$")] | None = None


class Group(_Record):
    """The members one transport serves in an epoch. A member's rank in the transport's
    group is 1 + its index in `ranks` (rank 0 is the learner); `port` is where the group
    meets when not in rank 0's store (vLLM's own rendezvous)."""
    ranks: tuple[Rank, ...]
    port: Annotated[int, Meta(gt=0, lt=65536)] | None = None


class Go(_Record, tag="go"):
    groups: dict[Transport, Group]


class Abandon(_Record, tag="abandon"):
    reason: Annotated[str, Meta(max_length=1000)]


Decision = Go | Abandon


class IpcBucket(_Record):
    """One bucket's storage as `UntypedStorage._share_cuda_()` describes it, plus the
    bucket's place in that storage."""
    device: Count
    handle: Annotated[bytes, Meta(max_length=4096)]
    size_bytes: Count
    offset_bytes: Count
    ref_counter_handle: Annotated[bytes, Meta(max_length=4096)]
    ref_counter_offset: Count
    event_handle: Annotated[bytes, Meta(max_length=4096)] | None
    event_sync_required: bool
    tensor_offset: Count
    numel: Count
    dtype: Annotated[str, Meta(max_length=32)]


class IpcHandles(_Record):
    buckets: tuple[IpcBucket, ...]


class IpcOrder(_Record):
    """Rank 0 has filled bucket set `bucket_set` with `version`; copy it, then say done."""
    bucket_set: Annotated[int, Meta(ge=0, le=1)]
    version: Count


LEARNER_KEY = "transport"


def arrived_key(epoch: int, rank: int) -> str:
    return f"arrived/{epoch}/{rank}"


def decision_key(epoch: int) -> str:
    return f"decision/{epoch}"


def group_prefix(epoch: int) -> str:
    return f"sync/{epoch}/"


def ipc_handles_key(bucket_set: int) -> str:
    return f"ipc/handles/{bucket_set}"


def ipc_order_key(epoch: int, seq: int) -> str:
    return f"ipc/{epoch}/{seq}"


def ipc_done_key(epoch: int, seq: int, rank: int) -> str:
    return f"ipc/{epoch}/{seq}/done/{rank}"


def encode(record: Struct) -> bytes:
    return msgspec.msgpack.encode(record)


T = TypeVar("T")
_decoders: dict[object, msgspec.msgpack.Decoder] = {}


def decode(kind: type[T], raw: bytes, what: str) -> T:
    """`raw` as a `kind` record, or ValueError("malformed <what> in the sync store: ...")."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(raw)
    except ValueError as err:  # msgspec.DecodeError, and UnicodeDecodeError for text that is not UTF-8
        raise ValueError(f"malformed {what} in the sync store: {err}") from None
