"""Where the models run: `model.device` as a torch device, and the collective backend
for tensors there. Shared by the learner, the actors and the weight transfer.

torch is imported on first use: the launcher asks only for the device's kind, and on a
CPU-only build of torch (a version ending in "+cpu") that needs no import of it.
"""
from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build, by its version string alone."""
    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def device_type(name: str) -> str:
    """"cpu" or "cuda": the kind of device `model.device` resolves to (RuntimeError when
    it names cuda and none is visible)."""
    if name == "cpu" or (name == "auto" and _cpu_only_torch()):
        return "cpu"
    return resolve_device(name).type


def resolve_device(name: str) -> torch.device:
    """model.device as a torch device; a GPU always with its index (this process's current
    device: a learner rank sets its own first), since per-thread calls such as
    `torch.cuda.set_device` refuse a bare "cuda"."""
    import torch

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
