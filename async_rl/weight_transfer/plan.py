"""Bucket layout shared by both ends of the weight sync, and the receiver-side trick
that makes it free: parameters re-homed as views of the bucket storage."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterable

import torch

Spec = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of one parameter, in send order


@dataclass(frozen=True)
class BucketEntry:
    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    numel: int
    entries: tuple[BucketEntry, ...]


def plan_buckets(specs: Iterable[Spec], bucket_bytes: int) -> list[Bucket]:
    """Pack parameters, in order, into flat same-dtype buckets of at most `bucket_bytes`
    (a tensor larger than that gets a bucket of its own)."""
    buckets: list[Bucket] = []
    open_: dict[torch.dtype, list[BucketEntry]] = {}
    sizes: dict[torch.dtype, int] = {}

    def close(dtype: torch.dtype) -> None:
        if open_.get(dtype):
            buckets.append(Bucket(dtype, sizes[dtype], tuple(open_[dtype])))
        open_[dtype], sizes[dtype] = [], 0

    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= d
        item = torch.empty((), dtype=dtype).element_size()
        if open_.get(dtype) and (sizes[dtype] + numel) * item > bucket_bytes:
            close(dtype)
        open_.setdefault(dtype, [])
        sizes.setdefault(dtype, 0)
        open_[dtype].append(BucketEntry(name, sizes[dtype], numel, tuple(shape)))
        sizes[dtype] += numel
    for dtype in list(open_):
        close(dtype)
    return buckets


# The broadcaster sends bucket i while publish copies bucket i+1, so the copy of the
# first bucket is the one cost nothing hides. A model of one or two `sync.bucket_mb`
# buckets would pay most of its copy unhidden (analysis/bench_sync.py measures it); it
# gets smaller buckets instead, at least PIPELINE_BUCKETS of them, none under
# MIN_PIPELINE_BUCKET_BYTES (below that a collective's fixed cost outweighs the overlap).
PIPELINE_BUCKETS = 4
MIN_PIPELINE_BUCKET_BYTES = 2**20


def sync_bucket_bytes(specs: Iterable[Spec], bucket_mb: float) -> int:
    """The bucket size both ends of a torch-engine sync plan with: `sync.bucket_mb`, or
    less for a model too small to fill PIPELINE_BUCKETS of them."""
    limit = int(bucket_mb * 2**20)
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    return max(min(limit, math.ceil(total / PIPELINE_BUCKETS)), min(limit, MIN_PIPELINE_BUCKET_BYTES))


def plan_packed(specs: Iterable[Spec], buffer_bytes: int) -> list[Bucket]:
    """vLLM's packed wire layout (its packed_tensor.py): uint8 chunks, tensors of any dtype
    concatenated in order, a chunk closing right *after* the tensor that takes it past
    `buffer_bytes`. Entry offsets and sizes are in bytes. The learner fills these
    buckets directly when its actors run vLLM, so no packing copy is needed."""
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    total = 0
    for name, shape, dtype in specs:
        size = math.prod(shape) * dtype.itemsize
        entries.append(BucketEntry(name, total, size, tuple(shape)))
        total += size
        if total > buffer_bytes:
            buckets.append(Bucket(torch.uint8, total, tuple(entries)))
            entries, total = [], 0
    if entries:
        buckets.append(Bucket(torch.uint8, total, tuple(entries)))
    return buckets


def layout_id(specs: Iterable[Spec], buffer_bytes: int) -> str:
    """Short fingerprint of a packed wire layout (shapes, dtypes, buffer size; not names,
    which may differ by a wrapper prefix): a vLLM member announces its own, and rank 0
    refuses a mismatch, which NCCL would otherwise turn into a hang or garbage."""
    text = ";".join(f"{tuple(shape)}:{dtype}" for _, shape, dtype in specs) + f"|{buffer_bytes}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def allocate_buckets(plan: list[Bucket], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(b.numel, dtype=b.dtype, device=device) for b in plan]


def alias_into_buckets(params: dict[str, torch.Tensor], plan: list[Bucket]) -> list[torch.Tensor]:
    """Move every parameter's values into fresh per-bucket flat tensors and make the
    parameter a view of its slice (`param.data = ...`: the same Python object, so the
    module, and every module sharing a tied parameter, sees it). A broadcast into the
    bucket then lands directly in the parameters: no receive buffer, no copy-out.
    The old storage is freed, so this costs no memory beyond one bucket's worth at a time."""
    buckets = []
    with torch.no_grad():
        for bucket in plan:
            device = params[bucket.entries[0].name].device
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            for e in bucket.entries:
                param = params[e.name]
                view = flat[e.offset:e.offset + e.numel].view(e.shape)
                view.copy_(param)
                param.data = view
            buckets.append(flat)
    return buckets
