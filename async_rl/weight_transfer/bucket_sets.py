"""Rank 0's bucket sets: `publish` fills one while the broadcast thread sends another.

Double buffering (`sync.double_buffer`, the default): `fill` writes the set that is not
being sent and returns without waiting for actors; the thread takes up the newest
filled set (`take_newest`) and sends it while training goes on. With one set (one full
copy of the weights less on rank 0), `fill` first waits until no broadcast reads it.
Either way filling and sending overlap bucket by bucket: the thread may take up a set
that is still being filled and send bucket i as soon as it is complete
(`BucketSet.wait_ready`), while bucket i+1 is being gathered and copied.

On CUDA the copy into bucket i runs on the learner's stream and records the bucket's
event; a transport sending from a side stream waits on that event, not on the whole
learner stream, so gathering, copying and sending overlap on the GPU as well (a path
that has not yet run on a GPU).
"""
from __future__ import annotations

import threading
import time
from typing import Iterator

import torch

from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.plan import Bucket, allocate_buckets


class BucketSet:
    """One full copy of the weights in buckets, with its per-bucket fill state."""

    def __init__(self, index: int, plan: list[Bucket], device: torch.device, owner: BucketSets):
        self.index = index
        self.tensors = allocate_buckets(plan, device)
        self.ready = [True] * len(plan)  # guarded by owner.cond
        self.broken = False  # a fill raised midway: never send this content
        self.version: int | None = None
        self.events = [torch.cuda.Event() for _ in plan] if device.type == "cuda" else None
        self._owner = owner

    def wait_ready(self, i: int) -> None:
        """Return once bucket i is filled (and, on CUDA, its event recorded); raise if the
        fill broke off, the sets were closed, or nothing came within the timeout."""
        self._owner.wait_ready(self, i)


class BucketSets:
    def __init__(self, plan: list[Bucket], device: torch.device, *, count: int, timeout_s: float,
                 wire_dtype: dict[str, torch.dtype] | None = None):
        self.plan, self.timeout_s = plan, timeout_s
        # Also the broadcaster's: one condition wakes its thread for new weights and new members alike.
        self.cond = threading.Condition()
        self.sets = [BucketSet(i, plan, device, self) for i in range(count)]
        self._slot = {e.name: (i, e) for i, b in enumerate(plan) for e in b.entries}
        self._wire_dtype = wire_dtype  # vLLM's packed layout: each tensor's bytes, in its spec dtype
        self._send_idx = 0  # the set being (or last) sent; `fill` writes the next one
        self.pending: int | None = None  # the version filled (or being filled) and not yet taken up
        self.sent: int | None = None  # the version of the set last taken up
        self.reading = False  # a broadcast reads the current set (set by the broadcaster)
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

    def fill(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the free set. With one set, first waits until no
        broadcast reads it (a broadcast takes at most its members' arrival plus the
        transfer, each bounded by the sync timeout)."""
        with self.cond:
            while len(self.sets) == 1 and self.reading and not self.closed:
                self.cond.wait(timeout=0.5)
            target = self.sets[(self._send_idx + 1) % len(self.sets)]  # never a set a broadcast is reading
            target.ready = [False] * len(self.plan)
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

    def _mark_ready(self, target: BucketSet, i: int) -> None:
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
