"""Buckets: the layout both ends of a sync share, the receiver-side trick that makes it
free (parameters re-homed as views of the bucket storage), and rank 0's bucket sets,
which `publish` fills while the sender's thread sends another.

Double buffering (`sync.double_buffer`, the default): `fill` writes the set that is not
being sent and returns without waiting for actors; the thread takes up the newest
filled set (`take_newest`) and sends it while training goes on. With one set (one full
copy of the weights less on rank 0), `fill` first waits until no broadcast reads it.
Either way filling and sending overlap bucket by bucket: the thread may take up a set
that is still being filled and send bucket i as soon as it is complete
(`BucketSet.wait_ready`), while bucket i+1 is being gathered and copied.

On CUDA the copy into bucket i runs on the learner's stream and records the bucket's
event; a transport sending from a side stream waits on that event, not on the whole
learner stream, so gathering, copying and sending overlap on the GPU as well.

Verified syncs: `fill` also takes each bucket's fingerprint sums (fingerprint.py) as
soon as it is complete, while its bytes are still in the cache, before marking it ready.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from async_rl.weight_transfer.errors import SyncAbandoned

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


# The sender sends bucket i while publish copies bucket i+1, so the copy of the
# first bucket is the one cost nothing hides. A model of one or two `sync.bucket_mb`
# buckets would pay most of its copy unhidden (benchmarks/bench_sync.py measures it); it
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


class BucketSet:
    """One full copy of the weights in buckets, with its per-bucket fill state."""

    def __init__(self, index: int, plan: list[Bucket], device: torch.device, owner: BucketSets):
        self.index = index
        self.tensors = allocate_buckets(plan, device)
        self.ready = [True] * len(plan)  # guarded by owner.cond
        self.broken = False  # a fill raised midway: never send this content
        self.version: int | None = None
        self.sums: list[torch.Tensor | None] = [None] * len(plan)  # each bucket's fingerprint sums, once ready
        self.events = [torch.cuda.Event() for _ in plan] if device.type == "cuda" else None
        self._owner = owner

    def wait_ready(self, i: int) -> None:
        """Return once bucket i is filled (and, on CUDA, its event recorded); raise if the
        fill broke off, the sets were closed, or nothing came within the timeout."""
        self._owner.wait_ready(self, i)


class BucketSets:
    def __init__(self, plan: list[Bucket], device: torch.device, *, count: int, timeout_s: float,
                 wire_dtype: dict[str, torch.dtype] | None = None,
                 take_sums: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
        """`take_sums(i, bucket)`: bucket i's fingerprint sums (verified syncs)."""
        self.plan, self.timeout_s = plan, timeout_s
        self._take_sums = take_sums
        # Also the sender's: one condition wakes its thread for new weights and new members alike.
        self.cond = threading.Condition()
        self.sets = [BucketSet(i, plan, device, self) for i in range(count)]
        self._slot = {e.name: (i, e) for i, b in enumerate(plan) for e in b.entries}
        self._wire_dtype = wire_dtype  # vLLM's packed layout: each tensor's bytes, in its spec dtype
        self._send_idx = 0  # the set being (or last) sent; `fill` writes the next one
        self.pending: int | None = None  # the version filled (or being filled) and not yet taken up
        self.sent: int | None = None  # the version of the set last taken up
        self.reading = False  # a broadcast reads the current set (set by the sender)
        self.closed = False

    @property
    def current(self) -> BucketSet:
        return self.sets[self._send_idx]

    def has_new(self) -> bool:
        return self.pending is not None and self.pending != self.sent

    def take_newest(self) -> None:
        """Make the newest filled set the current one. Call with `cond` held."""
        if self.has_new():
            self._send_idx = (self._send_idx + 1) % len(self.sets)
            self.sent, self.pending = self.pending, None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def fill(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> BucketSet:
        """Copy full tensors into the free set, which it returns. With one set, first waits
        until no broadcast reads it (a broadcast takes at most its members' arrival plus
        the transfer, each bounded by the sync timeout)."""
        with self.cond:
            while len(self.sets) == 1 and self.reading and not self.closed:
                self.cond.wait(timeout=0.5)
            target = self.sets[(self._send_idx + 1) % len(self.sets)]  # never a set a broadcast is reading
            target.ready = [False] * len(self.plan)
            target.sums = [None] * len(self.plan)
            target.broken, target.version = False, version
            self.pending = version
            self.cond.notify_all()
        missing = [b.numel for b in self.plan]
        try:
            for name, tensor in named_tensors:
                i, entry = self._slot[name]
                flat = tensor.reshape(-1)
                if self._wire_dtype is not None:
                    flat = flat.to(self._wire_dtype[name]).view(torch.uint8)
                target.tensors[i][entry.offset:entry.offset + entry.numel].copy_(flat)
                missing[i] -= entry.numel
                if missing[i] == 0:
                    self._mark_ready(target, i)
        except BaseException:
            with self.cond:
                target.broken = True
                if self.current is not target:  # not taken up yet: withdraw it
                    self.pending = None
            raise
        finally:  # buckets of names never given keep their old values; wake the thread either way
            for i in range(len(self.plan)):
                if missing[i] > 0:
                    self._mark_ready(target, i)
        return target

    def _mark_ready(self, target: BucketSet, i: int) -> None:
        if self._take_sums is not None:
            target.sums[i] = self._take_sums(i, target.tensors[i])
        if target.events is not None:
            target.events[i].record()  # on the learner's stream, after the copies into bucket i
        with self.cond:
            target.ready[i] = True
            self.cond.notify_all()

    def wait_ready(self, source: BucketSet, i: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while not source.ready[i] and not self.closed:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bucket {i} was not filled within {self.timeout_s:.0f}s")
                self.cond.wait(timeout=0.5)
            if self.closed:
                raise SyncAbandoned("stopping")
            if source.broken:
                raise RuntimeError("the publish of this version broke off; its buckets are incomplete")
