"""The interface every weight transport implements, at both ends.

A transport is one way a sync's buckets travel from learner rank 0 to members: down a
pipelined chain on gloo (gloo_chain.py), one NCCL broadcast per bucket (nccl.py), a
device-to-device copy out of the learner's own buckets (cuda_ipc.py), vLLM's
weight-transfer group (vllm/transport.py). Each of those modules holds both ends and
names them in a `Transport`; the sender and the receivers pick one by name
(transports.py) and talk to it only through these two protocols:

    rank 0: TransportSender                     a member: TransportReceiver
                                                arrival()   how it will receive
    prepare(epoch, arrivals) -> Group           (store.py's handshake: rank 0 decides "go")
    connect()                                   join(epoch, rank, group)
    send(bucket_set)            every version   receive(landed)
    disconnect()                on failure      leave()
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: this module is the package's lowest layer
    from async_rl.weight_transfer.buckets import Bucket, BucketSet
    from async_rl.weight_transfer.store import Arrival, Group, LearnerInfo


@dataclass(frozen=True)
class SenderContext:
    """What rank 0's ends share: its store and device, and the bucket sets they send."""
    store: dist.Store
    host: str  # the store's host, where rank 0 also listens for transports with their own rendezvous
    device: torch.device
    timeout_s: float
    side_stream: Any  # torch.cuda.Stream the sends run on (CUDA), else None
    bucket_sets: list[BucketSet]
    layout: str | None = None  # fingerprint of the buckets' wire layout, where members must announce theirs


@dataclass(frozen=True)
class ReceiverContext:
    """What a member's end needs to reach rank 0, and rank 0's own store entry."""
    store: dist.Store
    store_host: str
    timeout_s: float
    learner: LearnerInfo


@dataclass(frozen=True)
class Landing:
    """Where a torch receiver's syncs land: the live buckets its parameters view, and a
    second set to receive into first (None: `sync.stage_on_actors=false`)."""
    plan: list[Bucket]
    live: list[torch.Tensor]
    staging: list[torch.Tensor] | None
    device: torch.device


class TransportSender(Protocol):
    """Rank 0's end of one transport; it lives as long as the sender and serves
    one membership epoch at a time."""

    group: Any  # the epoch's communication group; None before `connect` and where there is none

    def prepare(self, epoch: int, arrivals: dict[int, Arrival]) -> Group:
        """Before "go": check the members' arrivals (EpochRejected) and set up what they
        need to join; returns their `Group` for the decision."""
        ...

    def connect(self) -> None:
        """After "go": form the epoch's group with the members."""
        ...

    def send(self, source: BucketSet) -> None:
        """Deliver one version; each bucket once `source.wait_ready(i)` returns."""
        ...

    def disconnect(self) -> None:
        """Drop the epoch's group: closing its connections releases members still waiting."""
        ...


class TransportReceiver(Protocol):
    """A member's end of one transport, for one connection to rank 0's store."""

    group: Any
    staged: bool  # `receive` writes the staging buckets, which the caller then copies into the live ones

    def arrival(self) -> Arrival:
        ...

    def join(self, epoch: int, rank: int, group: Group) -> None:
        ...

    def receive(self, landed: Callable[[int], None] | None = None) -> None:
        """Receive one version; `landed(i)`, where given, as soon as bucket i is complete,
        so that its fingerprint is taken while the next ones arrive."""
        ...

    def leave(self) -> None:
        ...


class Transport(NamedTuple):
    name: str
    sender: Callable[[SenderContext], TransportSender]
    receiver: Callable[[ReceiverContext, Any], TransportReceiver]  # (side, where the sync lands)
