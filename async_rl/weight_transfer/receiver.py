"""A torch-engine actor's side of the weight sync.

The parameters are re-homed at construction as views of persistent per-bucket flat
tensors (plan.alias_into_buckets). By default a sync, whether it comes down the gloo
chain (and is forwarded from there) or by broadcast, lands in a second set of buckets
and is copied into the parameters only once every bucket has arrived: a sync that
breaks off midway (a peer actor killed, a timeout) then leaves the parameters on the
last complete version, and the survivors keep generating with them instead of
waiting, idle, for the next sync. The price is one more copy of the weights in the
actor's memory and a memcpy per sync; `sync.stage_on_actors=false` saves both for a
model that barely fits, and then receives straight into the parameters.
"""
from __future__ import annotations

import torch

from async_rl.weight_transfer.abandon import run_abandonable
from async_rl.weight_transfer.base import MemberBuckets, ReceiverEnd, ReceiverSide
from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.member import Member
from async_rl.weight_transfer.plan import alias_into_buckets, plan_buckets, sync_bucket_bytes
from async_rl.weight_transfer.records import LEARNER_KEY, LearnerInfo, decode
from async_rl.weight_transfer.transports import own_choice, transport_named


class WeightReceiver(Member):
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
        # Allocated once: a sync must not fail (or fragment the allocator) for want of memory.
        self.staging = [torch.empty_like(flat) for flat in self.buckets] if staged else None
        self.device = self.buckets[0].device if self.buckets else torch.device("cpu")
        # `backend` (the actor's own guess) is kept for the engines' common receiver
        # interface; the group's backend is rank 0's, read from its store entry.
        self.backend = backend
        self.transport: str | None = None  # gloo | nccl | cuda_ipc, decided from rank 0's store entry
        self._left_behind: list = []  # receives of abandoned epochs, waiting out gloo's timeout

    def open_end(self, side: ReceiverSide) -> ReceiverEnd:
        info = decode(LearnerInfo, side.store.get(LEARNER_KEY), "transport entry")
        self.transport = own_choice(info, self.device)  # raises on a bad combination
        place = MemberBuckets(self.plan, self.buckets, self.staging, self.device)
        return transport_named(self.transport).receiver(side, place)

    def deliver(self, end: ReceiverEnd) -> None:
        if not end.staged:
            self.intact = False  # from the first byte on: a broken-off bucket is half written
        if end.staged and self.transport == "gloo":
            # Abandonable (abandon.py): staged, what a receive left behind still writes
            # lands in buffers no later sync reads, since they are replaced here.
            try:
                run_abandonable(end.receive, self.give_up, "weight-receive", self._left_behind)
            except SyncAbandoned:
                self.staging = [torch.empty_like(flat) for flat in self.buckets]
                self.reopen()
                raise
        else:
            end.receive()
        if end.staged:
            # Only a local copy can fail from here on (a device error), but it would
            # leave a mix of two versions like a broken-off sync does.
            self.intact = False
            for live, flat in zip(self.buckets, self.staging):
                live.copy_(flat)
            if self.device.type == "cuda":  # complete before the sync is reported done
                torch.cuda.current_stream(self.device).synchronize()
        self.intact = True
