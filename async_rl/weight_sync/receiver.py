"""An actor's side of the weight sync.

The parameters are re-homed at construction as views of persistent per-bucket flat
tensors (plan.alias_into_buckets). By default a broadcast, whether it comes down the
gloo chain (and is forwarded from there) or by NCCL or gloo broadcast, lands in a second
set of buckets and is copied into the parameters only once every bucket has arrived:
a broadcast that breaks off midway (a peer actor killed, a timeout) then leaves the
parameters on the last complete version, and the survivors keep generating with them
instead of waiting, idle, for the next sync. The price is one more copy of the weights
in the actor's memory and a memcpy per sync; `sync.stage_on_actors=false` saves both
for a model that barely fits, and then receives straight into the parameters. An actor
on the learner's own GPU copies from the learner's mapped buckets instead (CUDA IPC).
"""
from __future__ import annotations

import datetime
import traceback

import msgpack
import torch
import torch.distributed as dist

from . import cuda_ipc
from .plan import alias_into_buckets, plan_buckets, sync_bucket_bytes
from .rendezvous import (COLLECTIVE, CUDA_IPC, SyncAbandoned, arrived_key, broadcast, broadcast_async, decision_key,
                         new_group, parse_decision, poll_store, wait_all)
from .schedule import chained, receive_chain
from .transports import TRANSPORT_KEY, own_choice


class WeightReceiver:
    """Joins each epoch's group and receives every bucket of a sync.

    `staged` (sync.stage_on_actors, the default): the collective paths receive into
    `self.staging`, a second set of buckets allocated once here, forward down the chain
    from there, and copy into the live buckets (the parameters) only once all have
    arrived. A broadcast that breaks off raises and leaves the parameters untouched, so
    `intact` stays True and the actor keeps generating on its last complete version.

    Unstaged: every bucket lands straight in the parameters. A broadcast that breaks off
    leaves some of them new and some old (a bucket may even be half written): `intact`
    is then False until a broadcast completes, and the actor must not generate with them.

    The CUDA-IPC path is never staged: it is one local device-to-device copy with no
    network peer that could die halfway through it.
    """

    def __init__(self, params: list[tuple[str, torch.Tensor]], *, bucket_mb: float, backend: str, timeout_s: float,
                 staged: bool = True):
        self.params = dict(params)
        specs = [(n, tuple(p.shape), p.dtype) for n, p in params]
        self.plan = plan_buckets(specs, sync_bucket_bytes(specs, bucket_mb))
        self.buckets = alias_into_buckets(self.params, self.plan)
        # Allocated once: a sync must not fail (or fragment the allocator) for want of memory.
        self.staging = [torch.empty_like(flat) for flat in self.buckets] if staged else None
        self.device = self.buckets[0].device if self.buckets else torch.device("cpu")
        # `backend` (the actor's own guess) is kept for the engines' common receiver
        # interface; the group's backend is rank 0's, read from its store entry.
        self.backend, self.timeout_s = backend, timeout_s
        self.transport: str | None = None  # gloo | nccl | cuda_ipc, decided from rank 0's store entry
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._epoch = -1
        self._group_rank = self._world = 0  # this member's rank in the epoch's group, and its size
        self._ipc_sources: dict[int, list[torch.Tensor]] = {}  # the learner's bucket sets, mapped once
        self._ipc_seq = 0
        self.intact = True  # the parameters hold one complete version

    def receive(self, *, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        try:
            self._receive(epoch, rank, store_host, store_port)
        except Exception as err:
            # The group may be broken (a member gone, a collective half done): never reuse
            # it. Dropping it also closes its connections, releasing peers still waiting,
            # but only once nothing else holds it: the frames in the traceback of an
            # exception the caller keeps would (with the pending transfers).
            self._group, self._epoch = None, -1
            traceback.clear_frames(err.__traceback__)
            raise

    def _receive(self, epoch: int, rank: int, store_host: str, store_port: int) -> None:
        if self._store is None or (self._store.host, self._store.port) != (store_host, store_port):
            store = dist.TCPStore(store_host, store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            self.transport = own_choice(store.get(TRANSPORT_KEY), self.device)  # raises on a bad combination
            self._store, self._ipc_sources = store, {}
        if epoch != self._epoch:
            self._join(epoch, rank)
        if self.transport == "cuda_ipc":
            self._copy_from_learner(epoch, rank)
            return
        staged = self.staging is not None
        target = self.staging if staged else self.buckets
        if not staged:
            self.intact = False  # from the first byte on: a broken-off bucket is half written
        if chained(self.transport, len(self.buckets), self._world):
            # A failed forward also fails the sync: this member has every bucket, but rank 0
            # does not count the sync, so it must not label what it generates with the new
            # version. Unstaged, that leaves intact False; staged, the old version stays.
            receive_chain(self._group, target, rank=self._group_rank, world=self._world, timeout_s=self.timeout_s)
        elif self.device.type == "cuda":  # queued on the stream; the host waits once, with a timeout
            wait_all([broadcast_async(self._group, flat) for _, flat in zip(self.plan, target)], self.timeout_s)
        else:  # one at a time: queueing them all measured no faster on CPU (bench_sync.py)
            for _, flat in zip(self.plan, target):
                broadcast(self._group, flat)
        if staged:
            # Only a local copy can fail from here on (a device error), but it would
            # leave a mix of two versions like a broken-off broadcast does.
            self.intact = False
            for live, flat in zip(self.buckets, self.staging):
                live.copy_(flat)
            if self.device.type == "cuda":  # complete before the sync is reported done
                torch.cuda.current_stream(self.device).synchronize()
        self.intact = True

    def _join(self, epoch: int, rank: int) -> None:
        self._group = None
        store = self._store
        store.set(arrived_key(epoch, rank), CUDA_IPC if self.transport == "cuda_ipc" else COLLECTIVE)
        # Rank 0 decides within its own timeout, which started before this member arrived.
        poll_store(store, [decision_key(epoch)], self.timeout_s)
        collective = parse_decision(store.get(decision_key(epoch)))
        if collective is None:
            raise SyncAbandoned(f"rank 0 abandoned epoch {epoch}")
        if self.transport != "cuda_ipc":
            if rank not in collective:
                raise RuntimeError(f"rank 0's decision for epoch {epoch} leaves this member (rank {rank}) out")
            self._group_rank, self._world = collective.index(rank) + 1, len(collective) + 1
            self._group = new_group(self.transport, store, epoch, self._group_rank, self._world, self.timeout_s)
        self._epoch, self._ipc_seq = epoch, 0

    def _copy_from_learner(self, epoch: int, rank: int) -> None:
        """Copy, device to device, from the learner's bucket set that rank 0 names."""
        seq = self._ipc_seq + 1
        poll_store(self._store, [cuda_ipc.ready_key(epoch, seq)], self.timeout_s)
        order = msgpack.unpackb(self._store.get(cuda_ipc.ready_key(epoch, seq)), raw=False, max_map_len=2,
                                max_str_len=16)
        if not isinstance(order, dict) or order.get("set") not in (0, 1):
            raise ValueError("malformed CUDA-IPC order in the sync store")
        if order["set"] not in self._ipc_sources:
            entries = cuda_ipc.unpack(self._store.get(cuda_ipc.handles_key(order["set"])), self.plan)
            self._ipc_sources[order["set"]] = [cuda_ipc.open_bucket(e, b, self.device)
                                               for e, b in zip(entries, self.plan)]
        self.intact = False
        for flat, source in zip(self.buckets, self._ipc_sources[order["set"]]):
            flat.copy_(source, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()  # done before rank 0 may reuse the set
        self._ipc_seq = seq
        self._store.set(cuda_ipc.done_key(epoch, seq, rank), "1")
        self.intact = True
