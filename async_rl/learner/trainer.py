"""The learner's every-rank half: what each torchrun rank holds and does the same way.

The models under FSDP2 with their optimizer and its learning-rate schedule, built
together (models.py), one learner step on this rank's rows (step.py), the gathers of
full parameters for the weight transfer and the export, and the checkpoint collectives.
Rank 0's own work (the coordinator, the weight sender, metrics and the trace) is
services.py's; loop.py runs the two together.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from async_rl.config import Config
from async_rl.learner.batching import Batch
from async_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from async_rl.learner.models import build_models
from async_rl.learner.sharding import full_parameters
from async_rl.learner.step import train_step
from async_rl.lora.adapters import is_adapter

Params = Iterator[tuple[str, torch.Tensor]]


class Trainer:
    def __init__(self, cfg: Config, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = device
        torch.manual_seed(cfg.seed)
        self.models = build_models(cfg, device, init_device_mesh(device.type, (self.world,)))
        # What the actors receive: every parameter, or with LoRA the adapters alone.
        self.synced: Callable[[str], bool] | None = is_adapter if cfg.model.lora.rank else None
        # A DTensor reports its global shape, so no communication is needed here.
        self.specs = [(n, tuple(p.shape), p.dtype) for n, p in self.models.policy.named_parameters()
                      if self.synced is None or self.synced(n)]
        self.version = 0  # learner steps taken: the policy version
        self.skipped_total = 0  # optimizer steps skipped for a non-finite loss or gradient
        self.skipped_streak = 0  # steps in a row with such skips

    def resume(self, checkpoint: Path) -> dict:
        """Load `checkpoint` into the models and optimizers (a collective); returns its
        saved state (the coordinator's is rank 0's to restore)."""
        state = load_checkpoint(checkpoint, self.models.trained())
        self.version = state["version"]
        self.models.scheduler.load_state_dict(state["learner"]["scheduler"])
        self.skipped_total = state["learner"]["skipped"]
        return state

    def step(self, local: Batch, histograms: dict[str, list[torch.Tensor]] | None) -> dict[str, float]:
        """One learner step on this rank's rows; the version goes up by one. Returns the
        step's global figures (train_step's, plus the skip count and learning rate)."""
        stats = train_step(self.cfg, self.models, local, histograms)
        skipped = stats["learner/skipped_steps"]
        self.skipped_total += skipped
        self.skipped_streak = self.skipped_streak + 1 if skipped else 0
        stats["learner/skipped_steps"] = self.skipped_total
        stats["learner/lr"] = self.models.scheduler.get_last_lr()[0]
        self.models.scheduler.step()
        self.version += 1
        return stats

    def gather(self, consume: Callable[[Params], None]) -> None:
        """Gather the synced parameters (every one, or with LoRA the adapters) one tensor at
        a time, a collective on every rank, and hand the (name, tensor) stream to `consume`."""
        consume(full_parameters(self.models.policy, self.synced))

    def save(self, directory: Path, state: dict | None, write_extra, keep: int) -> None:
        """A checkpoint of the trained models and optimizers (a collective); rank 0 passes
        the run's `state` and `write_extra` (save_checkpoint)."""
        save_checkpoint(directory, self.models.trained(), state, write_extra, keep=keep)

    def state(self) -> dict:
        """The every-rank part of a checkpoint's learner state."""
        return {"scheduler": self.models.scheduler.state_dict(), "skipped": self.skipped_total}


def drain(params: Params) -> None:
    """What a rank other than 0 does with a gather: take part, keep nothing."""
    collections.deque(params, maxlen=0)
