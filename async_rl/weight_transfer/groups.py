"""A torch process group per membership epoch, and one broadcast per bucket over it.

The actors are not members of the torchrun world, so every epoch gets a group of its
own: rank 0 is the learner, ranks 1..k the members of the transport's `Group`, in its
order; it rendezvouses in rank 0's store under `sync/<epoch>/`, after the handshake
(store.py). `CollectiveSender` and `CollectiveReceiver` are the two ends of such a
group, sending one broadcast per bucket, then `all_arrived`, so that rank 0 counts a
sync only once every member has it; the gloo and NCCL transports build on them
(gloo_chain.py, nccl.py).
"""
from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

from async_rl.weight_transfer.buckets import BucketSet
from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.protocol import Landing, ReceiverContext, SenderContext
from async_rl.weight_transfer.store import Arrival, Group, group_prefix


def new_group(backend: str, store: dist.Store, epoch: int, rank: int, world: int,
              timeout_s: float) -> dist.ProcessGroup:
    """A process group outside the default (torchrun) world, one per membership epoch."""
    prefixed = dist.PrefixStore(group_prefix(epoch), store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options._timeout = timeout  # the watchdog aborts a collective stuck on a dead peer
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    broadcast_async(group, tensor).wait()


def all_arrived(group: dist.ProcessGroup, device: torch.device) -> dist.Work:
    """Every rank's word that the sync's broadcasts are done on its side: rank 0's own
    broadcast completes once its sends are out, before a member down the tree has its
    copy. Without this, rank 0 would take up the next version, the hub would order that
    version, and a late member would receive the previous one under its label."""
    return group.allreduce([torch.zeros(1, dtype=torch.int32, device=device)])


def wait_all(works: list[dist.Work], timeout_s: float) -> None:
    """Block the host until the last collective is done, or raise after `timeout_s`.
    A CUDA work's plain wait() only orders the current stream after it; the host must
    know the buckets are free (double buffering) and that the parameters are complete.
    Works of one group run in order, so waiting for the last is waiting for all."""
    for work in works[:-1]:
        work.wait()
    if works:
        works[-1].wait(datetime.timedelta(seconds=timeout_s))


class CollectiveSender:
    """Rank 0's end: one broadcast per bucket, each once its bucket is filled; on CUDA
    queued on the side stream behind that bucket's copy-in; then `all_arrived`."""

    backend = ""

    def __init__(self, side: SenderContext):
        self.side = side
        self.group: dist.ProcessGroup | None = None
        self.world = 0  # ranks in the group, rank 0 included
        self._epoch = -1

    def prepare(self, epoch: int, arrivals: dict[int, Arrival]) -> Group:
        self._epoch, self.world = epoch, len(arrivals) + 1
        return Group(tuple(sorted(arrivals)))

    def connect(self) -> None:
        self.group = new_group(self.backend, self.side.store, self._epoch, 0, self.world, self.side.timeout_s)

    def send(self, source: BucketSet) -> None:
        # The group of this send, held: a send left behind by an abandoned epoch must not
        # go on into the next epoch's group once `self.group` is replaced.
        group = self.group
        works = []
        stream = self.side.side_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, tensor in enumerate(source.tensors):
                source.wait_ready(i)
                if source.events is not None:
                    stream.wait_event(source.events[i])  # the copy-in, not the whole learner stream
                works.append(broadcast_async(group, tensor))
                if source.events is None:  # host buckets: one at a time (queueing them all measured no faster)
                    works.pop().wait()
            works.append(all_arrived(group, self.side.device if source.events is not None else torch.device("cpu")))
            wait_all(works, self.side.timeout_s)

    def disconnect(self) -> None:
        self.group = None


class CollectiveReceiver:
    """A member's end: every bucket by broadcast, into the staging buckets when the
    receiver stages (the caller then copies them into the live ones), else the live ones."""

    backend = ""

    def __init__(self, side: ReceiverContext, place: Landing):
        self.side, self.device = side, place.device
        self.staged = place.staging is not None
        self.target = place.staging if place.staging is not None else place.live
        self.group: dist.ProcessGroup | None = None
        self.rank = self.world = 0  # this member's rank in the group, and the group's size

    def arrival(self) -> Arrival:
        return Arrival(self.backend)

    def join(self, epoch: int, rank: int, group: Group) -> None:
        self.group = None
        self.rank, self.world = group.ranks.index(rank) + 1, len(group.ranks) + 1
        self.group = new_group(self.backend, self.side.store, epoch, self.rank, self.world, self.side.timeout_s)

    def receive(self, landed: Callable[[int], None] | None = None) -> None:
        group = self.group  # held: a receive left behind must not go on into another group
        if self.device.type == "cuda":  # queued on the stream; the host waits once, with a timeout
            works = [broadcast_async(group, flat) for flat in self.target]
            wait_all([*works, all_arrived(group, self.device)], self.side.timeout_s)
            for i in range(len(self.target) if landed is not None else 0):
                landed(i)
            return
        for i, flat in enumerate(self.target):  # one at a time: queueing them all measured no faster on CPU
            if group is not self.group:  # left (abandoned): stop here
                raise SyncAbandoned("the member left this group")
            broadcast(group, flat)
            if landed is not None:
                landed(i)
        all_arrived(group, self.device).wait(datetime.timedelta(seconds=self.side.timeout_s))

    def leave(self) -> None:
        self.group = None
