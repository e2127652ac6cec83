"""Weight broadcast from learner rank 0 to the actors.

The actors are not members of the torchrun world, so each membership epoch gets its
own process group {learner rank 0 = rank 0, actors = ranks 1..n}, rendezvoused through
a TCPStore that rank 0 hosts, under a per-epoch key prefix (gloo on CPU, NCCL on GPU).
Parameters travel in flat buckets of `sync.bucket_mb`, grouped by dtype, in
`named_parameters()` order, which both sides derive from the same architecture.

Rank 0 never waits for actors: `publish` copies the gathered weights into a pending
buffer set and returns; a background thread swaps it in and broadcasts while training
goes on (double buffering). Actors join at their next safe point.

A new epoch's group is only built once every member has announced itself in the store
and rank 0 has written its decision ("go" or "abandon"): gloo's own rendezvous cannot
be interrupted, so a member that died would otherwise hold everyone for the full
`sync.timeout_s`; this way a membership change (a dead actor reaped, a new one joined)
releases the waiting members at once. Rank 0 alone decides, so all members agree.
"""
from __future__ import annotations

import datetime
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger("async_rl.sync")


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


def plan_buckets(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
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


def new_group(backend: str, store: dist.Store, epoch: int, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group outside the default (torchrun) world, one per membership epoch."""
    prefixed = dist.PrefixStore(f"sync/{epoch}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options())  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def describe(err: BaseException) -> str:
    """One short log line for a failed sync: gloo's messages open with a source location
    and end with a paragraph of advice."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]


class SyncAbandoned(RuntimeError):
    """Rank 0 gave up on an epoch before its group formed (membership changed, or a
    member never came); the parameters are untouched."""


def _arrived_key(epoch: int, rank: int) -> str:
    return f"arrived/{epoch}/{rank}"


def _decision_key(epoch: int) -> str:
    return f"decision/{epoch}"


def _poll_store(store: dist.Store, keys: list[str], timeout_s: float, give_up=lambda: False) -> bool:
    """Wait until all `keys` exist; False if `give_up()` turns true first. Polled rather
    than `store.wait`, which cannot be interrupted and logs a warning on timeout."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if give_up():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {len(keys)} store key(s) appeared within {timeout_s:.0f}s")
        time.sleep(0.02)
    return True


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


@dataclass(frozen=True)
class SyncJob:
    epoch: int
    version: int
    members: tuple[int, ...]  # actor ids; actor k has group rank members.index(k) + 1

    def rank_of(self, actor_id: int) -> int:
        return self.members.index(actor_id) + 1


class WeightBroadcaster:
    """Learner rank 0 side: owns the store, the buckets and the broadcast thread."""

    def __init__(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]], *, bucket_mb: float,
                 host: str, backend: str, device: torch.device, timeout_s: float):
        self.plan = plan_buckets(specs, int(bucket_mb * 2**20))
        self.backend, self.timeout_s = backend, timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.host, self.port = host, self.store.port
        self._slot = {e.name: (i, e) for i, b in enumerate(self.plan) for e in b.entries}
        self._pending = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in self.plan]
        self._sending = [torch.empty_like(t) for t in self._pending]
        self._pending_version: int | None = None
        self._sent_version: int | None = None
        self._members: tuple[int, ...] = ()
        self._epoch = 0
        self._job: SyncJob | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.completed = 0
        self.failures = 0
        self.last_broadcast_s = 0.0
        self._thread = threading.Thread(target=self._run, name="weight-broadcast", daemon=True)
        self._thread.start()

    # -- called by the learner's main thread ------------------------------------
    def publish(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy full (gathered) tensors into the pending buckets; returns without waiting for actors."""
        with self._cond:
            for name, tensor in named_tensors:
                i, entry = self._slot[name]
                self._pending[i][entry.offset:entry.offset + entry.numel].copy_(tensor.reshape(-1))
            self._pending_version = version
            self._cond.notify_all()

    # -- called by the coordinator ----------------------------------------------
    def set_members(self, actor_ids: Iterable[int]) -> None:
        members = tuple(sorted(actor_ids))
        with self._cond:
            if members != self._members:
                self._members, self._epoch = members, self._epoch + 1
                self._cond.notify_all()

    def job(self) -> SyncJob | None:
        return self._job

    @property
    def sent_version(self) -> int | None:
        return self._sent_version

    def close(self, wait_s: float | None = None) -> None:
        """Stop the broadcast thread; wait at most `wait_s` (default: one sync timeout)
        for a broadcast in flight."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout_s + 5 if wait_s is None else wait_s)

    # -- the broadcast thread ---------------------------------------------------
    def _run(self) -> None:
        group, group_epoch = None, 0
        while True:
            with self._cond:
                while not self._stop and not self._work_ready(group_epoch):
                    self._cond.wait(timeout=0.5)
                if self._stop:
                    return
                if self._pending_version is not None and self._pending_version != self._sent_version:
                    self._pending, self._sending = self._sending, self._pending
                    self._sent_version, self._pending_version = self._pending_version, None
                job = SyncJob(self._epoch, self._sent_version, self._members)  # type: ignore[arg-type]
                self._job = job
            started = time.monotonic()
            try:
                if group_epoch != job.epoch:
                    group, group_epoch = None, 0
                    self._gather_members(job)
                    group = new_group(self.backend, self.store, job.epoch, 0, len(job.members) + 1, self.timeout_s)
                    group_epoch = job.epoch
                for tensor in self._sending:
                    _broadcast(group, tensor)
                self.completed += 1
                self.last_broadcast_s = time.monotonic() - started
            except SyncAbandoned as err:  # the loop picks the new membership up
                log.info("weight broadcast of version %s (epoch %s) abandoned: %s", job.version, job.epoch, err)
            except Exception as err:  # a member died or never came: rebuild next time
                self.failures += 1
                log.warning("weight broadcast of version %s (epoch %s) failed: %s", job.version, job.epoch,
                            describe(err))
                group, group_epoch = None, 0
                with self._cond:
                    self._epoch += 1  # a fresh store prefix for the retry
            finally:
                self._job = None

    def _gather_members(self, job: SyncJob) -> None:
        """Decide whether the epoch's group can form: "go" once every member has arrived,
        "abandon" as soon as the membership changes or the timeout passes."""
        keys = [_arrived_key(job.epoch, rank) for rank in range(1, len(job.members) + 1)]
        try:
            complete = _poll_store(self.store, keys, self.timeout_s,
                                   give_up=lambda: self._stop or self._epoch != job.epoch)
        except TimeoutError:
            complete = False
        self.store.set(_decision_key(job.epoch), "go" if complete else "abandon")
        if complete:
            return
        if self._stop or self._epoch != job.epoch:
            raise SyncAbandoned("stopping" if self._stop else "the membership changed")
        missing = sum(not self.store.check([k]) for k in keys)
        raise TimeoutError(f"{missing} of {len(keys)} member(s) did not join within {self.timeout_s:.0f}s")

    def _work_ready(self, group_epoch: int) -> bool:
        if not self._members:
            return False
        new_weights = self._pending_version is not None and self._pending_version != self._sent_version
        new_members = group_epoch != self._epoch and self._sent_version is not None
        return new_weights or new_members


class WeightReceiver:
    """Actor side: joins the epoch's group and writes received buckets into its parameters.

    A broadcast that breaks off midway (a peer died, a timeout) raises and leaves some
    buckets new and some old: `intact` is then False until a broadcast completes, and
    the actor must not generate with those parameters.
    """

    def __init__(self, params: list[tuple[str, torch.Tensor]], *, bucket_mb: float, backend: str, timeout_s: float):
        self.params = dict(params)
        self.plan = plan_buckets([(n, tuple(p.shape), p.dtype) for n, p in params], int(bucket_mb * 2**20))
        # One receive buffer per dtype, as large as its largest bucket, kept for the run: a
        # fresh allocation per bucket and sync costs page faults and zeroing (measured by
        # analysis/bench_sync.py, 217 MiB on CPU: 0.53-0.57 of a flat broadcast -> 0.68).
        device = next(iter(self.params.values())).device
        largest: dict[torch.dtype, int] = {}
        for b in self.plan:
            largest[b.dtype] = max(largest.get(b.dtype, 0), b.numel)
        self._scratch = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in largest.items()}
        self.backend, self.timeout_s = backend, timeout_s
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._epoch = -1
        self.intact = True  # the parameters hold one complete version

    def receive(self, *, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        try:
            self._receive(epoch, rank, world_size, store_host, store_port)
        except Exception:
            # The group may be broken (a member gone, a collective half done): never reuse
            # it. Dropping it also closes its connections, releasing peers still waiting.
            self._group, self._epoch = None, -1
            raise

    def _receive(self, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        if self._store is None or (self._store.host, self._store.port) != (store_host, store_port):
            self._store = dist.TCPStore(store_host, store_port, is_master=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        if epoch != self._epoch:
            self._group = None
            self._store.set(_arrived_key(epoch, rank), "1")
            # Rank 0 decides within its own timeout, which started before this member arrived.
            _poll_store(self._store, [_decision_key(epoch)], self.timeout_s)
            if self._store.get(_decision_key(epoch)) != b"go":
                raise SyncAbandoned(f"rank 0 abandoned epoch {epoch}")
            self._group = new_group(self.backend, self._store, epoch, rank, world_size, self.timeout_s)
            self._epoch = epoch
        for bucket in self.plan:
            flat = self._scratch[bucket.dtype][:bucket.numel]
            _broadcast(self._group, flat)
            self.intact = False
            with torch.no_grad():
                for e in bucket.entries:
                    self.params[e.name].copy_(flat[e.offset:e.offset + e.numel].view(e.shape))
        self.intact = True
