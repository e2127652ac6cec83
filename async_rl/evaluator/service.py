"""The evaluator's process: `python -m async_rl.evaluator RUN_DIR/evaluator`.

It builds one torch engine like an actor's (the config's model, LoRA adapters, the
actors' dtype and attention), then scores each saved version, oldest first: the
version's weights copied into the engine as a weight sync would, the held-out prompts
scored as an actor's evaluation round is (`eval.batch_size` per generate call,
`eval.pass_k` samples, the task's own reward), and the metrics line written beside the
version; with eval.also_dtypes again by one more engine per dtype
(eval/accuracy@float32). It ends when the learner that started it is gone.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from async_rl.config import Config, from_yaml
from async_rl.evaluator.versions import (
    CONFIG_FILE,
    load_version,
    mark_progress,
    unscored,
    version_file,
    write_atomically,
)

log = logging.getLogger("async_rl.evaluator")
POLL_S = 0.2  # between looks for a new version
ROLE_ENV = "ASYNC_RL_ROLE"  # "evaluator" in this process: user code may tell it from an actor


class Evaluator:
    def __init__(self, cfg: Config):
        from async_rl.evaluation.saved_model import evaluation_rollout
        from async_rl.learner.precision import actors_dtype
        from async_rl.tasks import task_from_config

        self.cfg = cfg
        lora = cfg.model.lora if cfg.model.lora.rank else None
        self.dtype = actors_dtype(cfg)
        self.rollout, _ = evaluation_rollout(cfg, cfg.model.path, str(self.dtype).removeprefix("torch."), lora=lora)
        # eval.also_dtypes: one more engine each, scoring the same version (saved as its master weights)
        self.also = {dtype: evaluation_rollout(cfg, cfg.model.path, dtype, lora=lora)[0]
                     for dtype in cfg.eval.also_dtypes}
        prompts = task_from_config(cfg.task, cfg.seed).eval_prompts()
        self.prompt_ids = [p.id for p in prompts[:cfg.eval.size if cfg.eval.size is not None else len(prompts)]]

    def load(self, tensors: list[torch.Tensor], version: int) -> None:
        """The version's weights into each engine (cast to its dtype), in the order the
        learner gathered them (the actors' receivers rely on the same order)."""
        for rollout in (self.rollout, *self.also.values()):
            self._load(rollout.engine, tensors, version)

    @staticmethod
    def _load(engine, tensors: list[torch.Tensor], version: int) -> None:
        params = engine.parameters_for_sync()
        if len(params) != len(tensors):
            raise ValueError(f"version {version} has {len(tensors)} tensors, the engine {len(params)}")
        with torch.no_grad():
            for (name, param), tensor in zip(params, tensors, strict=True):
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"version {version}: {name} is {tuple(tensor.shape)}, the engine's "
                                     f"{tuple(param.shape)}")
                param.copy_(tensor)
        engine.set_version(version)

    def score(self, folder: Path, version: int) -> dict:
        from async_rl.evaluation.saved_model import eval_line, score_prompts

        meta, tensors = load_version(folder, version)
        self.load(tensors, version)
        del tensors
        started = time.monotonic()

        def chunk_done() -> None:  # the learner's final wait counts chunks as progress, not only whole rounds
            mark_progress(folder)

        _, scores = score_prompts(self.rollout, self.prompt_ids, self.cfg.eval.batch_size, chunk_done)
        line = {"step": version, "version": version, **eval_line(scores, prefix="eval/"),
                "eval/seconds": round(time.monotonic() - started, 3), "version_time": meta["time"]}
        for dtype, rollout in self.also.items():
            _, scores = score_prompts(rollout, self.prompt_ids, self.cfg.eval.batch_size, chunk_done)
            line.update({f"{key}@{dtype}": value for key, value in eval_line(scores).items()
                         if key in ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean")})
        write_atomically(version_file(folder, version, ".result.json"), json.dumps(line))
        return line


def lower_priority(nice: int) -> None:
    """Nice this process by `nice`, and its autogroup too: the evaluator leads a session
    of its own, and where the kernel groups sessions (sched_autogroup_enabled) a task's
    nice only weighs inside its group, so the group's decides against training."""
    if not nice:
        return
    os.nice(nice)
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:  # no autogroups here (or not Linux): the task's nice is all there is
        pass


def serve(folder: Path, parent_pid: int, ready: threading.Event | None = None) -> int:
    """Score versions until the learner is gone; `ready` is set once the engines are
    built (until then the progress file is kept fresh by whoever made it)."""
    cfg = from_yaml((folder / CONFIG_FILE).read_text())
    lower_priority(cfg.eval.nice)
    torch.set_num_threads(cfg.eval.threads or cfg.actors.threads)
    evaluator = Evaluator(cfg)
    mark_progress(folder)
    if ready is not None:
        ready.set()
    log.info("evaluator ready: %d held-out prompts, %s, %d thread(s)", len(evaluator.prompt_ids),
             str(evaluator.dtype).removeprefix("torch."), torch.get_num_threads())
    try:
        while os.getppid() == parent_pid:
            todo = unscored(folder)
            if not todo:
                time.sleep(POLL_S)
                continue
            line = evaluator.score(folder, todo[0])
            log.info("version %d: accuracy %.3f in %.1f s", todo[0], line["eval/accuracy"], line["eval/seconds"])
    finally:
        for rollout in (evaluator.rollout, *evaluator.also.values()):
            rollout.close()
    return 0


def main(argv: list[str] | None = None, ready: threading.Event | None = None) -> int:
    from async_rl.models.loading import quiet_libraries

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_libraries()
    os.environ[ROLE_ENV] = "evaluator"
    try:
        return serve(Path(argv[0]), os.getppid(), ready)
    except KeyboardInterrupt:
        return 130
