"""Checkpoints: resumable (DCP, sharded model + optimizer + coordinator state) and the
final Hugging Face directory.

A checkpoint directory is written under a temporary name and renamed when complete,
so a half-written one is never mistaken for a finished one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict


def save_checkpoint(path: Path, parts: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
                    coordinator_state: dict | None) -> None:
    """Collective: every learner rank calls it; rank 0 passes the coordinator state.
    `parts` names each trained (model, optimizer) pair, e.g. {"model": ..., "critic": ...};
    each is stored as NAME and NAME_optim in one DCP checkpoint."""
    tmp = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    state = {}
    for name, (model, optimizer) in parts.items():
        state[name], state[f"{name}_optim"] = get_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "coordinator.json").write_text(json.dumps(coordinator_state or {}, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    dist.barrier()


def save_hf_model(model: torch.nn.Module, tokenizer, out_dir: Path) -> None:
    """Save a plain (unsharded) HF model with its tokenizer, atomically."""
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
