"""The demo model a run starts from (`model.path: demo`): built and warm-started by our
own code for the run's seed and task, and kept in the user's cache between runs."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from async_rl.config import Config
from async_rl.run.checks import task_of

log = logging.getLogger("async_rl.launch")


def ensure_demo_model(cfg: Config, target: Path) -> Path:
    """The demo model for cfg's seed and task, warm-started into `target` unless a
    complete one is there (its INFO_FILE is written last). A build is kept in the user's
    cache (demo_cache) and copied from there by the next run that asks for the same one."""
    from async_rl.models.demo import INFO_FILE, VLLM_HEAD_DIM, build_demo_model

    if (target / INFO_FILE).exists():
        return target
    head_dim = {"head_dim": VLLM_HEAD_DIM} if cfg.actors.engine.name == "vllm" else {}
    cached = demo_cache(cfg, head_dim)
    if cached is not None and (cached / INFO_FILE).exists():
        log.info("copying the demo model (built before, %s) into %s", cached, target)
        shutil.copytree(cached, target, dirs_exist_ok=True)
        return target
    log.info("building the demo model (with supervised warm start) in %s", target)
    build_demo_model(target, seed=cfg.seed, task=task_of(cfg), target_accuracy=cfg.model.warm_start_accuracy,
                     **head_dim)
    if cached is not None:
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the next run a build, no more
            staging = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
            shutil.copytree(target, staging, dirs_exist_ok=True)
            os.replace(staging, cached)
    return target


def demo_cache(cfg: Config, head_dim: dict) -> Path | None:
    """Where a demo model of cfg's seed, task and warm start is kept between runs:
    $ASYNC_RL_CACHE (default ~/.cache/async-rl)/demo/<key>, the key a hash of what the
    build depends on (the builder's own source and torch's version included). The warm
    start also depends on the CPU's kernels, so the cache is the machine's own. None
    with ASYNC_RL_CACHE set empty (no cache)."""
    from importlib import metadata

    import async_rl.models.demo as demo

    root = os.environ.get("ASYNC_RL_CACHE", str(Path.home() / ".cache" / "async-rl"))
    if not root:
        return None
    what = json.dumps({"seed": cfg.seed, "task": cfg.task.model_dump(mode="json"), **head_dim,
                       "warm_start_accuracy": cfg.model.warm_start_accuracy, "torch": metadata.version("torch"),
                       "builder": hashlib.sha256(Path(demo.__file__).read_bytes()).hexdigest()}, sort_keys=True)
    return Path(root) / "demo" / hashlib.sha256(what.encode()).hexdigest()[:16]
