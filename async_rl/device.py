"""Where the models run: `model.device` as a torch device, and the collective backend
for tensors there. Shared by the learner, the actors and the weight transfer."""
from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """model.device as a torch device; a GPU always with its index (this process's current
    device: a learner rank sets its own first), since per-thread calls such as
    `torch.cuda.set_device` refuse a bare "cuda"."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("model.device=cuda but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def collective_backend(device: torch.device) -> str:
    """torch.distributed backend for tensors on this device: NCCL on GPU, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"
