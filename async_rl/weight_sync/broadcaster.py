"""Learner rank 0's side of the weight sync: the store, the bucket sets, the broadcast thread.

Double buffering (`sync.double_buffer`, the default): `publish` fills the set that is
not being broadcast and returns without waiting for actors; the broadcast thread takes
the newest filled set and sends it while training goes on (schedule.py: a pipelined
chain on gloo, a broadcast per bucket on NCCL). With one set (`double_buffer=False`,
one full copy of the weights less on rank 0), `publish` first waits until no
broadcast reads the set. Either way filling and sending overlap bucket by bucket: the
thread may take up a set that `publish` is still filling and send bucket i as soon as
it is complete, while bucket i+1 is being gathered and copied (analysis/bench_sync.py
measures the gain; on a GPU the gather overlaps too).

On CUDA the buckets live on the device: publish copies on the learner's stream and
records one event per bucket; the thread broadcasts on a side stream that waits on
that event, so gathering, copying and sending overlap on the GPU as well. Actors on
the learner's own GPU get the bucket storage as CUDA-IPC handles instead (see
cuda_ipc.py) and copy from it; the thread waits for them before the set is reused.

`engine="vllm"` (the run's actors.engine): the buckets are planned in vLLM's packed
wire layout (uint8 chunks, plan.plan_packed), publish writes each tensor's bytes into
them, and each epoch's group is vLLM's trainer group (vllm_trainer.py). An epoch must
then consist of vLLM members only; a torch receiver in it (or a vLLM member in a
torch run) is refused with one log line and the epoch abandoned (rendezvous.plan_epoch).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from typing import Any, Iterable, Iterator

import msgpack
import torch
import torch.distributed as dist

from . import cuda_ipc, vllm_trainer
from .plan import allocate_buckets, layout_id, plan_buckets, plan_packed, sync_bucket_bytes
from .rendezvous import (EpochPlan, SyncAbandoned, SyncJob, arrived_key, broadcast_async, decision_key, describe,
                         new_group, plan_epoch, poll_store, vllm_port_key, wait_all)
from .schedule import chained, send_chain
from .transports import TRANSPORT_KEY, check_transport, encode_learner_info

log = logging.getLogger("async_rl.sync")


class _BucketSet:
    """One full copy of the weights in buckets, with its per-bucket fill state."""

    def __init__(self, plan, device: torch.device):
        self.tensors = allocate_buckets(plan, device)
        self.ready = [True] * len(plan)  # guarded by the broadcaster's condition
        self.broken = False  # publish raised midway: never send this content
        self.events = [torch.cuda.Event() for _ in plan] if device.type == "cuda" else None


class _Epoch:
    """What the thread knows about the membership epoch it last formed."""

    def __init__(self, number: int = 0, group: Any = None, ipc_ranks: tuple[int, ...] = (), vllm: bool = False,
                 world: int = 0):
        self.number, self.group, self.ipc_ranks, self.ipc_seq = number, group, ipc_ranks, 0
        self.world = world  # ranks in `group`, rank 0 included
        self.vllm = vllm  # `group` is vLLM's PyNcclCommunicator, not a torch ProcessGroup


class WeightBroadcaster:
    def __init__(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]], *, bucket_mb: float, host: str,
                 backend: str, device: torch.device, timeout_s: float, transport: str = "auto", port: int = 0,
                 engine: str = "torch", double_buffer: bool = True):
        check_transport(transport, device)
        if engine not in ("torch", "vllm"):
            raise ValueError(f"engine: expected 'torch' or 'vllm', got {engine!r}")
        self.engine = engine
        bucket_bytes = int(bucket_mb * 2**20)
        # vLLM: its wire layout; publish writes each tensor's bytes, in its spec dtype.
        self.plan = (plan_packed(specs, bucket_bytes) if engine == "vllm"  # vLLM's own chunk size
                     else plan_buckets(specs, sync_bucket_bytes(specs, bucket_mb)))
        self.layout = layout_id(specs, bucket_bytes) if engine == "vllm" else None
        self._wire_dtype = {name: dtype for name, _, dtype in specs} if engine == "vllm" else None
        self.backend = "gloo" if transport == "gloo" else backend
        self.device, self.timeout_s = device, timeout_s
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.host, self.port = host, self.store.port
        self.store.set(TRANSPORT_KEY, encode_learner_info(transport, self.backend, device))
        self._slot = {e.name: (i, e) for i, b in enumerate(self.plan) for e in b.entries}
        # gloo sends from host memory (schedule.py's point-to-point ops take host
        # pointers only), so a GPU learner on gloo copies straight to the host in publish.
        bucket_device = torch.device("cpu") if self.backend == "gloo" and engine == "torch" else device
        # Two sets cost a second full copy of the weights on rank 0; one set makes publish
        # wait while a broadcast is under way (its members' arrival included).
        self._sets = [_BucketSet(self.plan, bucket_device) for _ in range(2 if double_buffer else 1)]
        self._send_idx = 0  # the set being (or last) broadcast; publish fills the next one
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ipc_exported = False
        self.group: Any = None
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
        """Copy full (gathered) tensors into the free bucket set; returns without waiting
        for actors. The broadcast of a bucket may start as soon as it is complete.
        With one bucket set, first waits until no broadcast reads it (a broadcast takes
        at most its members' arrival plus the transfer, each bounded by timeout_s)."""
        with self._cond:
            while len(self._sets) == 1 and self._job is not None and not self._stop:  # a job reads the set
                self._cond.wait(timeout=0.5)
            target = self._sets[(self._send_idx + 1) % len(self._sets)]  # never a set a broadcast is reading
            target.ready = [False] * len(self.plan)
            target.broken = False
            self._pending_version = version
            self._cond.notify_all()
        missing = [b.numel for b in self.plan]
        try:
            for name, tensor in named_tensors:
                i, entry = self._slot[name]
                flat = tensor.reshape(-1)
                if self._wire_dtype is not None:  # packed uint8 chunks: the tensor's bytes
                    flat = flat.to(self._wire_dtype[name]).view(torch.uint8)
                target.tensors[i][entry.offset:entry.offset + entry.numel].copy_(flat)
                missing[i] -= entry.numel
                if missing[i] == 0:
                    self._mark_ready(target, i)
        except BaseException:
            with self._cond:
                target.broken = True
                if self._sets[self._send_idx] is not target:  # not taken up yet: withdraw it
                    self._pending_version = None
            raise
        finally:  # buckets of names never given keep their old values, as before; wake the thread either way
            for i in range(len(self.plan)):
                if missing[i] > 0:
                    self._mark_ready(target, i)

    def _mark_ready(self, target: _BucketSet, i: int) -> None:
        if target.events is not None:
            target.events[i].record()  # on the learner's stream, after the copies into bucket i
        with self._cond:
            target.ready[i] = True
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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        epoch = _Epoch()
        while True:
            with self._cond:
                while not self._stop and not self._work_ready(epoch.number):
                    self._cond.wait(timeout=0.5)
                if self._stop:
                    return
                if self._pending_version is not None and self._pending_version != self._sent_version:
                    self._send_idx = (self._send_idx + 1) % len(self._sets)
                    self._sent_version, self._pending_version = self._pending_version, None
                job = SyncJob(self._epoch, self._sent_version, self._members)  # type: ignore[arg-type]
                self._job = job
                source = self._sets[self._send_idx]
            started = time.monotonic()
            try:
                if epoch.number != job.epoch:
                    epoch, self.group = _Epoch(), None
                    epoch = self._form_epoch(job)
                    self.group = epoch.group  # for analysis/bench_sync.py's reference broadcasts on the same group
                self._send(source, epoch, job)
                self.completed += 1
                self.last_broadcast_s = time.monotonic() - started
            except SyncAbandoned as err:  # the loop picks the new membership up
                log.info("weight broadcast of version %s (epoch %s) abandoned: %s", job.version, job.epoch, err)
            except Exception as err:  # a member died or never came: rebuild next time
                self.failures += 1
                log.warning("weight broadcast of version %s (epoch %s) failed: %s", job.version, job.epoch,
                            describe(err))
                # Dropping every reference closes the group's connections, which releases
                # members still waiting in a broken-off broadcast.
                epoch, self.group = _Epoch(), None
                with self._cond:
                    self._epoch += 1  # a fresh store prefix for the retry
            finally:
                with self._cond:
                    self._job = None
                    self._cond.notify_all()

    def _form_epoch(self, job: SyncJob) -> _Epoch:
        """Decide (rank 0 alone) and build the epoch's group: vLLM's trainer group, our
        gloo/NCCL group for the collective members, CUDA IPC for the others."""
        plan, port_socket = self._gather_members(job)
        if plan.vllm:
            group = vllm_trainer.open_group(port_socket, self.host, plan.vllm_world, self.device, self.timeout_s)
            return _Epoch(job.epoch, group, vllm=True)
        world = len(plan.collective) + 1
        group = new_group(self.backend, self.store, job.epoch, 0, world, self.timeout_s) if plan.collective else None
        return _Epoch(job.epoch, group, plan.ipc, world=world)

    def _send(self, source: _BucketSet, epoch: _Epoch, job: SyncJob) -> None:
        if epoch.vllm:
            vllm_trainer.send(epoch.group, source.tensors, wait_ready=lambda i: self._wait_ready(source, i),
                              events=source.events, side_stream=self._side_stream, timeout_s=self.timeout_s)
            return
        if epoch.group is not None and chained(self.backend, len(source.tensors), epoch.world):
            send_chain(epoch.group, source.tensors, world=epoch.world, wait_ready=lambda i: self._wait_ready(source, i),
                       timeout_s=self.timeout_s)
        else:
            self._broadcast_each(source, epoch)
        if epoch.ipc_ranks:
            self._serve_ipc(source, epoch, job)

    def _broadcast_each(self, source: _BucketSet, epoch: _Epoch) -> None:
        """One broadcast per bucket; on CUDA queued on the side stream behind its copy-in."""
        works = []
        on_side_stream = torch.cuda.stream(self._side_stream) if self._side_stream else contextlib.nullcontext()
        with on_side_stream:
            for i, tensor in enumerate(source.tensors):
                self._wait_ready(source, i)
                if epoch.group is None:
                    continue
                if source.events is not None:
                    self._side_stream.wait_event(source.events[i])  # the copy-in, not the whole learner stream
                works.append(broadcast_async(epoch.group, tensor))
                if source.events is None:  # CPU: one at a time (queueing them all measured no faster)
                    works.pop().wait()
            wait_all(works, self.timeout_s)

    def _wait_ready(self, source: _BucketSet, i: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while not source.ready[i] and not self._stop:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bucket {i} was not filled within {self.timeout_s:.0f}s")
                self._cond.wait(timeout=0.5)
            if self._stop:
                raise SyncAbandoned("stopping")
            if source.broken:
                raise RuntimeError("the publish of this version broke off; its buckets are incomplete")

    def _serve_ipc(self, source: _BucketSet, epoch: _Epoch, job: SyncJob) -> None:
        """Tell the CUDA-IPC members which set to copy, once its bytes are on the device,
        and hold the set until they are done (publish must not overwrite it meanwhile)."""
        for event in source.events or ():
            event.synchronize()
        epoch.ipc_seq += 1
        self.store.set(cuda_ipc.ready_key(epoch.number, epoch.ipc_seq),
                       msgpack.packb({"set": self._sets.index(source), "version": job.version}))
        # No early release on a membership change: a member may still be copying.
        poll_store(self.store, [cuda_ipc.done_key(epoch.number, epoch.ipc_seq, r) for r in epoch.ipc_ranks],
                   self.timeout_s)

    def _gather_members(self, job: SyncJob) -> tuple[EpochPlan, Any]:
        """Decide whether the epoch's group can form: "go" once every member has arrived
        and rank 0 can serve them as they announced themselves, "abandon" as soon as the
        membership changes, the timeout passes, or the announcements are refused. Returns
        who receives how, and for vLLM members the socket whose port the decision named."""
        keys = [arrived_key(job.epoch, rank) for rank in range(1, len(job.members) + 1)]
        try:
            complete = poll_store(self.store, keys, self.timeout_s,
                                  give_up=lambda: self._stop or self._epoch != job.epoch)
        except TimeoutError:
            complete = False
        if not complete:
            self.store.set(decision_key(job.epoch), "abandon")
            if self._stop or self._epoch != job.epoch:
                raise SyncAbandoned("stopping" if self._stop else "the membership changed")
            missing = sum(not self.store.check([k]) for k in keys)
            raise TimeoutError(f"{missing} of {len(keys)} member(s) did not join within {self.timeout_s:.0f}s")
        kinds = {rank: self.store.get(key)[:200].decode("ascii", errors="replace")
                 for rank, key in enumerate(keys, 1)}
        port_socket = None
        try:
            plan = plan_epoch(kinds, engine=self.engine, layout=self.layout)
            if plan.ipc:
                self._export_ipc_handles()
            if plan.vllm:  # the port first: a member reads it as soon as it sees "go"
                port_socket = vllm_trainer.reserve_port(self.host)
                self.store.set(vllm_port_key(job.epoch), str(port_socket.getsockname()[1]))
        except BaseException:
            if port_socket is not None:
                port_socket.close()
            self.store.set(decision_key(job.epoch), "abandon")  # release the members at once
            raise
        self.store.set(decision_key(job.epoch), plan.decision())
        return plan, port_socket

    def _export_ipc_handles(self) -> None:
        if not self._ipc_exported:  # once per run: the buckets never move
            for index, bucket_set in enumerate(self._sets):
                self.store.set(cuda_ipc.handles_key(index),
                               cuda_ipc.pack([cuda_ipc.share(t) for t in bucket_set.tensors]))
            self._ipc_exported = True

    def _work_ready(self, group_epoch: int) -> bool:
        if not self._members:
            return False
        new_weights = self._pending_version is not None and self._pending_version != self._sent_version
        new_members = group_epoch != self._epoch and self._sent_version is not None
        return new_weights or new_members
