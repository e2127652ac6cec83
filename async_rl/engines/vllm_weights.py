"""Weight sync for the vLLM engine: our SyncOrder mapped onto vLLM's weight-transfer API.

vLLM (>= 0.16) documents one way to push trainer weights into a running `LLM`: the
NCCL weight-transfer backend (`LLM(weight_transfer_config=WeightTransferConfig(
backend="nccl"))`, then `init_weight_transfer_engine` once per group and
`update_weights` per round; docs.vllm.ai/en/v0.16.0 "Weight Transfer" and "NCCL
Engine"; vllm/distributed/weight_transfer/{base,nccl_engine,packed_tensor}.py).
Its worker cannot join the group `weight_sync.WeightBroadcaster` builds, so rank 0
must speak vLLM's protocol to vLLM actors. What differs from our torch protocol:

- rendezvous: vLLM's workers form a `StatelessProcessGroup` whose rank 0 (the
  trainer) *hosts* a TCPStore at `master_port`, then a `PyNcclCommunicator`
  (NCCL only, no gloo, no timeout). Our learner's store is already bound, so rank 0
  opens a fresh port per membership epoch and writes it to our store under
  `vllm_port_key(epoch)` before it decides "go". Our arrival/decision handshake
  (weight_sync/rendezvous.py) still runs first, so a member that died before the
  group formed releases the others at once; a death mid-broadcast still blocks (no
  timeout in PyNccl). A vLLM actor announces itself as "vllm <workers> <layout id>"
  (`rendezvous.vllm_arrival`); rank 0 refuses a layout other than its own, and an
  epoch that mixes vLLM and torch receivers (weight_sync/vllm_trainer.py: rank 0's end).
- wire layout: vLLM's packed mode sends uint8 chunks, tensors of any dtype
  concatenated in `names` order, a chunk closing right *after* the tensor that takes
  it past `packed_buffer_size_bytes`; ours sends same-dtype buckets closed *before*
  they overflow. When the run's engine is vLLM the learner plans its buckets in
  vLLM's layout (`weight_sync.plan.plan_packed`) and fills them directly;
  `pack_for_vllm` is the same layout from loose tensors. The buffer size is
  `sync.bucket_mb`, on both sides.
- names: HF checkpoint names (`named_parameters()` of the HF class, tied weights
  once), the order the learner uses; vLLM's `load_weights` maps them onto its fused
  parameters and casts from the wire dtype (float32, the learner's) to its own.

Mapping (per actor; `workers_per_engine` = the LLM's tensor-parallel size, 1 here):

| ours                                  | vLLM                                              |
|---------------------------------------|---------------------------------------------------|
| SyncOrder.store_host                  | init_info.master_address                          |
| store key vllm_port_key(order.epoch)  | init_info.master_port                             |
| r = 1 + index of SyncOrder.rank in    | init_info.rank_offset = 1 + (r-1)*workers         |
|   rank 0's "go" list (rendezvous.py)  |                                                   |
| k = length of that list               | init_info.world_size = 1 + k*workers              |
| new SyncOrder.epoch                   | a new init_weight_transfer_engine call            |
| every SyncOrder                       | [start_weight_update] update_weights [finish_...] |
| learner specs (name, shape, dtype)    | update_info names / dtype_names / shapes          |
| sync.bucket_mb                        | packed=True, packed_buffer_size_bytes             |

The packing fields sit in `update_info` in vLLM 0.16 and moved to `init_info` later
(the trainer now ships them at the handshake); `place_wire_params` puts them where
the installed version's dataclasses declare them. `start_weight_update` /
`finish_weight_update` exist only in later versions and are called when present.
"""
from __future__ import annotations

import datetime
import inspect
import math
import re
import socket
from dataclasses import fields
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from async_rl.weight_sync.plan import layout_id, plan_packed
from async_rl.weight_sync.rendezvous import (SyncAbandoned, arrived_key, decision_key, parse_decision, poll_store,
                                             vllm_arrival, vllm_port_key)

MIN_VLLM = (0, 16)
Spec = tuple[str, tuple[int, ...], torch.dtype]


class VLLMUnavailable(RuntimeError):
    """vLLM is missing or older than the weight-transfer API; the message is one line."""


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: "0.16.1rc1.dev3+gabc" -> (0, 16, 1)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def require_vllm() -> ModuleType:
    """Import vLLM or raise a one-line `VLLMUnavailable` naming the minimum version."""
    need = ".".join(map(str, MIN_VLLM))
    try:
        import vllm
    except ImportError:
        raise VLLMUnavailable(f"actors.engine=vllm needs vLLM >= {need}, which is not installed "
                              f"(pip install 'async-rl[vllm]' on a CUDA machine)") from None
    found = str(getattr(vllm, "__version__", "unknown"))
    try:
        too_old = parse_version(found) < MIN_VLLM
    except ValueError:
        too_old = True
    if too_old:
        raise VLLMUnavailable(f"actors.engine=vllm needs vLLM >= {need} (its weight-transfer API), found {found}")
    return vllm


# ------------------------------------------------------------------ pure mapping

def parse_port(value: bytes) -> int:
    """The rendezvous port rank 0 published; strict, it is network input."""
    text = value.decode("ascii", errors="replace").strip()
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"malformed vLLM rendezvous port {value[:16]!r} in the sync store")
    return int(text)


def vllm_world(world_size: int, workers_per_engine: int = 1) -> int:
    """NCCL world of one epoch: the trainer plus every vLLM worker of the n actors."""
    return 1 + (world_size - 1) * workers_per_engine


def init_info(*, master_address: str, master_port: int, rank: int, world_size: int,
              workers_per_engine: int = 1) -> dict[str, Any]:
    """`init_weight_transfer_engine` info for the actor with our group rank `rank` (>= 1)."""
    if not 1 <= rank < world_size:
        raise ValueError(f"actor rank must be in 1..{world_size - 1}, got {rank}")
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": 1 + (rank - 1) * workers_per_engine,
            "world_size": vllm_world(world_size, workers_per_engine)}


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's wire name of a dtype (`getattr(torch, name)` on the worker)."""
    return str(dtype).removeprefix("torch.")


def update_info(specs: Iterable[Spec]) -> dict[str, Any]:
    """Per-round `update_weights` info: names, dtype names and shapes, in send order."""
    specs = list(specs)
    return {"names": [n for n, _, _ in specs], "dtype_names": [dtype_name(d) for _, _, d in specs],
            "shapes": [list(s) for _, s, _ in specs]}


def wire_params(bucket_mb: float) -> dict[str, Any]:
    """Packed-broadcast parameters: one chunk per `sync.bucket_mb`, double buffered."""
    return {"packed": True, "packed_buffer_size_bytes": int(bucket_mb * 2**20), "packed_num_buffers": 2}


def place_wire_params(wire: dict[str, Any], init_fields: Iterable[str], update_fields: Iterable[str],
                      optional: Iterable[str] = ("packed_num_buffers",)) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `wire` into (init_info extras, update_info extras) by which of the installed
    version's dataclasses declares each field (update_info first, as in 0.16); an
    `optional` field (buffer count: no effect on the layout) no version declares is dropped."""
    init_fields, update_fields = set(init_fields), set(update_fields)
    to_init: dict[str, Any] = {}
    to_update: dict[str, Any] = {}
    for key, value in wire.items():
        if key in update_fields:
            to_update[key] = value
        elif key in init_fields:
            to_init[key] = value
        elif key not in optional:
            raise VLLMUnavailable(f"this vLLM's NCCL weight transfer has no {key!r} field; packed sync needs it")
    return to_init, to_update


def packed_chunk_sizes(specs: Iterable[Spec], buffer_bytes: int) -> list[int]:
    """Byte size of every chunk vLLM's packed consumer cuts (packed_tensor.py: a tensor is
    added, and the chunk closes once its total exceeds `buffer_bytes`)."""
    return [bucket.numel for bucket in plan_packed(specs, buffer_bytes)]


def pack_for_vllm(named_tensors: Iterable[tuple[str, torch.Tensor]], buffer_bytes: int) -> Iterator[torch.Tensor]:
    """Learner side: the uint8 chunks, in vLLM's packed layout, to broadcast from rank 0."""
    parts: list[torch.Tensor] = []
    total = 0
    for _, tensor in named_tensors:
        flat = tensor.detach().contiguous().view(torch.uint8).view(-1)
        parts.append(flat)
        total += flat.numel()
        if total > buffer_bytes:
            yield torch.cat(parts)
            parts, total = [], 0
    if parts:
        yield torch.cat(parts)


def supported_kwargs(fn: Callable[..., Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The subset of `wanted` that `fn`'s signature accepts by name."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(wanted)
    return {k: v for k, v in wanted.items() if k in params}


def hf_parameter_specs(model_path: str, dtype: torch.dtype = torch.float32) -> list[Spec]:
    """(name, shape, wire dtype) of the HF model's parameters in `named_parameters()`
    order, from a meta-device skeleton (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape), dtype) for name, p in skeleton.named_parameters()]


# ------------------------------------------------------------------ both sides

def open_trainer_group(host: str, port: int, world_size: int, device: torch.device, *,
                       timeout_s: float | None = None, listen_socket: socket.socket | None = None) -> Any:
    """Learner rank 0: vLLM's recommended trainer end of the group (rank 0 of a
    `StatelessProcessGroup` hosting its store at `port`, then a `PyNcclCommunicator`).
    Broadcast packed chunks with `group.broadcast(chunk, src=0)`. `timeout_s` bounds the
    store rendezvous (`store_timeout`); NCCL's own init has no timeout. `listen_socket`
    (bound to `port`, listening) is handed over where this vLLM accepts one, which
    closes the gap in which another process could take the port; else it is closed first."""
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


class VLLMWeightReceiver:
    """Actor side, same interface as `weight_sync.WeightReceiver`: `receive(...)` per
    SyncOrder, `intact` False while vLLM holds a half-updated model."""

    def __init__(self, llm: Any, specs: list[Spec], *, bucket_mb: float, backend: str, timeout_s: float,
                 workers_per_engine: int = 1) -> None:
        if backend != "nccl":
            raise ValueError(f"vLLM's weight transfer runs over NCCL only, not {backend!r}")
        self.llm, self.timeout_s, self.workers = llm, timeout_s, workers_per_engine
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._init_request, self._update_request = WeightTransferInitRequest, WeightTransferUpdateRequest
        self._init_extra, extra = place_wire_params(
            wire_params(bucket_mb), [f.name for f in fields(NCCLWeightTransferEngine.init_info_cls)],
            [f.name for f in fields(NCCLWeightTransferEngine.update_info_cls)])
        self._update_info = {**update_info(specs), **extra}
        # What rank 0 checks at arrival: the same packed layout as its buckets (plan_packed).
        self._arrival = vllm_arrival(workers_per_engine, layout_id(specs, int(bucket_mb * 2**20)))
        self._store: dist.TCPStore | None = None
        self._epoch = -1
        self.intact = True

    def receive(self, *, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        try:
            self._receive(epoch, rank, world_size, store_host, store_port)
        except Exception:
            self._epoch = -1  # rejoin (a fresh vLLM group) next time
            raise

    def _receive(self, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        if self._store is None or (self._store.host, self._store.port) != (store_host, store_port):
            self._store = dist.TCPStore(store_host, store_port, is_master=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        if epoch != self._epoch:
            # Our arrival/decision handshake first (rendezvous.py): a dead member releases
            # everyone at once, and rank 0 names the ranks of the collective.
            self._store.set(arrived_key(epoch, rank), self._arrival)
            poll_store(self._store, [decision_key(epoch)], self.timeout_s)
            collective = parse_decision(self._store.get(decision_key(epoch)))
            if collective is None:
                raise SyncAbandoned(f"rank 0 abandoned epoch {epoch}")
            if rank not in collective:
                raise RuntimeError(f"rank 0's decision for epoch {epoch} leaves this member (rank {rank}) out")
            port = parse_port(self._store.get(vllm_port_key(epoch)))
            info = init_info(master_address=store_host, master_port=port, rank=collective.index(rank) + 1,
                             world_size=len(collective) + 1, workers_per_engine=self.workers)
            self.llm.init_weight_transfer_engine(self._init_request(init_info={**info, **self._init_extra}))
            self._epoch = epoch
        self.intact = False
        start = getattr(self.llm, "start_weight_update", None)
        if start is not None:  # later vLLM: HF-format names go through layerwise reload
            start(**supported_kwargs(start, {"is_checkpoint_format": True}))
        self.llm.update_weights(self._update_request(update_info=dict(self._update_info)))
        finish = getattr(self.llm, "finish_weight_update", None)
        if finish is not None:
            finish()
        # Prefix-cache blocks hold keys/values of the old weights; new requests must not reuse them.
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()
        self.intact = True
