"""The vLLM transport (actors.engine=vllm): learner rank 0 sends its buckets to actors
whose weights live in vLLM, through vLLM's weight-transfer API.

One code path on a CPU and on a GPU; only the communicator differs, chosen by the
learner's device (its `LearnerInfo.backend`, which each actor checks against its own):

- GPU (`nccl`): vLLM's NCCL engine with a timeout on every chunk and its fingerprint
  (nccl_plugin.py, `backend="async_rl_nccl"`); the epoch's group is vLLM's
  `StatelessProcessGroup` on a port rank 0 reserves, named in `Group.port`, then
  PyNccl (nccl_group.py); timeouts on the rendezvous and on the host's waits at both
  ends (PyNccl has none of its own).
- CPU (`gloo`): our plugin engine (`backend="async_rl_gloo"`, gloo_plugin.py); the
  epoch's group is gloo on rank 0's store under the epoch's prefix (groups.new_group),
  as every torch transport's; every collective times out at `sync.timeout_s`.

The rest is shared:
1. handshake (store.py), as for every transport: a vLLM actor arrives as
   `Arrival("vllm", workers, layout)`, with its ranks per engine and the fingerprint
   of the packed layout it expects; rank 0 refuses a layout other than its own (a
   collective would turn it into a hang or garbage) and an epoch mixing engines;
2. `prepare` / `connect` on rank 0, `join` on each member: the member's
   `init_weight_transfer_engine` (api.init_info maps our ranks onto vLLM's);
3. per version: rank 0 broadcasts the bucket set, already in vLLM's packed layout
   (buckets.plan_packed: uint8 chunks of `sync.bucket_mb`), chunk by chunk; the member
   calls `start_weight_update`, `update_weights` (vLLM receives the chunks and loads
   them through its layerwise reload) and `finish_weight_update`.

vLLM receives in place (sync.stage_on_actors does not apply): a broadcast that breaks
off still finishes the update, so vLLM keeps a whole model of old and new layers, and
the receiver reports it not `intact` until a later sync completes (the actor then
generates nothing, as an unstaged torch receiver). Likewise for a version whose chunks
did not arrive as sent: each worker's engine takes every chunk's fingerprint before
loading it, the actor collects them (`LLM.collective_rpc(landed_fingerprint)`) and
checks them against rank 0's (receiver.py), and a mismatch leaves it not `intact`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from async_rl.weight_transfer.buckets import BucketSet, Spec, layout_id, plan_packed
from async_rl.weight_transfer.errors import EpochRejected
from async_rl.weight_transfer.groups import all_arrived, broadcast_async, new_group, wait_all
from async_rl.weight_transfer.protocol import ReceiverContext, SenderContext, Transport
from async_rl.weight_transfer.receiver import WeightReceiver
from async_rl.weight_transfer.store import Arrival, Group
from async_rl.weight_transfer.vllm.api import (
    init_info,
    place_wire_params,
    supported_kwargs,
    update_info,
    vllm_world,
    wire_params,
)

GLOO_BACKEND = "async_rl_gloo"  # gloo_plugin.BACKEND (that module imports vLLM, this one must not)
NCCL_BACKEND = "async_rl_nccl"  # nccl_plugin.BACKEND


def wire_dtype(vllm_dtype: str) -> torch.dtype:
    """The dtype weights travel in to vLLM actors computing in `vllm_dtype`
    (actors.engine.dtype): theirs where it is a 16-bit one (half the bytes of the learner's
    float32, cast once on rank 0), else float32 (vLLM casts on load)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(vllm_dtype, torch.float32)


def vllm_backend(communicator: str) -> str:
    """The `WeightTransferConfig(backend=...)` a vLLM actor needs for `communicator`."""
    return NCCL_BACKEND if communicator == "nccl" else GLOO_BACKEND


def check_arrivals(arrivals: dict[int, Arrival], layout: str | None) -> int:
    """The world of an epoch of vLLM members (trainer + every worker), or EpochRejected
    if one expects another wire layout or they differ in workers per engine."""
    for rank, arrival in sorted(arrivals.items()):
        if arrival.layout != layout:
            raise EpochRejected(f"rank {rank}'s vLLM wire layout {arrival.layout} differs from the learner's "
                                f"{layout}: learner and actors need the same model architecture, sync.bucket_mb "
                                "and sync dtype")
    workers = {arrival.workers for arrival in arrivals.values()}
    if len(workers) > 1:
        raise EpochRejected(f"the vLLM members differ in workers per engine {sorted(workers)}")
    return vllm_world(len(arrivals) + 1, workers.pop())


class VLLMTransportSender:
    def __init__(self, side: SenderContext):
        self.side = side
        self.nccl = side.device.type == "cuda"
        self.group: Any = None  # vLLM's PyNcclCommunicator, or a gloo ProcessGroup
        self._sock: Any = None  # NCCL: the port reserved in `prepare`, handed to vLLM in `connect`
        self._epoch, self._world = -1, 0

    def prepare(self, epoch: int, arrivals: dict[int, Arrival]) -> Group:
        self._epoch, self._world = epoch, check_arrivals(arrivals, self.side.layout)
        if not self.nccl:
            return Group(tuple(sorted(arrivals)))
        from async_rl.weight_transfer.vllm.nccl_group import reserve_port

        self._sock = reserve_port(self.side.host)
        return Group(tuple(sorted(arrivals)), port=self._sock.getsockname()[1])

    def connect(self) -> None:
        if not self.nccl:
            self.group = new_group("gloo", self.side.store, self._epoch, 0, self._world, self.side.timeout_s)
            return
        from async_rl.weight_transfer.vllm.nccl_group import open_group

        sock, self._sock = self._sock, None
        self.group = open_group(sock, self.side.host, self._world, self.side.device, self.side.timeout_s)

    def send(self, source: BucketSet) -> None:
        if self.nccl:
            from async_rl.weight_transfer.vllm.nccl_group import send_packed

            send_packed(self.group, source, self.side.side_stream, self.side.timeout_s)
            return
        works = []
        for i, chunk in enumerate(source.tensors):
            source.wait_ready(i)
            works.append(broadcast_async(self.group, chunk))
        wait_all([*works, all_arrived(self.group, torch.device("cpu"))], self.side.timeout_s)

    def disconnect(self) -> None:
        self.group = None
        if self._sock is not None:  # prepared, then abandoned before "go"
            self._sock.close()
            self._sock = None


@dataclass(frozen=True)
class VLLMPlace:
    """Where a sync lands on a vLLM actor: its `LLM`, its communicator, and what each
    call to it carries."""
    llm: Any
    communicator: str  # "nccl" or "gloo", the one its LLM's weight transfer was built for
    workers: int
    arrival: Arrival
    init_extra: dict[str, Any]
    update_info: dict[str, Any]


class VLLMTransportReceiver:
    group = None  # vLLM's group lives in its worker
    staged = False  # vLLM receives in place

    def __init__(self, side: ReceiverContext, place: VLLMPlace):
        if side.learner.backend != place.communicator:
            raise ValueError(f"the learner sends weights over {side.learner.backend}, but this vLLM actor was built "
                             f"to receive over {place.communicator}: learner and vLLM actors need the same "
                             "model.device")
        self.side, self.place = side, place

    def arrival(self) -> Arrival:
        return self.place.arrival

    def join(self, epoch: int, rank: int, group: Group) -> None:
        world = len(group.ranks) + 1
        if self.place.communicator == "nccl":
            if group.port is None:
                raise ValueError(f"rank 0's decision for epoch {epoch} names no port for vLLM's rendezvous")
            info = init_info(master_address=self.side.store_host, master_port=group.port,
                             rank=group.ranks.index(rank) + 1, world_size=world, workers_per_engine=self.place.workers)
            info.update(timeout_s=self.side.timeout_s)
        else:  # the epoch's gloo group forms on rank 0's own store, under the epoch's prefix
            info = init_info(master_address=self.side.store_host, master_port=self.side.store.port,
                             rank=group.ranks.index(rank) + 1, world_size=world, workers_per_engine=self.place.workers)
            info.update(epoch=epoch, timeout_s=self.side.timeout_s)
        self.place.llm.init_weight_transfer_engine({"init_info": {**info, **self.place.init_extra}})

    def receive(self, landed: Callable[[int], None] | None = None) -> None:
        """(Each worker's engine fingerprints the chunks as they arrive: `landed` is not called.)"""
        llm = self.place.llm
        llm.start_weight_update(**supported_kwargs(llm.start_weight_update, {"is_checkpoint_format": True}))
        try:
            llm.update_weights({"update_info": dict(self.place.update_info)})
        finally:
            # Also after a broken-off broadcast: vLLM then puts back the layers that got
            # nothing, and the model runs again, of two versions (not `intact`).
            llm.finish_weight_update()

    def landed(self) -> list[tuple[tuple[int, ...], ...] | None]:
        """Each worker's fingerprint of the chunks it last received."""
        return self.place.llm.collective_rpc(landed_fingerprint, timeout=self.side.timeout_s)

    def leave(self) -> None:
        pass


def landed_fingerprint(worker: Any) -> tuple[tuple[int, ...], ...] | None:
    """Run in each vLLM worker: what its weight-transfer engine recorded of the last
    update (None for an engine that records nothing)."""
    return getattr(getattr(worker, "weight_transfer_engine", None), "received", None)


class VLLMReceiver(WeightReceiver):
    """A vLLM actor's receiver, same interface as `ParameterReceiver`: `receive(...)` per
    SyncOrder, `intact` False while vLLM holds a model of two versions."""

    transport = "vllm"

    def __init__(self, llm: Any, specs: list[Spec], *, bucket_mb: float, communicator: str, timeout_s: float,
                 workers_per_engine: int = 1) -> None:
        super().__init__(timeout_s)
        init_fields, update_fields = info_fields(communicator)
        init_extra, update_extra = place_wire_params(wire_params(bucket_mb), init_fields, update_fields)
        # What rank 0 checks at arrival: the same packed layout as its buckets (plan_packed).
        arrival = Arrival("vllm", workers_per_engine, layout_id(specs, int(bucket_mb * 2**20)))
        self.place = VLLMPlace(llm, communicator, workers_per_engine, arrival, init_extra,
                               {**update_info(specs), **update_extra})
        self.plan = plan_packed(specs, int(bucket_mb * 2**20))

    def open_end(self, side: ReceiverContext) -> VLLMTransportReceiver:
        return VLLMTransportReceiver(side, self.place)

    def deliver(self, end: VLLMTransportReceiver) -> None:
        self.intact = False
        try:
            end.receive()
        except TimeoutError as err:
            if self.place.communicator == "nccl":  # its broadcast stays queued on the stream (nccl_plugin.py)
                self.broken = str(err)
            raise
        if self.verifying:
            landed = end.landed()  # one per worker, each of which received every chunk
            if any(fingerprint is None for fingerprint in landed):
                raise RuntimeError("this vLLM's weight-transfer engine records no fingerprint of what it received")
            self.check(self.plan, *landed)
        self.intact = True


def info_fields(communicator: str) -> tuple[list[str], list[str]]:
    """The field names of the installed vLLM engine's init and update info."""
    if communicator == "nccl":
        from async_rl.weight_transfer.vllm.nccl_plugin import TimedNcclWeightTransferEngine as engine
    else:
        from async_rl.weight_transfer.vllm.gloo_plugin import GlooWeightTransferEngine as engine
    return [f.name for f in fields(engine.init_info_cls)], [f.name for f in fields(engine.update_info_cls)]


TRANSPORT = Transport("vllm", VLLMTransportSender, VLLMTransportReceiver)
