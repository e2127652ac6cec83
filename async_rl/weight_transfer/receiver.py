"""A member's side of the weight transfer, across epochs and whatever its transport.

The actor calls `receive(...)` once per SyncOrder. The receiver connects to rank 0's
store (once per learner), opens its transport's end, takes part in the handshake of
every new epoch (store.py), then lets the end receive the version. A failure drops the
end's group, so the next order joins afresh. Where the weights land is the subclass's:
`ParameterReceiver` for a torch model here, `VLLMReceiver` (vllm/transport.py) for vLLM.

Before a version is used, what landed is checked against the fingerprint rank 0 wrote
for that sync (fingerprint.py, when its store entry says `verified`): a staged
receiver checks the staging buckets and copies nothing on a mismatch, so it keeps its
last version whole; an unstaged one (and vLLM) stays not `intact`. Either way the
receive raises `WeightMismatch`, naming the version and the tensor.

A torch model's parameters are re-homed at construction as views of persistent
per-bucket flat tensors (buckets.alias_into_buckets). By default a sync, whether it
comes down the gloo chain (and is forwarded from there) or by broadcast, lands in a
second set of buckets and is copied into the parameters only once every bucket has
arrived: a sync that breaks off midway (a peer actor killed, a timeout) then leaves the
parameters on the last complete version, and the survivors keep generating with them
instead of waiting, idle, for the next sync. The price is one more copy of the weights
in the actor's memory and a memcpy per sync; `sync.stage_on_actors=false` saves both
for a model that barely fits, and then receives straight into the parameters.
"""
from __future__ import annotations

import datetime
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from async_rl.weight_transfer.buckets import Bucket, alias_into_buckets, plan_buckets, sync_bucket_bytes
from async_rl.weight_transfer.errors import SyncAbandoned, WeightMismatch
from async_rl.weight_transfer.fingerprint import first_difference, plan_segments, segment_sums
from async_rl.weight_transfer.protocol import Landing, ReceiverContext, TransportReceiver
from async_rl.weight_transfer.store import (
    LEARNER_KEY,
    Fingerprint,
    LearnerInfo,
    check_key,
    decode,
    join,
    member_gives_up,
    run_abandonable,
)
from async_rl.weight_transfer.transports import own_choice, transport_named


class WeightReceiver:
    """Subclasses say which end to open and how a version lands (`open_end`, `deliver`).
    `intact`: the weights hold one complete version (False while a sync writes them in place).
    `transport`: the name of the transport it receives by, once known.
    `broken`: why this process can receive no more syncs (None while it can)."""

    transport: str | None = None
    broken: str | None = None
    verify = True  # check what arrives when rank 0 sends fingerprints; off only to time the check's cost

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.intact = True
        self._store: dist.TCPStore | None = None
        self._end: TransportReceiver | None = None
        self._epoch = -1
        self._version: int | None = None  # the version the current order names
        self._learner: LearnerInfo | None = None
        # For `deliver`: whether rank 0 has abandoned the epoch being received (store.py).
        self.give_up: Callable[[], str | None] = lambda: None

    @property
    def group(self) -> Any:
        """The current epoch's communication group, None when there is none (not joined,
        dropped after a failure, or a transport without one)."""
        return None if self._end is None else self._end.group

    def receive(self, *, epoch: int, rank: int, world_size: int, store_host: str, store_port: int,
                version: int | None = None) -> None:
        """Receive one version, joining `epoch` first if this member is not in it yet.
        `world_size` is the coordinator's; the group's own comes from rank 0's decision.
        `version`, the order's: what arrives is checked against rank 0's fingerprint of that
        version (None: not checked)."""
        try:
            if self._store is None or (self._store.host, self._store.port) != (store_host, store_port):
                store = dist.TCPStore(store_host, store_port, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.timeout_s))
                learner = decode(LearnerInfo, store.get(LEARNER_KEY), "transport entry")
                self._end = self.open_end(ReceiverContext(store, store_host, self.timeout_s, learner))
                self._store, self._learner, self._epoch = store, learner, -1
            if epoch != self._epoch:
                self._end.leave()
                group = join(self._store, epoch, rank, self._end.arrival(), self.timeout_s)
                self._end.join(epoch, rank, group)
                self._epoch = epoch
            self.give_up = member_gives_up(self._store, epoch)
            self._version = version
            self.deliver(self._end)
        except Exception as err:
            # The group may be broken (a member gone, a collective half done): never reuse
            # it. Dropping it also closes its connections, releasing peers still waiting,
            # but only once nothing else holds it: the frames in the traceback of an
            # exception the caller keeps would (with the pending transfers).
            if self._end is not None:
                self._end.leave()
            self._epoch = -1
            traceback.clear_frames(err.__traceback__)
            raise

    def reopen(self) -> None:
        """Open the store connection and the transport's end afresh at the next receive
        (an end whose old receive may still be writing must not be reused)."""
        if self._end is not None:
            self._end.leave()
        self._store = self._end = None
        self._epoch = -1

    def open_end(self, side: ReceiverContext) -> TransportReceiver:
        raise NotImplementedError

    def deliver(self, end: TransportReceiver) -> None:
        raise NotImplementedError

    @property
    def verifying(self) -> bool:
        """Whether what arrives is checked: rank 0 writes fingerprints, the order named
        the version, and `verify`."""
        return (self._learner is not None and self._learner.verified and self.verify
                and self._version is not None)

    def check(self, plan: list[Bucket], *landed: tuple[tuple[int, ...], ...]) -> None:
        """Compare the fingerprint of what landed (one per copy received: a vLLM worker
        each) with the one rank 0 wrote for the version; WeightMismatch names the version
        and the first tensor that differs. Call only when `verifying`."""
        key = check_key(self._version)
        # Rank 0's publish writes it once the last bucket is filled, before that bucket can
        # have arrived here: it is there, or within a moment. One blocking read (the
        # store's timeout is the sync's), not a poll, which costs a round trip more.
        try:
            written = self._store.get(key)
        except dist.DistStoreError:
            raise WeightMismatch(f"rank 0 wrote no fingerprint of version {self._version} within "
                                 f"{self.timeout_s:.0f}s (it published another version, stopped, or its store is "
                                 "out of reach): what arrived cannot be checked") from None
        sent = decode(Fingerprint, written, "fingerprint")
        if sent.version != self._version:
            raise ValueError(f"malformed fingerprint in the sync store: {key} names version {sent.version}")
        for copy in landed:
            where = first_difference(plan, sent.buckets, copy)
            if where is not None:
                raise WeightMismatch(f"version {sent.version} did not arrive as sent: {where} differs")


class ParameterReceiver(WeightReceiver):
    """Receives every sync into the parameters of a torch model.

    `staged` (sync.stage_on_actors, the default): the collective transports receive into
    `self.staging`, a second set of buckets allocated once here (forwarding down the
    chain from there), and the buckets are copied into the live ones (the parameters)
    only once all have arrived. A sync that breaks off raises and leaves the parameters
    untouched, so `intact` stays True and the actor keeps generating on its last
    complete version.

    Unstaged: every bucket lands straight in the parameters. A sync that breaks off
    leaves some of them new and some old (a bucket may even be half written): `intact`
    is then False until a sync completes, and the actor must not generate with them.

    The transport is rank 0's to decide, from its store entry (transports.py): gloo,
    NCCL, or CUDA IPC for an actor on the learner's own GPU (never staged).
    """

    def __init__(self, params: list[tuple[str, torch.Tensor]], *, bucket_mb: float, backend: str, timeout_s: float,
                 staged: bool = True):
        super().__init__(timeout_s)
        self.params = dict(params)
        specs = [(n, tuple(p.shape), p.dtype) for n, p in params]
        self.plan = plan_buckets(specs, sync_bucket_bytes(specs, bucket_mb))
        self.buckets = alias_into_buckets(self.params, self.plan)
        self.segments = plan_segments(self.plan)
        # Allocated once: a sync must not fail (or fragment the allocator) for want of memory.
        self.staging = [torch.empty_like(flat) for flat in self.buckets] if staged else None
        self.device = self.buckets[0].device if self.buckets else torch.device("cpu")
        # `backend` (the actor's own guess) is kept for the engines' common receiver
        # interface; the group's backend is rank 0's, read from its store entry.
        self.backend = backend
        self.transport: str | None = None  # gloo | nccl | cuda_ipc, decided from rank 0's store entry
        self._left_behind: list = []  # receives of abandoned epochs, waiting out gloo's timeout

    def open_end(self, side: ReceiverContext) -> TransportReceiver:
        self.transport = own_choice(side.learner, self.device)  # raises on a bad combination
        place = Landing(self.plan, self.buckets, self.staging, self.device)
        return transport_named(self.transport).receiver(side, place)

    def deliver(self, end: TransportReceiver) -> None:
        if not end.staged:
            self.intact = False  # from the first byte on: a broken-off bucket is half written
        target = self.staging if end.staged else self.buckets
        sums: list[torch.Tensor | None] = [None] * len(target)

        def landed(i: int) -> None:  # each bucket's fingerprint while the next ones arrive
            sums[i] = segment_sums(target[i], self.segments[i])

        on_bucket = landed if self.verifying else None
        if end.staged and self.transport == "gloo":
            # Abandonable (store.py): staged, what a receive left behind still writes
            # lands in buffers no later sync reads, since they are replaced here.
            try:
                run_abandonable(lambda: end.receive(on_bucket), self.give_up, "weight-receive", self._left_behind)
            except SyncAbandoned:
                self.staging = [torch.empty_like(flat) for flat in self.buckets]
                self.reopen()
                raise
        else:
            end.receive(on_bucket)
        # Staged, a mismatch leaves the live buckets as they were: the last version, whole.
        if self.verifying:
            for i, got in enumerate(sums):
                if got is None:  # a transport that does not report each bucket
                    landed(i)
            self.check(self.plan, tuple(tuple(s.tolist()) for s in sums))
        if end.staged:
            # Only a local copy can fail from here on (a device error), but it would
            # leave a mix of two versions like a broken-off sync does.
            self.intact = False
            for live, flat in zip(self.buckets, self.staging):
                live.copy_(flat)
            if self.device.type == "cuda":  # complete before the sync is reported done
                torch.cuda.current_stream(self.device).synchronize()
        self.intact = True
