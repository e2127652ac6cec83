"""The vLLM worker's end of the GPU weight transfer: vLLM's NCCL engine with what its
receive lacks, a timeout and each chunk's fingerprint.

vLLM's own receive (`NCCLWeightTransferEngine.receive_weights`, packed mode) queues
every chunk's broadcast on the current stream and never waits on the host, so a
learner that died mid-sync leaves `update_weights` waiting forever, and nothing of
what arrived is checked. This engine (`WeightTransferConfig(backend=BACKEND)`,
registered with gloo_plugin.register) receives the same packed chunks through the same
communicator, one at a time: after each broadcast the host polls the stream's event
against `timeout_s` (nccl_group.wait_event, as rank 0 does when sending), then takes
the chunk's fingerprint (fingerprint.py) and loads it through the layerwise reload;
after the last, an all-reduce of one word tells rank 0 that this worker has it all
(groups.all_arrived, on the trainer's side nccl_group.send_packed).

A broadcast that timed out stays queued on the stream: PyNccl has no abort, so this
process's GPU work cannot go on. The error says so, and the vLLM receiver then reports
itself `broken`, upon which the actor leaves and the launcher starts a fresh one.

Not yet run on a GPU: it needs one for the learner and another for each vLLM actor.
Imported only inside vLLM's processes (it imports vLLM).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferInitInfo

from async_rl.weight_transfer.buckets import plan_packed
from async_rl.weight_transfer.fingerprint import segment_sums, segments
from async_rl.weight_transfer.vllm.nccl_group import wait_event

BACKEND = "async_rl_nccl"  # the WeightTransferConfig backend name
STUCK = "its GPU stream stays blocked (PyNccl cannot abort a broadcast)"


@dataclass
class TimedNcclInitInfo(NCCLWeightTransferInitInfo):
    timeout_s: float = 60.0  # sync.timeout_s: the longest wait for one chunk


class TimedNcclWeightTransferEngine(NCCLWeightTransferEngine):
    init_info_cls = TimedNcclInitInfo

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = 60.0
        self.received: tuple[tuple[int, ...], ...] = ()  # the last update's fingerprint

    def init_transfer_engine(self, init_info: TimedNcclInitInfo) -> None:
        self.timeout_s = init_info.timeout_s
        super().init_transfer_engine(init_info)

    def receive_weights(self, update_info) -> None:
        group = self.model_update_group
        if group is None:
            raise RuntimeError("the NCCL weight transfer has no group: init_weight_transfer_engine first")
        specs = [(name, tuple(shape), getattr(torch, dtype))
                 for name, dtype, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        dtypes = {name: dtype for name, _, dtype in specs}
        stream = torch.cuda.current_stream()
        self.received, sums = (), []
        for chunk in plan_packed(specs, self.packed_buffer_size_bytes):
            buffer = torch.empty(chunk.numel, dtype=torch.uint8, device=self.device)
            group.broadcast(buffer, src=0, stream=stream)
            arrived = torch.cuda.Event()
            arrived.record(stream)
            try:
                wait_event(arrived, self.timeout_s)
            except TimeoutError as err:
                raise TimeoutError(f"{err}; {STUCK}") from None
            sums.append(segment_sums(buffer, segments(chunk)))
            self.model.load_weights([(e.name, buffer[e.offset:e.offset + e.numel].view(dtypes[e.name]).view(e.shape))
                                     for e in chunk.entries])
        group.all_reduce(torch.zeros(1, dtype=torch.int32, device=self.device), stream=stream)  # rank 0 waits for it
        arrived = torch.cuda.Event()
        arrived.record(stream)
        wait_event(arrived, self.timeout_s)
        self.received = tuple(tuple(s.tolist()) for s in sums)
