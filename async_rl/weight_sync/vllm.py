"""The vLLM transport (actors.engine=vllm): learner rank 0 speaks vLLM's NCCL weight
transfer to actors whose weights live in vLLM's worker processes.

Not yet run on a GPU: vLLM cannot be installed on the development machines. The tests
run both ends against vLLM faked at its own API, and skip the real ones.

A vLLM worker cannot join the group collective.py builds: vLLM's workers form a
`StatelessProcessGroup` whose rank 0 (the trainer) *hosts* a TCPStore at
`master_port`, then a `PyNcclCommunicator` (NCCL only, no gloo, no timeout). So:

1. handshake (handshake.py), as for every transport: a vLLM actor arrives as
   `Arrival("vllm", workers, layout)`, with its NCCL ranks per engine and the
   fingerprint of the packed layout it expects; rank 0 refuses a layout other than its
   own (NCCL would turn it into a hang or garbage) and an epoch mixing engines;
2. `VLLMSender.prepare`: a listening socket on a free port of the store's host, named
   in the decision's `Group.port`, so every member finds it once released;
3. `connect` / `join`: vLLM's trainer end on that port (`open_trainer_group`), and each
   member's `init_weight_transfer_engine` (vllm_api.init_info maps our ranks onto
   vLLM's); rank 0 returns once every vLLM worker joined;
4. `send` / `receive`: per version, the bucket set (already in vLLM's packed layout,
   plan.plan_packed) chunk by chunk with `group.broadcast(chunk, src=0)` on rank 0's
   side stream, then a bounded wait for that stream; the member calls `update_weights`.

Timeouts. PyNccl has none, and nothing in it can be interrupted. What is bounded: the
handshake; the group's store rendezvous (`store_timeout`, where this vLLM accepts it);
the whole group formation (it runs in a helper thread that rank 0 stops waiting for
after `timeout_s`: a member that died between "go" and its NCCL init leaves that
thread blocked in `ncclCommInitRank` for the rest of the process, and the broadcaster
moves on to the next epoch); the host's wait for a broadcast (an event polled against
a deadline). What is not: a broadcast kernel whose peer died mid-transfer keeps its
side stream busy for good (no ncclCommAbort in vLLM's PyNccl), so later broadcasts on
that stream time out too until the learner restarts; and on the actor side, vLLM's
`update_weights` waits without a timeout for the chunks rank 0 never sends.
"""
from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from .base import ReceiverSide, SenderSide, WeightTransport
from .bucket_sets import BucketSet
from .errors import EpochRejected
from .member import Member
from .plan import Spec, layout_id
from .records import Arrival, Group
from .vllm_api import (init_info, place_wire_params, require_vllm, supported_kwargs, update_info, vllm_world,
                       wire_params)


def reserve_port(host: str) -> socket.socket:
    """A listening TCP socket on a free port of `host` (`getsockname()[1]`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def open_trainer_group(host: str, port: int, world_size: int, device: torch.device, *,
                       timeout_s: float | None = None, listen_socket: socket.socket | None = None) -> Any:
    """vLLM's recommended trainer end of the group (rank 0 of a `StatelessProcessGroup`
    hosting its store at `port`, then a `PyNcclCommunicator`). Broadcast packed chunks
    with `group.broadcast(chunk, src=0)`. `timeout_s` bounds the store rendezvous
    (`store_timeout`); NCCL's own init has no timeout. `listen_socket` (bound to `port`,
    listening) is handed over where this vLLM accepts one, which closes the gap in which
    another process could take the port; else it is closed first."""
    require_vllm()
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    wanted: dict[str, Any] = {} if timeout_s is None else {"store_timeout": max(1, math.ceil(timeout_s))}
    if listen_socket is not None:
        wanted["listen_socket"] = listen_socket
    extra = supported_kwargs(StatelessProcessGroup.create, wanted)
    if listen_socket is not None and "listen_socket" not in extra:
        listen_socket.close()  # this vLLM binds the port itself
    pg = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size, **extra)
    return PyNcclCommunicator(pg, device=device)


def open_group(sock: socket.socket, host: str, world_size: int, device: torch.device, timeout_s: float) -> Any:
    """The trainer group on `sock`'s port (rank 0 of `world_size`), or TimeoutError once
    `timeout_s` passed without every member joining (see the module docstring)."""
    port = sock.getsockname()[1]
    result: dict[str, Any] = {}

    def form() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            result["group"] = open_trainer_group(host, port, world_size, device, timeout_s=timeout_s,
                                                 listen_socket=sock)
        except BaseException as err:  # handed to the caller
            sock.close()  # a no-op once vLLM's store took the descriptor over
            result["error"] = err

    thread = threading.Thread(target=form, name="vllm-trainer-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"vLLM's weight-transfer group (world {world_size}, port {port}) did not form within "
                           f"{timeout_s:.0f}s; its NCCL init cannot be interrupted and is left behind")
    if "error" in result:
        raise result["error"]
    return result["group"]


def wait_event(event: Any, timeout_s: float) -> None:
    """Poll `event` until it completed, or raise TimeoutError (the work itself goes on)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broadcast to the vLLM actors did not finish within {timeout_s:.0f}s "
                               "(a member died mid-transfer? PyNccl cannot abort it)")
        time.sleep(0.001)


def check_arrivals(arrivals: dict[int, Arrival], layout: str | None) -> int:
    """The NCCL world of an epoch of vLLM members (trainer + every worker), or
    EpochRejected if one expects another wire layout or they differ in workers per engine."""
    for rank, arrival in sorted(arrivals.items()):
        if arrival.layout != layout:
            raise EpochRejected(f"rank {rank}'s vLLM wire layout {arrival.layout} differs from the learner's "
                                f"{layout}: learner and actors need the same model architecture, sync.bucket_mb "
                                "and sync dtype")
    workers = {arrival.workers for arrival in arrivals.values()}
    if len(workers) > 1:
        raise EpochRejected(f"the vLLM members differ in workers per engine {sorted(workers)}")
    return vllm_world(len(arrivals) + 1, workers.pop())


class VLLMSender:
    def __init__(self, side: SenderSide):
        self.side = side
        self.group: Any = None  # vLLM's PyNcclCommunicator
        self._sock: socket.socket | None = None  # reserved in `prepare`, handed to vLLM in `connect`
        self._world = 0

    def prepare(self, epoch: int, arrivals: dict[int, Arrival]) -> Group:
        self._world = check_arrivals(arrivals, self.side.layout)
        self._sock = reserve_port(self.side.host)
        return Group(tuple(sorted(arrivals)), port=self._sock.getsockname()[1])

    def connect(self) -> None:
        sock, self._sock = self._sock, None
        self.group = open_group(sock, self.side.host, self._world, self.side.device, self.side.timeout_s)

    def send(self, source: BucketSet) -> None:
        """Every packed chunk in order, each once filled; on CUDA on the side stream, after
        the chunk's fill event, then a bounded wait until the stream is done, so the set
        may be refilled. PyNccl broadcasts on the current stream."""
        stream = self.side.side_stream
        if stream is None:
            for i, chunk in enumerate(source.tensors):
                source.wait_ready(i)
                self.group.broadcast(chunk, src=0)
            return
        with torch.cuda.stream(stream):
            for i, chunk in enumerate(source.tensors):
                source.wait_ready(i)
                if source.events is not None:
                    stream.wait_event(source.events[i])  # the copy-in, not the whole learner stream
                self.group.broadcast(chunk, src=0)
            done = torch.cuda.Event()
            done.record(stream)
        wait_event(done, self.side.timeout_s)

    def disconnect(self) -> None:
        self.group = None
        if self._sock is not None:  # prepared, then abandoned before "go"
            self._sock.close()
            self._sock = None


@dataclass(frozen=True)
class VLLMPlace:
    """Where a sync lands on a vLLM actor: its `LLM`, and what each call to it carries."""
    llm: Any
    workers: int
    arrival: Arrival
    init_request: Any  # vLLM's WeightTransferInitRequest
    init_extra: dict[str, Any]
    update_request: Any  # vLLM's WeightTransferUpdateRequest
    update_info: dict[str, Any]


class VLLMReceiverEnd:
    group = None  # vLLM's group lives in its worker processes
    staged = False  # vLLM receives in place

    def __init__(self, side: ReceiverSide, place: VLLMPlace):
        self.side, self.place = side, place

    def arrival(self) -> Arrival:
        return self.place.arrival

    def join(self, epoch: int, rank: int, group: Group) -> None:
        if group.port is None:
            raise ValueError(f"rank 0's decision for epoch {epoch} names no port for vLLM's rendezvous")
        info = init_info(master_address=self.side.store_host, master_port=group.port,
                         rank=group.ranks.index(rank) + 1, world_size=len(group.ranks) + 1,
                         workers_per_engine=self.place.workers)
        self.place.llm.init_weight_transfer_engine(self.place.init_request(init_info={**info,
                                                                                     **self.place.init_extra}))

    def receive(self) -> None:
        llm = self.place.llm
        start = getattr(llm, "start_weight_update", None)
        if start is not None:  # later vLLM: HF-format names go through layerwise reload
            start(**supported_kwargs(start, {"is_checkpoint_format": True}))
        llm.update_weights(self.place.update_request(update_info=dict(self.place.update_info)))
        finish = getattr(llm, "finish_weight_update", None)
        if finish is not None:
            finish()
        # Prefix-cache blocks hold keys/values of the old weights; new requests must not reuse them.
        reset = getattr(llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def leave(self) -> None:
        pass


class VLLMWeightReceiver(Member):
    """A vLLM actor's receiver, same interface as `WeightReceiver`: `receive(...)` per
    SyncOrder, `intact` False while vLLM holds a half-updated model."""

    def __init__(self, llm: Any, specs: list[Spec], *, bucket_mb: float, backend: str, timeout_s: float,
                 workers_per_engine: int = 1) -> None:
        if backend != "nccl":
            raise ValueError(f"vLLM's weight transfer runs over NCCL only, not {backend!r}")
        super().__init__(timeout_s)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        init_extra, update_extra = place_wire_params(
            wire_params(bucket_mb), [f.name for f in fields(NCCLWeightTransferEngine.init_info_cls)],
            [f.name for f in fields(NCCLWeightTransferEngine.update_info_cls)])
        # What rank 0 checks at arrival: the same packed layout as its buckets (plan_packed).
        arrival = Arrival("vllm", workers_per_engine, layout_id(specs, int(bucket_mb * 2**20)))
        self.place = VLLMPlace(llm, workers_per_engine, arrival, WeightTransferInitRequest, init_extra,
                               WeightTransferUpdateRequest, {**update_info(specs), **update_extra})

    def open_end(self, side: ReceiverSide) -> VLLMReceiverEnd:
        return VLLMReceiverEnd(side, self.place)

    def deliver(self, end: VLLMReceiverEnd) -> None:
        self.intact = False
        end.receive()
        self.intact = True


TRANSPORT = WeightTransport("vllm", VLLMSender, VLLMReceiverEnd)
