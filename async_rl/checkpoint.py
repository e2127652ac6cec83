"""Checkpoints: resumable (DCP for the sharded model and optimizer, plus the learner's
and coordinator's state) and the final Hugging Face directory.

A checkpoint is written under `step_NNNNNN.partial` and renamed when every file is
complete: the rename is the commit point, so `--resume` never sees a half-written one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import msgpack
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STATE_FILE = "coordinator.json"  # learner counters + coordinator state, written by rank 0
BUFFER_FILE = "buffer.msgpack"  # the replay buffer's groups, in wire format
_COMPLETE = re.compile(r"step_(\d{6,})")

Parts = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def _sharded_state(parts: Parts) -> dict:
    state = {}
    for name, (model, optimizer) in parts.items():
        state[name], state[f"{name}_optim"] = get_state_dict(model, optimizer)
    return state


def save_checkpoint(path: Path, parts: Parts, state: dict | None,
                    write_extra: Callable[[Path], None] | None = None, keep: int | None = None) -> None:
    """Collective: every learner rank calls it. `parts` names each trained (model,
    optimizer) pair, e.g. {"model": ..., "critic": ...}, stored as NAME and NAME_optim in
    one DCP checkpoint. Rank 0 passes `state` (JSON) and `write_extra(dir)` for its own
    files; after the commit it keeps only the newest `keep` checkpoints."""
    tmp = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(_sharded_state(parts), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        if write_extra is not None:
            write_extra(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(state or {}, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if keep:
            for old in complete_checkpoints(path.parent)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first (`.partial` directories are never listed)."""
    if not checkpoints_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoints_dir.iterdir()
             if (m := _COMPLETE.fullmatch(p.name)) and (p / STATE_FILE).exists()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir / "checkpoints")
    return found[-1] if found else None


def load_checkpoint(path: Path, parts: Parts) -> dict:
    """Collective: load the sharded model/optimizer pairs in place (resharding to this
    world size if it changed) and return the JSON state."""
    state = _sharded_state(parts)
    dcp.load(state, checkpoint_id=str(path))
    for name, (model, optimizer) in parts.items():
        set_state_dict(model, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optim"])
    return json.loads((path / STATE_FILE).read_text())


def write_groups(path: Path, groups: list[tuple[int, int, object]]) -> None:
    """Stream (admission index, version, message) records to `path`, each message in
    its wire encoding: the same validating decoder reads them back, nothing is pickled."""
    from .transport import encode

    packer = msgpack.Packer()
    with open(path, "wb") as out:
        for index, version, msg in groups:
            out.write(packer.pack([index, version, [bytes(f) for f in encode(msg)]]))


def read_groups(path: Path) -> list[tuple[int, int, object]]:
    from .transport import WireLimits, decode

    if not path.exists():
        return []
    limits = WireLimits()
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, max_buffer_size=limits.max_message_bytes + 2**20)
        return [(int(index), int(version), decode(frames, limits)) for index, version, frames in unpacker]


def save_hf_model(params, source: str | Path, tokenizer, out_dir: Path) -> None:
    """Write an HF model directory, atomically: the (name, full tensor) stream `params`
    as model.safetensors, with the config and generation config of the model directory
    `source` (the architecture the parameters belong to) and `tokenizer`. Tied weights
    appear once in `params` and are re-tied on load, as `save_pretrained` does."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({name: t.detach().cpu().contiguous() for name, t in params}, tmp / "model.safetensors",
              metadata={"format": "pt"})
    AutoConfig.from_pretrained(str(source)).save_pretrained(tmp)
    if (Path(source) / "generation_config.json").exists():
        GenerationConfig.from_pretrained(str(source)).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
