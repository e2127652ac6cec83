"""The vLLM worker's end of the CPU weight transfer: a vLLM `WeightTransferEngine` that
receives the learner's packed chunks over gloo.

vLLM's own transfer backends (nccl, ipc, ...) need CUDA. vLLM builds its worker's
engine by name from `WeightTransferEngineFactory`, and runs the entry points of the
group `vllm.general_plugins` in every process it starts (pyproject.toml names
`register` here), so an actor on a CPU creates its `LLM` with
`WeightTransferConfig(backend=BACKEND)` and gets this engine, on the same code path as
the NCCL engine on a GPU (transport.py): the same handshake, epochs and packed
layout (buckets.plan_packed), the same `init_weight_transfer_engine` / `start_weight_update`
/ `update_weights` / `finish_weight_update` calls. Only the communicator differs: a
gloo group formed through learner rank 0's own store, under the epoch's prefix, as
every torch transport's group (collective.new_group), with the sync timeout, instead
of vLLM's NCCL group on a port of its own.

Received weights go through vLLM's layerwise reload, as with NCCL: `model.load_weights`
between `initialize_layerwise_reload` and `finalize_layerwise_reload`. A plain
`load_weights` would fail on a CPU, where vLLM repacks linear weights for oneDNN and
leaves the parameters empty. Each chunk gets a fresh buffer, since the reload keeps
references to the views of a layer until the whole layer has arrived. Each chunk's
fingerprint is taken as it arrives, before it is loaded (`received`, which the actor
reads through `LLM.collective_rpc` and checks against rank 0's: transport.py).

Imported only inside vLLM's processes (it imports vLLM).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from async_rl.weight_transfer.buckets import plan_packed
from async_rl.weight_transfer.fingerprint import segment_sums, segments
from async_rl.weight_transfer.groups import all_arrived, broadcast, new_group

BACKEND = "async_rl_gloo"  # the WeightTransferConfig backend name


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the epoch's group forms: learner rank 0's store, the epoch (its key prefix),
    this engine's first rank and the group's size; the packed layout's chunk size."""
    master_address: str
    master_port: int
    epoch: int
    rank_offset: int
    world_size: int
    timeout_s: float
    packed_buffer_size_bytes: int
    packed: bool = True
    packed_num_buffers: int = 2


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One version: every tensor's name, dtype name and shape, in the order sent."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.store: dist.TCPStore | None = None
        self.buffer_bytes = 0
        self.received: tuple[tuple[int, ...], ...] = ()  # the last update's fingerprint (fingerprint.py)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a new epoch: the old group is gone on rank 0's side too
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.store = dist.TCPStore(init_info.master_address, init_info.master_port, is_master=False,
                                   timeout=datetime.timedelta(seconds=init_info.timeout_s))
        self.group = new_group("gloo", self.store, init_info.epoch, rank, init_info.world_size, init_info.timeout_s)
        self.buffer_bytes = init_info.packed_buffer_size_bytes

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        # A tied output head receives no weights of its own (the checkpoint names the
        # embedding only), so the reload puts its old kernel state back; on a CPU that
        # state is a GEMM handle packed from the old embedding. Pack it again from the
        # new one, which it shares.
        head = getattr(self.model, "lm_head", None)
        if getattr(self.model_config.hf_config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("the gloo weight transfer has no group: init_weight_transfer_engine first")
        specs = [(name, tuple(shape), getattr(torch, dtype))
                 for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        dtypes = {name: dtype for name, _, dtype in specs}
        self.received, sums = (), []
        for chunk in plan_packed(specs, self.buffer_bytes):
            buffer = torch.empty(chunk.numel, dtype=torch.uint8)
            broadcast(self.group, buffer)  # gloo: bounded by the group's timeout
            sums.append(tuple(segment_sums(buffer, segments(chunk)).tolist()))
            self.model.load_weights([(e.name, buffer[e.offset:e.offset + e.numel].view(dtypes[e.name]).view(e.shape))
                                     for e in chunk.entries])
        all_arrived(self.group, torch.device("cpu")).wait()  # bounded by the group's timeout
        self.received = tuple(sums)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which a CPU torch refuses.
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        self.group = self.store = None


def register() -> None:
    """The `vllm.general_plugins` entry point: make BACKEND, and the GPU's engine
    (nccl_plugin.py, loaded when first used), known to vLLM's factory, in every process
    vLLM starts (and again in ours, where that is harmless)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    engines = {BACKEND: (GlooWeightTransferEngine,),
               "async_rl_nccl": ("async_rl.weight_transfer.vllm.nccl_plugin", "TimedNcclWeightTransferEngine")}
    for name, engine in engines.items():
        try:
            WeightTransferEngineFactory.register_engine(name, *engine)
        except ValueError:  # the factory refuses a name twice: already registered in this process
            pass
