"""Modules that moved: user code importing one from its old place gets one line naming
the new place (ModuleNotFoundError, so `except ImportError` still holds), not a bare
"No module named". Consulted only after every other finder has failed, so nothing that
exists is ever shadowed."""
from __future__ import annotations

import importlib.abc
import sys

PUBLIC_HINT = "what user code needs is importable from async_rl itself (docs/api.md)"

# old module -> where it lives now. A package covers its modules: Python imports the package first,
# so the package's line is the one a user sees.
MOVED = {
    "async_rl.envs": "async_rl.actor.environments",
    "async_rl.engines": "async_rl.actor.engines",
    "async_rl.roles": "async_rl.actor, async_rl.coordinator and async_rl.learner",
    "async_rl.transport": "async_rl.wire",
    "async_rl.weight_sync": "async_rl.weight_transfer",
    "async_rl.weight_transfer.base": "async_rl.weight_transfer.protocol",
    "async_rl.weight_transfer.broadcaster": "async_rl.weight_transfer.sender",
    "async_rl.weight_transfer.bucket_sets": "async_rl.weight_transfer.buckets",
    "async_rl.weight_transfer.collective": "async_rl.weight_transfer.groups",
    "async_rl.lora.vllm_adapters": "async_rl.weight_transfer.vllm.lora",
    "async_rl.models.sharding": "async_rl.learner.sharding",
    "async_rl.algorithms.schedule": "async_rl.learner.optimizer",
    "async_rl.tasks.reward_guard": "async_rl.rewards.pool",
    "async_rl.admission": "async_rl.coordinator.admission",
    "async_rl.batching": "async_rl.learner.batching",
    "async_rl.checkpoint": "async_rl.learner.checkpoint",
    "async_rl.checkpoint_integrity": "async_rl.run.checkpoints",
    "async_rl.health": "async_rl.learner.health",
    "async_rl.launch_checks": "async_rl.run.checks",
    "async_rl.launcher": "async_rl.run.launcher",
    "async_rl.metrics": "async_rl.run.metrics",
    "async_rl.packing": "async_rl.learner.packing",
    "async_rl.prompting": "async_rl.tasks.prompt_format",
    "async_rl.replay_buffer": "async_rl.coordinator.replay_buffer",
    "async_rl.run_dir": "async_rl.run.directory",
    "async_rl.run_lock": "async_rl.run.lock",
    "async_rl.run_summary": "async_rl.run.summary",
    "async_rl.runtime": "async_rl.device, async_rl.models.loading and async_rl.run",
    "async_rl.tracing": "async_rl.run.tracing",
    "async_rl.train_step": "async_rl.learner.step",
}


def moved_to(name: str) -> str | None:
    """Where module `name` lives now, or None when it did not move (here)."""
    probe = name
    while probe:
        if probe in MOVED:
            return MOVED[probe] if probe == name else f"{MOVED[probe]} (as {probe} did)"
        probe = probe.rpartition(".")[0]
    return None


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        new = moved_to(fullname) if fullname.startswith("async_rl.") else None
        if new is None:
            return None
        raise ModuleNotFoundError(f"No module named {fullname!r}: it moved to {new}; {PUBLIC_HINT}", name=fullname)


def refuse_moved_modules() -> None:
    """Install the finder last on sys.meta_path (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
