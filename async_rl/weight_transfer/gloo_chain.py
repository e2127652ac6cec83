"""The gloo transport (CPU): the buckets go down a pipelined chain of the members.

Rank 0 sends bucket i to rank 1 while rank 1 forwards bucket i-1 to rank 2, and so on
down the ranks. Every member posts all its receives up front, so a bucket never waits
for its receiver to come back from Python. The last member acknowledges with one byte
to rank 0, so rank 0 counts a sync as complete only once the whole chain has it. If a
member dies, the members after it see their receives fail. The member before it sees
its forward fail, unless its sends were already written to the socket, and rank 0
misses the acknowledgement.

Why not gloo's broadcast per bucket: it is a binomial tree and is not pipelined. Rank
0 writes every byte once per child, all from one thread, and on loopback that thread
is the bottleneck. In a chain every process writes each byte at most once, and the
writes run in parallel (benchmarks/bench_sync.py; docs/scale.md has the figures).

The price is pipeline fill: the last member starts (world - 2) bucket times after the
first. `chained` takes the chain only when that costs less than the tree's extra writes
from rank 0 (ceil(log2(world)) per byte); otherwise, and for a single bucket, the
buckets go one broadcast each (groups.py).

Buckets on a GPU (a GPU learner, or GPU actors, with `sync.transport=gloo`) pass
through host memory on both ends; its test needs CUDA (the GPU check runs it).
"""
from __future__ import annotations

import datetime
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from async_rl.weight_transfer.buckets import BucketSet
from async_rl.weight_transfer.groups import CollectiveReceiver, CollectiveSender, wait_all
from async_rl.weight_transfer.protocol import Transport


def chained(buckets: int, world: int) -> bool:
    """Whether a sync of `buckets` buckets to a group of `world` ranks (rank 0 included)
    travels down a chain. Both ends call this with the same numbers, so they agree."""
    if world < 2 or buckets < 2:  # one bucket: nothing to pipeline
        return False
    fill = world - 2  # bucket times before the last member gets its first bucket
    return buckets + fill <= buckets * math.ceil(math.log2(world))


def send_chain(group: dist.ProcessGroup, tensors: list[torch.Tensor], *, world: int,
               wait_ready: Callable[[int], None], timeout_s: float) -> None:
    """Rank 0's part: each bucket to rank 1 as soon as it is ready, then the last
    member's acknowledgement."""
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("send_chain: gloo's point-to-point ops take host tensors only")
    ack = torch.zeros(1, dtype=torch.uint8)
    ack_work = group.recv([ack], world - 1, len(tensors))
    sends = []
    for i, tensor in enumerate(tensors):
        wait_ready(i)
        sends.append(group.send([tensor], 1, i))
    wait_all(sends, timeout_s)
    await_bucket(ack_work, timeout_s)


def receive_chain(group: dist.ProcessGroup, tensors: list[torch.Tensor], *, rank: int, world: int,
                  timeout_s: float, landed: Callable[[int], None] | None = None) -> None:
    """A member's part: receive every bucket from rank - 1 into `tensors` and forward
    each one to rank + 1 as soon as it has arrived (then `landed(i)`, while the next
    arrive). gloo's point-to-point ops read and write raw host pointers (its broadcast
    stages device tensors, they do not), so buckets on a GPU go through host buffers."""
    host = [t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    receives = [group.recv([h], rank - 1, i) for i, h in enumerate(host)]
    sends = []
    last = rank == world - 1
    for i, (tensor, h) in enumerate(zip(tensors, host)):
        await_bucket(receives[i], timeout_s)
        if h is not tensor:
            tensor.copy_(h)
        if not last:
            sends.append(group.send([h], rank + 1, i))
        if landed is not None:
            landed(i)
    if last:
        sends.append(group.send([torch.ones(1, dtype=torch.uint8)], 0, len(tensors)))
    wait_all(sends, timeout_s)


def await_bucket(work: dist.Work, timeout_s: float) -> None:
    """Wait for one point-to-point transfer; a dead peer raises at once, since its
    connection closes."""
    work.wait(datetime.timedelta(seconds=timeout_s))


class GlooChainSender(CollectiveSender):
    backend = "gloo"

    def send(self, source: BucketSet) -> None:
        if chained(len(source.tensors), self.world):
            send_chain(self.group, source.tensors, world=self.world, wait_ready=source.wait_ready,
                       timeout_s=self.side.timeout_s)
        else:
            super().send(source)


class GlooChainReceiver(CollectiveReceiver):
    backend = "gloo"

    def receive(self, landed: Callable[[int], None] | None = None) -> None:
        if chained(len(self.target), self.world):
            # A failed forward also fails the sync: this member has every bucket, but rank 0
            # does not count the sync, so it must not label what it generates with the new
            # version. Unstaged, that leaves the receiver not intact; staged, the old version stays.
            receive_chain(self.group, self.target, rank=self.rank, world=self.world, timeout_s=self.side.timeout_s,
                          landed=landed)
        else:
            super().receive(landed)


TRANSPORT = Transport("gloo", GlooChainSender, GlooChainReceiver)
