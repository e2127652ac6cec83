"""Which transport carries the weights to each actor, by name.

`sync.transport` = auto | gloo | nccl | cuda_ipc. auto: gloo on CPU; on CUDA, a
CUDA-IPC copy when the actor shares the learner's physical GPU (same host, same GPU
UUID: NCCL refuses two ranks on one device), NCCL otherwise. Rank 0 publishes the
configured transport, its group's backend and its own identity in the store
(`LearnerInfo`); each actor decides for itself from that, and every actor that
receives by collective uses rank 0's backend. Actors on the vLLM engine always take
vLLM's own transport (`actors.engine=vllm`).
"""
from __future__ import annotations

import socket

import torch

from async_rl.weight_transfer import cuda_ipc, gloo_chain, nccl
from async_rl.weight_transfer.protocol import Transport
from async_rl.weight_transfer.store import LearnerInfo

TRANSPORTS = ("auto", "gloo", "nccl", "cuda_ipc")  # the choices of sync.transport
_BY_NAME = {t.name: t for t in (gloo_chain.TRANSPORT, nccl.TRANSPORT, cuda_ipc.TRANSPORT)}


def transport_named(name: str) -> Transport:
    """A torch receiver's transport, or one rank 0 serves (vLLM's is the sender's to add)."""
    return _BY_NAME[name]


def served(engine: str, backend: str, bucket_device: torch.device) -> tuple[str, ...]:
    """The transports rank 0 serves, in the order a sync goes out: vLLM's alone for a
    vLLM run; else its group's backend, then CUDA IPC where its buckets are on a GPU."""
    if engine == "vllm":
        return ("vllm",)
    return (backend, "cuda_ipc") if bucket_device.type == "cuda" else (backend,)


def gpu_identity(device: torch.device) -> str | None:
    """The physical GPU behind `device` (its UUID, unaffected by CUDA_VISIBLE_DEVICES
    renumbering); None on CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def check_transport(transport: str, device: torch.device) -> None:
    """The combinations config validation cannot see (model.device=auto resolved late)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"sync.transport: must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport in ("nccl", "cuda_ipc") and device.type != "cuda":
        raise ValueError(f"sync.transport: {transport} needs CUDA tensors, but the device is {device.type}")


def choose_transport(requested: str, device: torch.device, *, learner_backend: str, learner_host: str,
                     learner_gpu: str | None, host: str, gpu: str | None) -> str:
    """This actor's way: "cuda_ipc", or the backend of rank 0's broadcast group ("gloo" or
    "nccl"), which every collective member must share."""
    check_transport(requested, device)
    same_gpu = host == learner_host and gpu is not None and gpu == learner_gpu
    if requested == "cuda_ipc" and not same_gpu:
        raise ValueError("sync.transport: cuda_ipc needs the actor on the learner's own GPU "
                         f"(learner {learner_host}/{learner_gpu}, actor {host}/{gpu})")
    if requested == "cuda_ipc" or (requested == "auto" and same_gpu):
        return "cuda_ipc"
    if learner_backend == "nccl" and device.type != "cuda":
        raise ValueError("sync.transport: the learner broadcasts over NCCL, but this actor's device is "
                         f"{device.type} (set sync.transport=gloo, or give the actor a GPU)")
    return learner_backend  # gloo takes CUDA tensors too (a CPU learner, GPU actors)


def learner_info(requested: str, backend: str, device: torch.device, verified: bool = True) -> LearnerInfo:
    return LearnerInfo(requested, backend, socket.gethostname(), gpu_identity(device),  # type: ignore[arg-type]
                       verified)


def own_choice(info: LearnerInfo, device: torch.device) -> str:
    return choose_transport(info.transport, device, learner_backend=info.backend, learner_host=info.host,
                            learner_gpu=info.gpu, host=socket.gethostname(), gpu=gpu_identity(device))
