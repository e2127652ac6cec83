"""Learner rank 0's own work beside training, as one object: the coordinator (prompts,
admission, replay buffer, actor registry, evaluation rounds) and its hub, the weight
sender, the metrics line and TensorBoard, the trace, and the warnings when a run has
nothing to learn from. The other ranks get `Followers`, the same calls doing nothing
but their part of the collectives, so the loop (loop.py) reads the same on every rank.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from async_rl.config import Config, to_yaml
from async_rl.coordinator.coordinator import Coordinator
from async_rl.coordinator.replay_buffer import Taken
from async_rl.device import collective_backend
from async_rl.evaluator.process import LOG_FILE as EVALUATOR_LOG
from async_rl.evaluator.process import EvaluatorProcess
from async_rl.evaluator.versions import FOLDER as EVALUATOR_FOLDER
from async_rl.evaluator.versions import VersionStore
from async_rl.learner.checkpoint import BUFFER_FILE, read_groups, save_hf_model, write_groups
from async_rl.learner.health import RunHealth
from async_rl.learner.precision import actors_dtype
from async_rl.learner.step_data import StepData, measure_step
from async_rl.learner.trainer import Trainer, drain
from async_rl.lora.adapters import save_lora_final
from async_rl.run.disk import release_room, reserve_room, writing
from async_rl.run.metrics import MetricsLogger
from async_rl.run.model_card import CARD_FILE, MASTER_DIR, card_text
from async_rl.run.tracing import SpanRecorder, TraceWriter
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import prompt_format_for, prompt_limit
from async_rl.weight_transfer.sender import WeightSender

log = logging.getLogger("async_rl.learner")


def sent_specs(cfg: Config, specs: list) -> list:
    """(name, shape, dtype) of the synced parameters as they travel: in the actors' dtype
    where it is 16-bit (vLLM's compute dtype, or the torch engine's)."""
    engine = cfg.actors.engine
    if engine.name == "vllm" and not cfg.model.lora.rank:
        from async_rl.weight_transfer.vllm.transport import wire_dtype

        return [(name, shape, wire_dtype(engine.dtype)) for name, shape, _ in specs]
    if engine.name == "torch" and actors_dtype(cfg) != torch.float32:  # torch actors hold their dtype
        return [(name, shape, actors_dtype(cfg)) for name, shape, _ in specs]
    return specs


class Rank0Services:
    def __init__(self, cfg: Config, trainer: Trainer, resumed: dict | None = None, checkpoint: Path | None = None):
        """`resumed`: the state of `checkpoint`, the run continues from."""
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        reserve_room(self.run_dir)  # for the last words of a run that fills its disk (run/disk.py)
        self.prompt_format = prompt_format_for(cfg.model.path, cfg.task)  # for the samples shown in TensorBoard
        self.task = task_from_config(cfg.task, cfg.seed)
        self.health = RunHealth(cfg.metrics.warn_after_steps, self.prompt_format.uses_chat, cfg.actors.max_new_tokens,
                                cfg.metrics.warn_mismatch_kl)
        specs = sent_specs(cfg, trainer.specs)
        self.sync_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)  # as they travel
        # vLLM's weight transfer carries whole models; LoRA adapters reach vLLM actors over the plain sync.
        engine = "torch" if trainer.synced is not None else cfg.actors.engine.name
        self.sender = WeightSender(specs, bucket_mb=cfg.sync.bucket_mb, host=cfg.transport.host,
                                        backend=collective_backend(trainer.device), device=trainer.device,
                                        timeout_s=cfg.sync.timeout_s, transport=cfg.sync.transport,
                                        port=cfg.transport.store_port, engine=engine,
                                        double_buffer=cfg.sync.double_buffer, verify=cfg.sync.verify)
        # The run's timeline (trace.json): this thread's spans, and the actors' via the coordinator.
        self.trace = TraceWriter(self.run_dir / "trace.json", resume=resumed is not None)
        self.spans = self.trace.learner
        lengths = prompt_format_for(cfg.model.path, cfg.task)  # the coordinator thread's own tokenizer
        self.prompt_limit = prompt_limit(cfg.task.max_prompt_tokens, trainer.models.policy.config,
                                         cfg.actors.max_new_tokens)
        self.coordinator = Coordinator(cfg, self.task, self.sender, self.run_dir, trace=self.trace,
                                       prompt_over_limit=lambda prompt: lengths.over_limit(prompt, self.prompt_limit),
                                       prompt_limit=self.prompt_limit)
        self.samples_total = 0
        self.last_eval: dict | None = None  # the newest evaluation line, for final/'s card
        if resumed is not None:
            log.info("resumed from %s at version %d", checkpoint, trainer.version)
            self.coordinator.restore(trainer.version, resumed["coordinator"], read_groups(checkpoint / BUFFER_FILE))
            self.samples_total = resumed["learner"]["samples"]
        self.coordinator.start()
        self.metrics = MetricsLogger(self.run_dir, cfg.train.max_steps, resume_step=trainer.version,
                                     elapsed=resumed["learner"]["elapsed"] if resumed else 0.0)
        self._last_step_end = time.monotonic()
        self.version_times = {trainer.version: self.metrics.elapsed()}  # the learner's clock when each was made
        self.versions = self.evaluator = None
        self._last_eval_line = time.monotonic()
        if cfg.eval.placement == "evaluator" and self.coordinator.evals.chunks:
            folder = self.run_dir / EVALUATOR_FOLDER
            # eval.also_dtypes scores the master weights in other dtypes: save those, not the actors' copy
            dtype = torch.float32 if cfg.eval.also_dtypes else actors_dtype(cfg)
            self.versions = VersionStore(folder, to_yaml(cfg), dtype,
                                         resumed_at=trainer.version if resumed is not None else None)
            self.evaluator = EvaluatorProcess(folder, self.run_dir / "logs" / EVALUATOR_LOG,
                                              cfg.eval.threads or cfg.actors.threads)
            self.evaluator.start()  # its model loads while the first steps train

    # -- a step's data ------------------------------------------------------------
    def take(self, version: int, timeout: float, stop) -> Taken | None:
        """The next batch in admission order, or None after `timeout` s or once `stop` is set."""
        return self.coordinator.take(self.cfg.train.batch_groups, version, timeout=timeout, stop=stop)

    def measure(self, taken: Taken, version: int, waited: float) -> StepData:
        return measure_step(self.cfg, taken, version, waited, self.prompt_format, self.health)

    @property
    def pad_id(self) -> int:
        return self.prompt_format.tokenizer.pad_token_id or 0

    def advance(self, version: int) -> None:
        self.version_times[version] = self.metrics.elapsed()
        self.coordinator.advance(version)

    def publish(self, version: int):
        """What the gather of `version`'s weights streams into: the weight sender."""
        return lambda params: self.sender.publish(version, params)

    # -- metrics and evaluation ---------------------------------------------------
    def log_step(self, version: int, stats: dict[str, float], data: StepData,
                 histograms: dict[str, list[torch.Tensor]], sync_s: float) -> None:
        """The step's metrics line, each part named where it is computed, then the
        evaluation rounds the actors finished."""
        self.samples_total += data.samples
        now = time.monotonic()
        interval, self._last_step_end = max(now - self._last_step_end, 1e-9), now  # its wait for data included
        self.metrics.log({
            "step": version, "version": version, "train/samples": self.samples_total, **data.metrics, **stats,
            "throughput/samples_per_s": data.samples / interval,
            "throughput/gen_tokens_per_s": data.gen_tokens / interval,
            "learner/idle_frac": min(1.0, data.waited / interval),
            "sync/seconds": sync_s, "sync/bytes": self.sync_bytes,
            "sync/broadcast_seconds": self.sender.last_broadcast_s, **self.coordinator.counters(),
        }, texts=data.texts, samples=data.dumped, histograms={
            # Importance weights and sequence log-ratios of rank 0's rows only (whole
            # groups, 1/learner.ranks of the batch): a fair sample, without a collective.
            **data.histograms, **{tag: torch.cat(values) for tag, values in histograms.items() if values}})
        self.health.check_mismatch(version, stats)
        self.log_evals()

    def request_eval(self, version: int) -> None:
        self.coordinator.request_eval(version)

    def save_version(self, version: int):
        """What the gather of `version`'s weights streams into for the evaluator (a
        thread writes them while training goes on)."""
        if self.versions is None:
            return drain
        return self.versions.saver(version, self.version_times.get(version, self.metrics.elapsed()))

    def log_evals(self) -> int:
        """Log the evaluation rounds finished (by the evaluator or the actors), each at its
        version's step and stamped with the version's time; returns how many are still open."""
        lines, pending = self.coordinator.eval_results()
        if self.evaluator is not None:
            if (note := self.evaluator.watch()) is not None:
                log.warning("%s", note)
            if self.versions.error is not None:
                log.error("a version could not be saved for the evaluator (%s): its evaluation is skipped",
                          self.versions.error)
                self.versions.error = None
            lines += self.versions.results()
            pending += 0 if self.evaluator.given_up else len(self.versions.pending)
        if lines:
            self._last_eval_line = time.monotonic()
        for line in sorted(lines, key=lambda line: line["step"]):
            line.setdefault("version_time", self.version_times.get(line["version"]))
            self.metrics.log(line)
            if self.last_eval is None or line["step"] >= self.last_eval["step"]:
                self.last_eval = line
        return pending

    # -- checkpoints and the end --------------------------------------------------
    def checkpoint_state(self, trainer: Trainer):
        """(the run's state for a checkpoint, what rank 0 writes beside it)."""
        coordinator_state, groups = self.coordinator.snapshot()
        state = {"version": trainer.version, "coordinator": coordinator_state,
                 "learner": {**trainer.state(), "samples": self.samples_total, "elapsed": self.metrics.elapsed()}}

        def write_extra(directory: Path) -> None:  # save_checkpoint runs it on rank 0 only
            write_groups(directory / BUFFER_FILE, groups)
            (directory / "config.yaml").write_text(to_yaml(self.cfg))

        return state, write_extra

    def checkpoint_written(self) -> None:
        # After the checkpoint is complete: the trace a resumed run continues never runs
        # ahead of the checkpoint it resumes from.
        self.trace.write()

    def export(self, version: int):
        """What the gather of the final weights streams into: final/, in the dtype the
        actors held them (a Hugging Face model directory; with LoRA the adapter, loadable
        with peft on the base), its card, and with checkpoint.final_master the float32
        master weights in final-master/."""
        cfg, tokenizer, path = self.cfg, self.prompt_format.tokenizer, self.cfg.model.path
        dtype, master = actors_dtype(cfg), cfg.checkpoint.final_master
        card = card_text(dtype=str(dtype).removeprefix("torch."), step=version, last_eval=self.last_eval,
                         engine=cfg.actors.engine.name, master=master)

        targets = [(self.run_dir / "final", dtype)] + ([(self.run_dir / MASTER_DIR, None)] if master else [])

        def write(params) -> None:
            masters = [(name, t.detach().cpu()) for name, t in params]
            for out, as_dtype in targets:
                with writing("the final model", out):
                    if cfg.model.lora.rank:
                        cast = [(name, t.to(as_dtype or t.dtype)) for name, t in masters]
                        save_lora_final(cast, cfg.model.lora, path, tokenizer, out)
                    else:
                        save_hf_model(masters, path, tokenizer, out, dtype=as_dtype)
            with writing("the final model", self.run_dir / "final"):
                (self.run_dir / "final" / CARD_FILE).write_text(card)

        return write

    def eval_idle_s(self, since: float) -> float:
        """Seconds without an evaluation line or a chunk of one (with the actors
        evaluating, without any of their messages), counted from `since` at the earliest."""
        if self.evaluator is not None:
            chunk = time.monotonic() - (time.time() - self.versions.last_progress())  # its wall clock, ours
            return time.monotonic() - max(since, self._last_eval_line, chunk)
        return self.coordinator.idle_s(since=since)

    def close(self) -> None:
        self.log_evals()
        if self.evaluator is not None:
            self.evaluator.stop()
            self.versions.flush()
        self.coordinator.stop()
        # Actors already said goodbye: a broadcast still waiting for them (the last
        # step's weights) would only run into its timeout, so do not wait for it.
        self.sender.close(wait_s=1.0)
        self.metrics.close()
        self.trace.write()  # again: the actors' last spans came with their goodbyes
        release_room(self.run_dir)


class Followers:
    """What ranks other than 0 do where rank 0 uses its services: their part of each
    collective, nothing else."""

    spans = SpanRecorder(enabled=False)
    pad_id = 0

    def measure(self, taken, version: int, waited: float) -> None:
        return None

    def advance(self, version: int) -> None:
        pass

    def log_step(self, *args) -> None:
        pass

    def publish(self, version: int):
        return drain

    def export(self, version: int):
        return drain

    def request_eval(self, version: int) -> None:
        pass

    def save_version(self, version: int):
        return drain

    def checkpoint_state(self, trainer: Trainer):
        return None, None

    def checkpoint_written(self) -> None:
        pass

    def close(self) -> None:
        pass
