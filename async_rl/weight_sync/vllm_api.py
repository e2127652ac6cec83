"""vLLM's weight-transfer API as we call it: the version gate and the pure mapping.

vLLM (>= 0.16) documents one way to push trainer weights into a running `LLM`: the
NCCL weight-transfer backend (`LLM(weight_transfer_config=WeightTransferConfig(
backend="nccl"))`, then `init_weight_transfer_engine` once per group and
`update_weights` per round; docs.vllm.ai/en/v0.16.0 "Weight Transfer" and "NCCL
Engine"; vllm/distributed/weight_transfer/{base,nccl_engine,packed_tensor}.py).

- wire layout: vLLM's packed mode sends uint8 chunks, tensors of any dtype
  concatenated in `names` order, a chunk closing right *after* the tensor that takes
  it past `packed_buffer_size_bytes`; our torch transports send same-dtype buckets
  closed *before* they overflow. When the run's engine is vLLM the learner plans its
  buckets in vLLM's layout (`plan.plan_packed`) and fills them directly;
  `pack_for_vllm` is the same layout from loose tensors. The buffer size is
  `sync.bucket_mb`, on both sides.
- names: HF checkpoint names (`named_parameters()` of the HF class, tied weights
  once), the order the learner uses; vLLM's `load_weights` maps them onto its fused
  parameters and casts from the wire dtype (float32, the learner's) to its own.

Mapping (per actor; `workers_per_engine` = the LLM's tensor-parallel size, 1 here):

| ours                                  | vLLM                                              |
|---------------------------------------|---------------------------------------------------|
| SyncOrder.store_host                  | init_info.master_address                          |
| Group.port of rank 0's decision       | init_info.master_port                             |
| r = 1 + index of SyncOrder.rank in    | init_info.rank_offset = 1 + (r-1)*workers         |
|   the decision's Group.ranks          |                                                   |
| k = length of Group.ranks             | init_info.world_size = 1 + k*workers              |
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

import inspect
import re
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator

import torch

from .plan import Spec, plan_packed

MIN_VLLM = (0, 16)


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
