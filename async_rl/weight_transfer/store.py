"""The sync store: what it holds, the handshake that opens every membership epoch, and
the abandon record that releases a broadcast a dropped member holds up.

Learner rank 0 hosts a TCPStore that every member reaches (`transport.store_port`).
Members write into it too, so every value read from it is network input: it is
decoded with a strict msgspec decoder (exact types, no unknown fields, bounded sizes,
never pickle), and a malformed value raises `ValueError` naming what was malformed.

    transport                    LearnerInfo   rank 0's transport, backend and identity
    arrived/<epoch>/<rank>       Arrival       a member is there, and how it receives
    decision/<epoch>             Go | Abandon  rank 0's decision for the epoch
    abandoned/<epoch>            (text)        rank 0 gave up a broadcast under way, and why
    sync/<epoch>/...             (torch)       the epoch's process group (groups.py)
    ipc/handles/<set>            IpcHandles    one bucket set's CUDA-IPC handles
    ipc/<epoch>/<seq>            IpcOrder      "copy this set now"
    ipc/<epoch>/<seq>/done/<r>   (empty)       member r copied it; the key is the message
    check/<version>              Fingerprint   the version's fingerprint, bucket by bucket
                                               (fingerprint.py), written by publish

The handshake, whatever the transport:
1. arrival: every member writes `arrived/<epoch>/<rank>`, an `Arrival` naming how it
   will receive;
2. decision: once all have arrived, rank 0 alone writes `decision/<epoch>`: `Go`,
   naming for each transport the members it serves, in group order, or `Abandon`;
3. group formation: each transport forms its group from the decision (a member's rank
   in it is 1 + its index in the transport's `Group.ranks`).
Why not let a transport's own rendezvous gather the members: gloo's (and NCCL's)
cannot be interrupted, so a member that died would hold everyone for the full
`sync.timeout_s`. Here rank 0 writes `Abandon` as soon as the membership changes (the
dead actor reaped, a new one joined), which releases the waiting members at once.
Rank 0 alone decides, so all members agree on who is in which group.

Abandoning a broadcast under way: a gloo transfer to a member that stopped answering
(its link cut, the process stopped) waits out the group's timeout, and nothing
interrupts it: a short `wait` timeout breaks the pair, and neither the group's
`abort()` nor dropping it releases a waiting thread (torch 2.13). So the waiting itself
is moved to a thread of its own (`run_abandonable`) and the caller polls: rank 0 gives
up as soon as the coordinator has dropped a member of the epoch, writes the epoch's
abandon record, and forms the next epoch with fresh groups; every member polls that
record while it waits, and gives up too. The threads left behind hold their old groups
until gloo's timeout releases them; what they still write goes nowhere that a later
sync reads (rank 0's members are in a new group, and a member that gave up receives
into fresh buffers from then on).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Annotated, Literal, TypeVar

import msgspec
import torch.distributed as dist
from msgspec import Meta, Struct

from async_rl.weight_transfer.errors import EpochRejected, SyncAbandoned

Rank = Annotated[int, Meta(ge=1)]  # a member's rank in its epoch; rank 0 is the learner
Count = Annotated[int, Meta(ge=0)]
Transport = Literal["gloo", "nccl", "cuda_ipc", "vllm"]


class _Record(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class LearnerInfo(_Record):
    """Rank 0's entry: the configured `sync.transport`, its group's backend, and its own
    host and GPU, from which each actor decides how it receives (transports.py);
    `verified`: every sync's fingerprint follows it (`check/...`, sync.verify)."""
    transport: Literal["auto", "gloo", "nccl", "cuda_ipc"]
    backend: Literal["gloo", "nccl"]
    host: Annotated[str, Meta(max_length=255)]
    gpu: Annotated[str, Meta(max_length=64)] | None  # the GPU's UUID; None on CPU
    verified: bool = True


class Arrival(_Record):
    """A member announces itself: the transport it receives by and, for vLLM, its NCCL
    ranks per engine and the fingerprint of the wire layout it expects (buckets.layout_id)."""
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


class Fingerprint(_Record):
    """What rank 0 sent in one sync: the version, and each bucket's chunk sums (fingerprint.py)."""
    version: Count
    buckets: Annotated[tuple[Annotated[tuple[int, ...], Meta(max_length=1 << 20)], ...], Meta(max_length=1 << 16)]


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


def check_key(version: int) -> str:
    return f"check/{version}"


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


def poll_store(store: dist.Store, keys: list[str], timeout_s: float,
               give_up: Callable[[], str | None] = lambda: None, max_pause_s: float = 0.02) -> str | None:
    """Wait until all `keys` exist (None), or until `give_up()` names a reason (returned).
    Polled rather than `store.wait`, which cannot be interrupted and logs a warning on
    timeout; raises TimeoutError after `timeout_s`. The pause between polls starts at
    0.5 ms and doubles up to `max_pause_s`: a key that comes within milliseconds (a
    CUDA-IPC copy) is seen soon after, a long wait costs few round trips."""
    deadline = time.monotonic() + timeout_s
    pause = min(0.0005, max_pause_s)
    while not store.check(keys):
        reason = give_up()
        if reason is not None:
            return reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {len(keys)} store key(s) appeared within {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(2 * pause, max_pause_s)
    return None


# -- rank 0 ------------------------------------------------------------------------

def gather_arrivals(store: dist.Store, epoch: int, members: int, timeout_s: float,
                    give_up: Callable[[], str | None]) -> dict[int, bytes]:
    """Every member's arrival as written (ranks 1..members). Abandons the epoch and
    raises SyncAbandoned as soon as `give_up()` names a reason, TimeoutError once
    `timeout_s` passed."""
    keys = [arrived_key(epoch, rank) for rank in range(1, members + 1)]
    try:
        reason = poll_store(store, keys, timeout_s, give_up)
    except TimeoutError:
        missing = sum(not store.check([key]) for key in keys)
        reason = f"{missing} of {len(keys)} member(s) did not join within {timeout_s:.0f}s"
        abandon(store, epoch, reason)
        raise TimeoutError(reason) from None
    if reason is not None:
        abandon(store, epoch, reason)
        raise SyncAbandoned(reason)
    return {rank: store.get(key) for rank, key in enumerate(keys, 1)}


def decode_arrival(rank: int, raw: bytes) -> Arrival:
    """A member's arrival (network input: strict), or EpochRejected."""
    try:
        return decode(Arrival, raw, "arrival")
    except ValueError:
        raise EpochRejected(f"rank {rank} announced itself as {raw[:40]!r}") from None


def go(store: dist.Store, epoch: int, groups: dict[str, Group]) -> None:
    store.set(decision_key(epoch), encode(Go(groups)))


def abandon(store: dist.Store, epoch: int, reason: str) -> None:
    store.set(decision_key(epoch), encode(Abandon(reason[:1000])))


# -- a member ------------------------------------------------------------------------

def join(store: dist.Store, epoch: int, rank: int, arrival: Arrival, timeout_s: float) -> Group:
    """Arrive, wait for rank 0's decision, and return the group of this member's transport.
    SyncAbandoned if rank 0 abandoned the epoch; ValueError for a malformed decision."""
    store.set(arrived_key(epoch, rank), encode(arrival))
    # Rank 0 decides within its own timeout, which started before this member arrived.
    poll_store(store, [decision_key(epoch)], timeout_s)
    decision = decode(Decision, store.get(decision_key(epoch)), "sync decision")
    if isinstance(decision, Abandon):
        raise SyncAbandoned(f"rank 0 abandoned epoch {epoch}: {decision.reason}")
    group = decision.groups.get(arrival.transport)
    if group is None or rank not in group.ranks:
        raise RuntimeError(f"rank 0's decision for epoch {epoch} leaves this member (rank {rank}) out")
    return group


POLL_S = 0.05  # how often a waiting end asks whether to give up (a store round trip for a member)


def abandoned_key(epoch: int) -> str:
    return f"abandoned/{epoch}"


def mark_abandoned(store: dist.Store, epoch: int, reason: str) -> None:
    store.set(abandoned_key(epoch), reason[:1000].encode())


def run_abandonable(work: Callable[[], None], give_up: Callable[[], str | None], name: str,
                    left_behind: list[threading.Thread]) -> None:
    """Run `work` in a thread of its own and wait for it; raise what it raised, or
    SyncAbandoned as soon as `give_up()` names a reason (the thread is then appended to
    `left_behind`, still waiting on its transfers)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as err:  # re-raised in the caller, unless it gave up
            failure.append(err)

    # Named after its caller too, so that logs and tests can tell whose transfer it is.
    thread = threading.Thread(target=target, name=f"{threading.current_thread().name}:{name}", daemon=True)
    thread.start()
    pause = 0.0005
    while True:
        thread.join(timeout=pause)
        if not thread.is_alive():
            break
        reason = give_up()
        if reason is not None:
            left_behind.append(thread)
            left_behind[:] = [t for t in left_behind if t.is_alive()]
            raise SyncAbandoned(reason)
        pause = min(2 * pause, POLL_S)
    if failure:
        raise failure[0]


def member_gives_up(store: dist.Store, epoch: int) -> Callable[[], str | None]:
    """A member's `give_up`: rank 0's abandon record for `epoch`, once written."""
    key = abandoned_key(epoch)

    def check() -> str | None:
        if store.check([key]):
            return f"rank 0 abandoned epoch {epoch}: {store.get(key).decode(errors='replace')}"
        return None
    return check
