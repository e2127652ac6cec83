"""The CUDA-IPC transport, for an actor on the learner's own GPU (NCCL refuses two
ranks on one device, so such an actor cannot join an NCCL group).

Its tests need CUDA (they skip elsewhere); the GPU check (benchmarks/gpu_check.py) runs
them, and measures the sync, on one H100 and one H200 (docs/scale.md).

Rank 0 exports each bucket set's storage once per run (`UntypedStorage._share_cuda_()`,
the fields torch.multiprocessing's reductions send) as an `IpcHandles` record; an actor
maps them (`UntypedStorage._new_shared_cuda`) and copies device to device from the
mapped buckets into its own. No pickle: the fields are plain ints and bytes, checked
against the actor's own bucket plan before use. Per version, once the set's bytes are
on the device, rank 0 names the set to copy (`IpcOrder`) and holds it until every
member has said it is done, so `publish` cannot overwrite it meanwhile.

A copy is never staged: it is one local device-to-device copy, with no network peer
that could die halfway through it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from async_rl.weight_transfer.buckets import Bucket, BucketSet
from async_rl.weight_transfer.protocol import Landing, ReceiverContext, SenderContext, Transport
from async_rl.weight_transfer.store import (
    Arrival,
    Group,
    IpcBucket,
    IpcHandles,
    IpcOrder,
    decode,
    encode,
    ipc_done_key,
    ipc_handles_key,
    ipc_order_key,
    poll_store,
)

# A copy takes milliseconds: both ends poll the store for each other at least this often.
IPC_POLL_S = 0.001


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def share(tensor: torch.Tensor) -> IpcBucket:
    """The IPC description of one bucket (CUDA only). The producer keeps the storage
    alive for the run, so the consumer's mapping stays valid."""
    (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = tensor.untyped_storage()._share_cuda_()
    return IpcBucket(device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
                     event_sync_required, tensor.storage_offset(), tensor.numel(), dtype_name(tensor.dtype))


def pack(buckets: list[IpcBucket]) -> bytes:
    return encode(IpcHandles(tuple(buckets)))


def unpack(raw: bytes, plan: list[Bucket]) -> list[IpcBucket]:
    """Decode the exported buckets and check them against the receiver's bucket plan."""
    entries = decode(IpcHandles, raw, "CUDA-IPC handles").buckets
    if len(entries) != len(plan):
        raise ValueError("CUDA-IPC handles: not one entry per bucket")
    for entry, bucket in zip(entries, plan):
        if entry.dtype != dtype_name(bucket.dtype) or entry.numel != bucket.numel \
                or (entry.tensor_offset + entry.numel) * bucket.dtype.itemsize > entry.size_bytes:
            raise ValueError("CUDA-IPC handles: the learner's buckets do not match this actor's plan")
    return list(entries)


def open_bucket(entry: IpcBucket, bucket: Bucket, device: torch.device) -> torch.Tensor:
    """Map one exported bucket. `device` is this process's index of the same physical
    GPU (the learner's index may differ under another CUDA_VISIBLE_DEVICES)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(), entry.handle,
        entry.size_bytes, entry.offset_bytes, entry.ref_counter_handle, entry.ref_counter_offset,
        entry.event_handle, entry.event_sync_required)
    return torch.empty(0, dtype=bucket.dtype, device=device).set_(storage, entry.tensor_offset, (bucket.numel,))


class CudaIpcSender:
    group = None  # no communication group: the members read rank 0's memory

    def __init__(self, side: SenderContext):
        self.side = side
        self._exported = False
        self._epoch, self._ranks, self._seq = -1, (), 0

    def prepare(self, epoch: int, arrivals: dict[int, Arrival]) -> Group:
        if not self._exported:  # once per run: the buckets never move
            for bucket_set in self.side.bucket_sets:
                self.side.store.set(ipc_handles_key(bucket_set.index), pack([share(t) for t in bucket_set.tensors]))
            self._exported = True
        self._epoch, self._ranks, self._seq = epoch, tuple(sorted(arrivals)), 0
        return Group(self._ranks)

    def connect(self) -> None:
        pass

    def send(self, source: BucketSet) -> None:
        for i in range(len(source.tensors)):
            source.wait_ready(i)
        for event in source.events or ():
            event.synchronize()
        self._seq += 1
        store = self.side.store
        store.set(ipc_order_key(self._epoch, self._seq), encode(IpcOrder(source.index, source.version)))
        # No early release on a membership change: a member may still be copying.
        poll_store(store, [ipc_done_key(self._epoch, self._seq, rank) for rank in self._ranks], self.side.timeout_s,
                   max_pause_s=IPC_POLL_S)

    def disconnect(self) -> None:
        pass


class CudaIpcReceiver:
    group = None
    staged = False

    def __init__(self, side: ReceiverContext, place: Landing):
        self.side, self.place = side, place
        self._sources: dict[int, list[torch.Tensor]] = {}  # the learner's bucket sets, mapped once
        self._epoch, self._rank, self._seq = -1, 0, 0

    def arrival(self) -> Arrival:
        return Arrival("cuda_ipc")

    def join(self, epoch: int, rank: int, group: Group) -> None:
        self._epoch, self._rank, self._seq = epoch, rank, 0

    def receive(self, landed: Callable[[int], None] | None = None) -> None:
        """Copy, device to device, from the learner's bucket set that rank 0 names."""
        store, plan, device = self.side.store, self.place.plan, self.place.device
        seq = self._seq + 1
        poll_store(store, [ipc_order_key(self._epoch, seq)], self.side.timeout_s, max_pause_s=IPC_POLL_S)
        order = decode(IpcOrder, store.get(ipc_order_key(self._epoch, seq)), "CUDA-IPC order")
        if order.bucket_set not in self._sources:
            entries = unpack(store.get(ipc_handles_key(order.bucket_set)), plan)
            self._sources[order.bucket_set] = [open_bucket(e, b, device) for e, b in zip(entries, plan)]
        for flat, source in zip(self.place.live, self._sources[order.bucket_set]):
            flat.copy_(source, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()  # done before rank 0 may reuse the set
        for i in range(len(self.place.live) if landed is not None else 0):
            landed(i)
        self._seq = seq
        store.set(ipc_done_key(self._epoch, seq, self._rank), b"")

    def leave(self) -> None:
        pass


TRANSPORT = Transport("cuda_ipc", CudaIpcSender, CudaIpcReceiver)
