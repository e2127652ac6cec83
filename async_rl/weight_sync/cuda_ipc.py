"""CUDA-IPC handles for the learner's bucket storage, for actors on the learner's GPU.

The learner exports each bucket's storage once (`UntypedStorage._share_cuda_()`, the
fields torch.multiprocessing's reductions send) and writes the fields to the sync
store as msgpack; an actor opens them (`UntypedStorage._new_shared_cuda`) and then
copies device-to-device from the mapped buckets into its own. No pickle: the fields
are plain ints and bytes, checked against the actor's own bucket plan before use.
"""
from __future__ import annotations

import msgpack
import torch

from .plan import Bucket

_FIELDS = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset",
           "event_handle", "event_sync_required")


def handles_key(buffer_set: int) -> str:
    return f"ipc/handles/{buffer_set}"


def ready_key(epoch: int, seq: int) -> str:
    """Rank 0 sets it (msgpack {"set", "version"}) once the buckets are filled and synced."""
    return f"ipc/{epoch}/{seq}"


def done_key(epoch: int, seq: int, rank: int) -> str:
    return f"ipc/{epoch}/{seq}/done/{rank}"


def share(tensor: torch.Tensor) -> dict:
    """The IPC description of one bucket (CUDA only). The producer keeps the storage
    alive for the run, so the consumer's mapping stays valid."""
    fields = dict(zip(_FIELDS, tensor.untyped_storage()._share_cuda_()))
    return {**fields, "tensor_offset": tensor.storage_offset(), "numel": tensor.numel(),
            "dtype": str(tensor.dtype).removeprefix("torch.")}


def pack(entries: list[dict]) -> bytes:
    return msgpack.packb(entries, use_bin_type=True)


def unpack(raw: bytes, plan: list[Bucket]) -> list[dict]:
    """Decode and validate the exported entries against the receiver's bucket plan."""
    entries = msgpack.unpackb(raw, raw=False, max_array_len=len(plan), max_map_len=len(_FIELDS) + 3,
                              max_bin_len=65536, max_str_len=64)
    if not isinstance(entries, list) or len(entries) != len(plan):
        raise ValueError("CUDA-IPC handles: not one entry per bucket")
    for entry, bucket in zip(entries, plan):
        if not isinstance(entry, dict) or set(entry) != {*_FIELDS, "tensor_offset", "numel", "dtype"}:
            raise ValueError("CUDA-IPC handles: malformed entry")
        ints = ("device", "size_bytes", "offset_bytes", "ref_counter_offset", "tensor_offset", "numel")
        if not all(isinstance(entry[k], int) and entry[k] >= 0 for k in ints):
            raise ValueError("CUDA-IPC handles: malformed entry")
        if not isinstance(entry["handle"], bytes) or not isinstance(entry["ref_counter_handle"], bytes) \
                or not isinstance(entry["event_handle"], (bytes, type(None))) \
                or not isinstance(entry["event_sync_required"], bool):
            raise ValueError("CUDA-IPC handles: malformed entry")
        item = bucket.dtype.itemsize
        if entry["dtype"] != str(bucket.dtype).removeprefix("torch.") or entry["numel"] != bucket.numel \
                or (entry["tensor_offset"] + entry["numel"]) * item > entry["size_bytes"]:
            raise ValueError("CUDA-IPC handles: the learner's buckets do not match this actor's plan")
    return entries


def open_bucket(entry: dict, bucket: Bucket, device: torch.device) -> torch.Tensor:
    """Map one exported bucket. `device` is this process's index of the same physical
    GPU (the learner's index may differ under another CUDA_VISIBLE_DEVICES)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(), entry["handle"],
        entry["size_bytes"], entry["offset_bytes"], entry["ref_counter_handle"], entry["ref_counter_offset"],
        entry["event_handle"], entry["event_sync_required"])
    return torch.empty(0, dtype=bucket.dtype, device=device).set_(storage, entry["tensor_offset"], (bucket.numel,))
