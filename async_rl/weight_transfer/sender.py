"""Learner rank 0's side of the weight transfer: the store, the membership epochs, and
the thread that sends.

Rank 0 never waits for actors: `publish` copies the gathered weights into a free bucket
set and returns (buckets.py); a background thread takes up the newest set and sends it
to the members of the current epoch through the transports this learner serves
(transports.py): gloo or NCCL, plus CUDA IPC for actors on the learner's own GPU; or,
with `engine="vllm"` (the run's actors.engine), vLLM's own weight transfer, for which
the buckets are planned in vLLM's packed wire layout (uint8 chunks, buckets.plan_packed).

Epochs: the coordinator names the members (`WeightSender.set_members`); every change,
and every failed sync, starts a new epoch, so its groups are formed afresh among those
who are there. `form_epoch` runs rank 0's half of the handshake (store.py): it gathers
the arrivals, assigns each member to the transport it announced (`plan_epoch`), lets
each of those transports prepare, writes "go", and has each form its group.

Verified (`verify`, sync.verify): `publish` takes each bucket's fingerprint sums as it
fills it (buckets.py) and, once every bucket is filled, writes the version's fingerprint
to the store (fingerprint.py); each member checks what it received against it before
using it.

A sync that fails (a member died or never came) is counted and logged; the thread
drops the epoch's groups, which releases the members still waiting, and sends the
same version again in a new epoch. One that is abandoned (the membership changed
before the groups formed) is sent again to the new membership.
"""
from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from async_rl.weight_transfer.buckets import (
    BucketSet,
    BucketSets,
    Spec,
    layout_id,
    plan_buckets,
    plan_packed,
    sync_bucket_bytes,
)
from async_rl.weight_transfer.errors import EpochRejected, SyncAbandoned, describe
from async_rl.weight_transfer.fingerprint import fingerprint_of, plan_segments, segment_sums
from async_rl.weight_transfer.protocol import SenderContext, Transport, TransportSender
from async_rl.weight_transfer.store import (
    LEARNER_KEY,
    Arrival,
    Fingerprint,
    Group,
    abandon,
    check_key,
    decode_arrival,
    encode,
    gather_arrivals,
    go,
    mark_abandoned,
    run_abandonable,
)
from async_rl.weight_transfer.transports import check_transport, learner_info, served, transport_named

log = logging.getLogger("async_rl.sync")



def store_bound_to(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server listening on `host` alone. Given a host, torch's TCPStore still
    listens on every address of the machine, so the socket is bound here and handed
    over (`master_listen_fd`); "0.0.0.0" still means every address, when asked for."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
        bound = sock.getsockname()[1]
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                             timeout=datetime.timedelta(seconds=timeout_s))
    finally:
        sock.close()  # a no-op once detached; closes the socket if binding failed


class WeightSender:
    def __init__(self, specs: list[Spec], *, bucket_mb: float, host: str, backend: str, device: torch.device,
                 timeout_s: float, transport: str = "auto", port: int = 0, engine: str = "torch",
                 double_buffer: bool = True, verify: bool = True):
        check_transport(transport, device)
        if device.type == "cuda" and device.index is None:  # the thread's set_device needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        if engine not in ("torch", "vllm"):
            raise ValueError(f"engine: expected 'torch' or 'vllm', got {engine!r}")
        self.engine = engine
        bucket_bytes = int(bucket_mb * 2**20)
        self.plan = (plan_packed(specs, bucket_bytes) if engine == "vllm"  # vLLM's own chunk size
                     else plan_buckets(specs, sync_bucket_bytes(specs, bucket_mb)))
        self._segments = plan_segments(self.plan)
        self.backend = "gloo" if transport == "gloo" else backend
        self.device, self.timeout_s = device, timeout_s
        self.store = store_bound_to(host, port, timeout_s)
        self.host, self.port = host, self.store.port
        self.verify = verify
        self.store.set(LEARNER_KEY, encode(learner_info(transport, self.backend, device, verified=verify)))
        # gloo sends from host memory (its point-to-point ops take host pointers only), so
        # a GPU learner on gloo copies straight to the host in publish.
        bucket_device = torch.device("cpu") if self.backend == "gloo" and engine == "torch" else device
        # Two sets cost a second full copy of the weights on rank 0; one set makes publish
        # wait while a broadcast is under way (its members' arrival included).
        self.buffers = BucketSets(self.plan, bucket_device, count=2 if double_buffer else 1, timeout_s=timeout_s,
                                  wire_dtype={n: d for n, _, d in specs} if engine == "vllm" else None,
                                  take_sums=self._take_sums)
        side = SenderContext(self.store, host, device, timeout_s,
                          side_stream=torch.cuda.Stream(device) if device.type == "cuda" else None,
                          bucket_sets=self.buffers.sets,
                          layout=layout_id(specs, bucket_bytes) if engine == "vllm" else None)
        self._senders = {name: _transport(name).sender(side)
                         for name in served(engine, self.backend, bucket_device)}
        self._fingerprinted: deque[tuple[int, float]] = deque()  # (version, when written) of those in the store
        # The versions of the last two syncs taken up: a member may still be reading the
        # older one's fingerprint while the newer one goes out (all_arrived: never further behind).
        self._sending: deque[int] = deque(maxlen=2)
        self.last_fingerprint_s = 0.0  # what writing the last version's fingerprint took publish
        self.group = None  # the current epoch's group, for benchmarks/bench_sync.py's reference broadcasts
        self._members: tuple[int, ...] = ()
        self._epoch = 0  # the membership epoch the next broadcast goes to
        self._job: SyncJob | None = None
        self.completed = 0
        self.failures = 0
        self.last_broadcast_s = 0.0
        self.crashed: BaseException | None = None  # what ended the broadcast thread, if not close()
        self._left_behind: list[threading.Thread] = []  # sends of abandoned epochs, waiting out gloo's timeout
        self._thread = threading.Thread(target=self._run_guarded, name="weight-broadcast", daemon=True)
        self._thread.start()

    # -- called by the learner's main thread ------------------------------------
    def publish(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy full (gathered) tensors into the free bucket set; returns without waiting
        for actors. The broadcast of a bucket may start as soon as it is complete.
        Raises if the broadcast thread has died: no actor would ever get these weights."""
        if self.crashed is not None:
            raise RuntimeError(f"the weight-broadcast thread died: {describe(self.crashed)}") from self.crashed
        filled = self.buffers.fill(version, named_tensors)
        if self.verify:
            self._write_fingerprint(filled)

    # -- called by the coordinator ----------------------------------------------
    def set_members(self, actor_ids: Iterable[int]) -> None:
        members = tuple(sorted(actor_ids))
        with self.buffers.cond:
            if members != self._members:
                self._members, self._epoch = members, self._epoch + 1
                self.buffers.cond.notify_all()

    def resend(self, epoch: int) -> None:
        """A member refused what it received in `epoch` (its fingerprint differed): send
        the newest version again, to a new epoch, unless one has already begun."""
        with self.buffers.cond:
            if epoch == self._epoch:
                self._epoch += 1
                self.buffers.cond.notify_all()

    def job(self) -> SyncJob | None:
        return self._job

    @property
    def sent_version(self) -> int | None:
        return self.buffers.sent

    def close(self, wait_s: float | None = None) -> None:
        """Stop the broadcast thread; wait at most `wait_s` (default: one sync timeout)
        for a broadcast in flight."""
        self.buffers.close()
        self._thread.join(timeout=self.timeout_s + 5 if wait_s is None else wait_s)

    # -- the broadcast thread ---------------------------------------------------
    def _run_guarded(self) -> None:
        try:
            self._run()
        except BaseException as err:  # a bug, not a failed sync (those are caught per sync in _run)
            self.crashed = err
            log.exception("the weight-broadcast thread died")

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        buffers, epoch = self.buffers, Epoch()
        while True:
            with buffers.cond:
                while not buffers.closed and not self._work_ready(epoch.number):
                    buffers.cond.wait(timeout=0.5)
                if buffers.closed:
                    epoch.close()
                    return
                buffers.take_newest()
                if not self._sending or self._sending[-1] != buffers.sent:
                    self._sending.append(buffers.sent)
                job = SyncJob(self._epoch, buffers.sent, self._members)  # type: ignore[arg-type]
                self._job, buffers.reading = job, True
                source = buffers.current
            started = time.monotonic()
            try:
                if epoch.number != job.epoch:
                    epoch.close()
                    epoch, self.group = Epoch(), None
                    epoch = form_epoch(self.store, job, self._senders, engine=self.engine, timeout_s=self.timeout_s,
                                       give_up=lambda job=job: self._give_up(job))
                    self.group = epoch.group
                try:
                    # In a thread of its own: a member the coordinator dropped (its link cut,
                    # the process stopped) must not hold the others up until the timeout.
                    run_abandonable(lambda epoch=epoch, source=source: self._send(epoch, source),
                                    lambda job=job: self._give_up(job), "weight-send",
                                    self._left_behind)
                except SyncAbandoned as err:
                    mark_abandoned(self.store, job.epoch, str(err))  # releases the members still waiting
                    raise
                self.completed += 1
                self.last_broadcast_s = time.monotonic() - started
            except SyncAbandoned as err:  # the loop picks the new membership up
                log.info("weight broadcast of version %s (epoch %s) abandoned: %s", job.version, job.epoch, err)
            except Exception as err:  # a member died or never came: rebuild next time
                self.failures += 1
                log.warning("weight broadcast of version %s (epoch %s) failed: %s", job.version, job.epoch,
                            describe(err))
                epoch.close()
                epoch, self.group = Epoch(), None
                with buffers.cond:
                    self._epoch += 1  # a fresh store prefix for the retry
            finally:
                with buffers.cond:
                    self._job, buffers.reading = None, False
                    buffers.cond.notify_all()

    def _send(self, epoch: Epoch, source: BucketSet) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread, and this one is new
        epoch.send(source)

    def _take_sums(self, i: int, bucket: torch.Tensor) -> torch.Tensor | None:
        """Bucket i's fingerprint sums, taken by `publish` as soon as the bucket is filled."""
        return segment_sums(bucket, self._segments[i]) if self.verify else None

    def _write_fingerprint(self, filled: BucketSet) -> None:
        """The fingerprint of the version just filled, into the store under its version,
        for every member that receives it. One is dropped once no sync can still read it:
        older than the last two taken up (a slow sync may span many publishes), and
        written more than a sync timeout ago (a member dropped from its epoch may still
        be looking for it, at most that long)."""
        started = time.monotonic()
        sums = fingerprint_of(filled, self._segments)
        self.store.set(check_key(filled.version), encode(Fingerprint(filled.version, sums)))
        self._fingerprinted.append((filled.version, started))
        oldest_read = min(self._sending, default=filled.version)
        while (self._fingerprinted[0][0] < oldest_read
               and started - self._fingerprinted[0][1] > 2 * self.timeout_s):
            self.store.delete_key(check_key(self._fingerprinted.popleft()[0]))
        self.last_fingerprint_s = time.monotonic() - started

    def _give_up(self, job: SyncJob) -> str | None:
        if self.buffers.closed:
            return "stopping"
        return "the membership changed" if self._epoch != job.epoch else None

    def _work_ready(self, epoch_formed: int) -> bool:
        if not self._members:
            return False
        new_members = epoch_formed != self._epoch and self.buffers.sent is not None
        return self.buffers.has_new() or new_members


@dataclass(frozen=True)
class SyncJob:
    """One broadcast the thread is running: the epoch, the version, the members."""
    epoch: int
    version: int
    members: tuple[int, ...]  # actor ids; actor k has rank members.index(k) + 1 in the epoch

    def rank_of(self, actor_id: int) -> int:
        return self.members.index(actor_id) + 1


@dataclass(frozen=True)
class EpochPlan:
    """Who receives how in one epoch, as rank 0 decided it from the arrivals: per
    transport, in the order a sync goes out, its members' ranks and arrivals."""
    members: dict[str, dict[int, Arrival]]


def plan_epoch(arrivals: dict[int, Arrival], *, served: tuple[str, ...], engine: str) -> EpochPlan:
    """Each member to the transport it announced; EpochRejected for a member this learner
    cannot serve. `engine` is the run's actors.engine, which fixed the learner's bucket
    layout and so the transports it serves (`served`)."""
    members: dict[str, dict[int, Arrival]] = {name: {} for name in served}
    refused: dict[str, list[int]] = {}
    for rank in sorted(arrivals):
        transport = arrivals[rank].transport
        if transport in members:
            members[transport][rank] = arrivals[rank]
        else:
            refused.setdefault(transport, []).append(rank)
    torch_ranks = sorted(rank for transport, ranks in refused.items() if transport != "vllm" for rank in ranks)
    if engine == "vllm" and torch_ranks:
        raise EpochRejected(f"rank(s) {torch_ranks} run the torch engine, but this learner sends vLLM's packed "
                            "layout (actors.engine=vllm); one run uses one engine for all actors")
    if "vllm" in refused:
        raise EpochRejected(f"rank(s) {refused['vllm']} run vLLM, but this learner was built for "
                            f"actors.engine={engine} (WeightSender(engine=...)); one run uses one engine "
                            "for all actors")
    if refused:
        raise EpochRejected(f"rank(s) {torch_ranks} receive by {', '.join(refused)}, which this learner does "
                            f"not serve ({', '.join(served)})")
    return EpochPlan({name: ranks for name, ranks in members.items() if ranks})


class Epoch:
    """The epoch the broadcast thread last formed, and the transports serving it."""

    def __init__(self, number: int = 0, senders: tuple[TransportSender, ...] = ()):
        self.number, self.senders = number, senders

    @property
    def group(self) -> Any:
        """The first transport's communication group (benchmarks/bench_sync.py times
        reference broadcasts on it); None where it has none."""
        return self.senders[0].group if self.senders else None

    def send(self, source: BucketSet) -> None:
        for sender in self.senders:
            sender.send(source)

    def close(self) -> None:
        """Drop every group: closing their connections releases members still waiting."""
        for sender in self.senders:
            sender.disconnect()


def form_epoch(store: dist.Store, job: SyncJob, senders: dict[str, TransportSender], *, engine: str, timeout_s: float,
               give_up: Callable[[], str | None]) -> Epoch:
    """Decide (rank 0 alone) and form the epoch's groups. Any failure before "go" writes
    "abandon", which releases the members at once."""
    raw = gather_arrivals(store, job.epoch, len(job.members), timeout_s, give_up)
    prepared: list[TransportSender] = []
    try:
        arrivals = {rank: decode_arrival(rank, value) for rank, value in raw.items()}
        plan = plan_epoch(arrivals, served=tuple(senders), engine=engine)
        groups: dict[str, Group] = {}
        for name, members in plan.members.items():
            prepared.append(senders[name])
            groups[name] = senders[name].prepare(job.epoch, members)
    except BaseException as err:
        for sender in prepared:
            sender.disconnect()
        abandon(store, job.epoch, describe(err))
        raise
    epoch = Epoch(job.epoch, tuple(prepared))
    try:
        go(store, job.epoch, groups)
        for sender in prepared:
            sender.connect()
    except BaseException:
        epoch.close()
        raise
    return epoch


def _transport(name: str) -> Transport:
    if name == "vllm":  # vLLM's receiver subclasses receiver.py's, which the torch transports' registry serves
        from async_rl.weight_transfer.vllm.transport import TRANSPORT

        return TRANSPORT
    return transport_named(name)
