"""Learner: one torchrun worker per rank, the model sharded with FSDP2.

Rank 0 also hosts the coordinator (prompts, admission, replay buffer, registry,
evaluation rounds) and the weight broadcaster. Evaluation runs on the actors
(evaluation.py): the learner only asks for it and logs the results as they come.
One step (`Learner.run`): rank 0 takes `batch_groups` groups in admission order and
scatters whole groups to ranks; every rank runs `train_step` (advantages, losses,
optimizer steps; FSDP2 averages gradients); then the version increments and, every
`sync.every` steps, full weights go to the actors. The version counts learner steps,
whatever `train.minibatches` optimizer steps each one takes.

Run with: torchrun --nproc-per-node R -m async_rl.learner RUN_DIR/config.yaml [--resume CHECKPOINT]
"""
from __future__ import annotations

import collections
import logging
import math
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from async_rl.learner.schedule import lr_factor
from async_rl.learner.batching import Batch, scatter_batch
from async_rl.learner.checkpoint import BUFFER_FILE, load_checkpoint, read_groups, save_checkpoint, save_hf_model, write_groups
from async_rl.config import Config, to_yaml
from async_rl.learner.health import RunHealth
from async_rl.lora.adapters import is_adapter, save_lora_final
from async_rl.run.metrics import MetricsLogger
from async_rl.learner.sharding import build_models, full_parameters
from async_rl.tasks.prompt_format import prompt_limit
from async_rl.run.status import EXIT_CONFIG, EXIT_NONFINITE, EXIT_REWARD_ERRORS, EXIT_STALLED, write_status
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.tasks import task_from_config
from async_rl.run.processes import peak_rss_mb
from async_rl.device import resolve_device, collective_backend
from async_rl.user_code import describe
from async_rl.run.tracing import SpanRecorder, TraceWriter
from async_rl.learner.step import train_step
from async_rl.learner.step_data import StepData, measure_step

log = logging.getLogger("async_rl.learner")
POLL_S = 0.5  # how long rank 0 waits between the broadcasts that keep the other ranks with it
SKIPS_IN_A_ROW = 1000  # prompts skipped as too long, none granted between them: surely a config error


class Stop(NamedTuple):
    """How a run ended: status.json's exit code and reason."""
    exit_code: int
    reason: str


class Learner:
    def __init__(self, cfg: Config, resume: Path | None = None):
        """`resume`: a complete checkpoint directory to continue from."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = resolve_device(cfg.model.device)
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(cfg.seed)
        self.models = build_models(cfg, self.device, init_device_mesh(self.device.type, (self.world,)))
        self.model, self.optimizer = self.models.policy, self.models.optimizer
        # What the actors receive: every parameter, or with LoRA the adapters alone.
        self.synced = is_adapter if cfg.model.lora.rank else None
        # A DTensor reports its global shape, so no communication is needed here.
        self.specs = [(n, tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()
                      if self.synced is None or self.synced(n)]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(cfg.train.lr_schedule, cfg.train.max_steps, step))
        self.version = 0
        self.samples_total = self.skipped_total = 0
        self.skipped_streak = 0  # steps in a row with a non-finite loss or gradient
        self.stop_event = threading.Event()  # set by SIGINT/SIGTERM; rank 0 acts on it
        self.halt: Stop | None = None  # rank 0: a stop for want of data (_halt_for_want_of_data)
        self.spans = SpanRecorder(enabled=False)  # the timeline is rank 0's: see _init_rank0
        state = load_checkpoint(resume, self._trained_parts()) if resume else None
        if state is not None:
            self.version = state["version"]
            learner = state["learner"]
            self.scheduler.load_state_dict(learner["scheduler"])
            self.samples_total, self.skipped_total = learner["samples"], learner["skipped"]
        if self.rank == 0:
            self._init_rank0(resume=state is not None)
            if state is not None:
                log.info("resumed from %s at version %d", resume, self.version)
                self.coordinator.restore(self.version, state["coordinator"], read_groups(resume / BUFFER_FILE))
            self.coordinator.start()
            self.metrics = MetricsLogger(self.run_dir, cfg.train.max_steps, resume_step=self.version,
                                         elapsed=state["learner"]["elapsed"] if state else 0.0)

    def _trained_parts(self) -> dict:
        parts = {"model": (self.model, self.optimizer)}
        if self.models.critic is not None:
            parts["critic"] = (self.models.critic, self.models.critic_optimizer)
        return parts

    def _init_rank0(self, resume: bool) -> None:
        from async_rl.weight_transfer.broadcaster import WeightBroadcaster
        from async_rl.coordinator.coordinator import Coordinator

        cfg = self.cfg
        self.prompt_format = prompt_format_for(cfg.model.path, cfg.task)  # for the samples shown in TensorBoard
        self.task = task_from_config(cfg.task, cfg.seed)
        self.health = RunHealth(cfg.metrics.warn_after_steps, self.prompt_format.uses_chat, cfg.actors.max_new_tokens)
        specs = self.specs
        # vLLM's weight transfer carries whole models; LoRA adapters reach vLLM actors over the plain sync.
        engine = "torch" if self.synced is not None else cfg.actors.engine.name
        if engine == "vllm":  # the weights travel in the vLLM actors' dtype where it is 16-bit
            from async_rl.weight_transfer.vllm.transport import wire_dtype

            specs = [(name, shape, wire_dtype(cfg.actors.engine.dtype)) for name, shape, _ in specs]
        elif cfg.actors.engine.name == "torch" and cfg.actors.engine.dtype != "float32":  # torch actors hold their dtype
            specs = [(name, shape, getattr(torch, cfg.actors.engine.dtype)) for name, shape, _ in specs]
        self.sync_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)  # as they travel
        self.broadcaster = WeightBroadcaster(specs, bucket_mb=cfg.sync.bucket_mb, host=cfg.transport.host,
                                             backend=collective_backend(self.device), device=self.device,
                                             timeout_s=cfg.sync.timeout_s, transport=cfg.sync.transport,
                                             port=cfg.transport.store_port, engine=engine,
                                             double_buffer=cfg.sync.double_buffer)
        # The run's timeline (trace.json): this thread's spans, and the actors' via the coordinator.
        self.trace = TraceWriter(self.run_dir / "trace.json", resume=resume)
        self.spans = self.trace.learner
        lengths = prompt_format_for(cfg.model.path, cfg.task)  # the coordinator thread's own tokenizer
        self.prompt_limit = prompt_limit(cfg.task.max_prompt_tokens, self.model.config, cfg.actors.max_new_tokens)
        self.coordinator = Coordinator(cfg, self.task, self.broadcaster, self.run_dir, trace=self.trace,
                                       prompt_length=lambda prompt: len(lengths.encode(prompt)),
                                       prompt_limit=self.prompt_limit)

    # -- the loop ---------------------------------------------------------------
    def run(self) -> int:
        """Train to train.max_steps or a stop rule. Every rank returns 0: torchrun turns a
        worker's nonzero exit into its own error report, so the outcome goes in status.json."""
        cfg = self.cfg
        if self.version > 0:
            self._sync_weights()  # resumed: actors start from the base model, give them ours
        self._request_eval()
        self._last_step_end = time.monotonic()
        stop, interrupted = None, False
        while self.version < cfg.train.max_steps:
            local, data = self._next_batch()
            if local is None:  # rank 0 stopped before the step: a signal, or no data to be had
                stop, interrupted = self.halt or Stop(0, f"interrupted at step {self.version}"), True
                break
            is_weights: list[torch.Tensor] | None = [] if self.rank == 0 else None
            with self.spans.span("train-step", step=self.version + 1):
                stats = train_step(cfg, self.models, local, is_weights)
            stats["learner/skipped_steps"] = self._count_skipped_steps(stats["learner/skipped_steps"])
            stats["learner/lr"] = self.scheduler.get_last_lr()[0]
            stats["memory/learner_peak_rss_gb"], bad_rewards = self._all_reduce_verdicts(data)
            self.scheduler.step()
            self.version += 1
            if self.rank == 0:
                # Before the publish: its broadcast can complete, and the actors ask for
                # work at the new version, before publish() even returns (streamed buckets).
                self.coordinator.advance(self.version)
            sync_s = self._sync_weights() if self.version % cfg.sync.every == 0 else 0.0
            if self.rank == 0:
                self._log_step(stats, data, is_weights, sync_s)
            stop = self._nonfinite_stop() or self._reward_error_stop(bad_rewards, data)
            if stop is not None:
                break
            if self._due(cfg.eval.every):
                self._request_eval()
            if self._due(cfg.checkpoint.every):
                self._checkpoint()
        if not interrupted:
            self._final_eval()
        self._finish()
        if self.rank == 0:
            write_status(self.run_dir, *(stop or Stop(0, "finished")))
        return 0

    def _due(self, every: int) -> bool:
        """Every `every` steps (0: never), but not after the last: the end evaluates and checkpoints anyway."""
        return bool(every) and self.version % every == 0 and self.version < self.cfg.train.max_steps

    # -- pieces of a step -------------------------------------------------------
    def _next_batch(self) -> tuple[Batch | None, StepData | None]:
        """Rank 0 takes the next groups and scatters them: (this rank's rows, rank 0's
        StepData). (None, None) on every rank once rank 0 stops instead: on a signal,
        or when no data can come (self.halt)."""
        cfg, taken = self.cfg, None
        started = time.monotonic()

        def poll() -> bool | None:
            nonlocal taken
            taken = self.coordinator.take(cfg.train.batch_groups, self.version, timeout=POLL_S, stop=self.stop_event)
            if taken is not None or self.stop_event.is_set():
                return taken is not None
            self.halt = self._halt_for_want_of_data(since=started)
            return False if self.halt else None

        with self.spans.span("wait-for-data", step=self.version + 1):
            if not self._wait_together((lambda: False) if self._signalled() else poll):
                return None, None
        data, pad_id = None, 0
        if self.rank == 0:
            data = measure_step(cfg, taken, self.version, time.monotonic() - started, self.prompt_format, self.health)
            pad_id = self.prompt_format.tokenizer.pad_token_id or 0
        groups = taken.groups if taken is not None else None
        return scatter_batch(groups, pad_id, self.rank, self.world, cfg.train.minibatches, self.device), data

    def _wait_together(self, poll) -> bool:
        """Every rank waits until rank 0's `poll()` says go (True) or stop (False); None =
        not yet. One small broadcast per poll (a poll blocks rank 0 for at most about
        POLL_S): no rank sits in one collective, whose timeout is learner.timeout_s, for
        as long as rank 0 waits for the actors, whether they generate or evaluate."""
        flag = torch.zeros(1, dtype=torch.float64, device=self.device)
        while True:
            if self.rank == 0:
                outcome = poll()
                flag[0] = 0.0 if outcome is None else 1.0 if outcome else 2.0
            dist.broadcast(flag, src=0)
            if flag[0] > 0:
                return bool(flag[0] == 1.0)

    def _count_skipped_steps(self, skipped: float) -> float:
        """The run's total of optimizer steps skipped for a non-finite loss or gradient,
        with this step's `skipped`; also keeps the streak of steps with such skips."""
        self.skipped_total += skipped
        self.skipped_streak = self.skipped_streak + 1 if skipped else 0
        if self.skipped_streak and self.rank == 0:
            log.warning("step %d: non-finite loss or gradient, %d optimizer step(s) skipped (%d in a row)",
                        self.version + 1, skipped, self.skipped_streak)
        return self.skipped_total

    def _all_reduce_verdicts(self, data: StepData | None) -> tuple[float, bool]:
        """(the largest peak RSS over the ranks in GB, whether the step's reward failures
        stop the run), in one all-reduce: only rank 0 sees the step's reward failures."""
        bad_rewards = data is not None and data.metrics["reward/error_frac"] > self.cfg.reward.max_error_frac
        shared = torch.tensor([peak_rss_mb(), float(bad_rewards)], dtype=torch.float64, device=self.device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return float(shared[0]) / 1024, bool(shared[1] > 0)

    def _gather(self, consume, keep=None) -> None:
        """Gather full parameters (those `keep` accepts) one tensor at a time (a
        collective on every rank); rank 0 hands the (name, tensor) stream to `consume`."""
        params = full_parameters(self.model, keep)
        if self.rank == 0:
            consume(params)
        else:
            collections.deque(params, maxlen=0)

    def _sync_weights(self) -> float:
        started = time.monotonic()
        with self.spans.span("sync", version=self.version):  # gather + publish; the broadcast runs behind
            self._gather(lambda params: self.broadcaster.publish(self.version, params), self.synced)
        return time.monotonic() - started

    def _log_step(self, stats: dict[str, float], data: StepData, is_weights: list[torch.Tensor], sync_s: float) -> None:
        """Rank 0: the step's metrics line, each part named where it is computed, then
        the evaluation rounds the actors finished."""
        self.samples_total += data.samples
        self.metrics.log({
            "step": self.version, "version": self.version, "train/samples": self.samples_total, **data.metrics,
            **stats, **self._throughput(data), "sync/seconds": sync_s, "sync/bytes": self.sync_bytes,
            "sync/broadcast_seconds": self.broadcaster.last_broadcast_s, **self.coordinator.counters(),
        }, texts=data.texts, histograms={
            # Importance weights of rank 0's tokens only (whole groups, 1/learner.ranks
            # of the batch): a fair sample of the batch, without a collective.
            **data.histograms, "is/weight": torch.cat(is_weights) if is_weights else []})
        self._log_evals()

    def _throughput(self, data: StepData) -> dict[str, float]:
        """Rates over the time since the previous step ended, its wait for data included."""
        now = time.monotonic()
        interval, self._last_step_end = max(now - self._last_step_end, 1e-9), now
        return {"throughput/samples_per_s": data.samples / interval,
                "throughput/gen_tokens_per_s": data.gen_tokens / interval,
                "learner/idle_frac": min(1.0, data.waited / interval)}

    # -- stop rules ---------------------------------------------------------------
    def _signalled(self) -> bool:
        """SIGINT/SIGTERM/SIGHUP arrived: rank 0 stops before its next batch, the others
        follow (_wait_together); the run ends with a checkpoint and final/, unevaluated."""
        return self.rank == 0 and self.stop_event.is_set()

    def _halt_for_want_of_data(self, since: float) -> Stop | None:
        """Rank 0, waiting for a batch since `since`: a stop when no data can come, every
        recent prompt being over the prompt limit (a config error), or the actors having
        given nothing for learner.timeout_s. The run then ends like an interrupted one."""
        c, timeout = self.coordinator, self.cfg.learner.timeout_s
        halt = None
        if c.too_long_in_a_row() >= SKIPS_IN_A_ROW:
            halt = Stop(EXIT_CONFIG, f"the last {c.too_long_in_a_row()} prompts were all longer than the prompt "
                        f"limit of {self.prompt_limit} tokens: raise task.max_prompt_tokens (or lower "
                        f"actors.max_new_tokens, which the default limit leaves room for)")
        elif c.idle_s(since=since) > timeout:
            halt = Stop(EXIT_STALLED, f"stopped at step {self.version}: no experience or evaluation result "
                        f"arrived for {timeout:.0f}s (learner.timeout_s; live actors: {c.live_actors}); "
                        f"start actors and --resume")
        if halt is not None:
            log.error("%s", halt.reason)
        return halt

    def _nonfinite_stop(self) -> Stop | None:
        """After train.max_skipped_steps steps in a row with a non-finite loss or
        gradient. Every rank counts the same streak (the skip decision is all-reduced)."""
        streak, limit = self.skipped_streak, self.cfg.train.max_skipped_steps
        if streak < limit:
            return None
        if self.rank == 0:
            log.error("stopping: %d consecutive steps with a non-finite loss or gradient (last at step %d); "
                      "weights are those of the last finite step, checkpoint at %s", streak, self.version,
                      self._checkpoint_dir())
        return Stop(EXIT_NONFINITE, f"stopped: {streak} consecutive steps with a non-finite loss or gradient "
                    f"(train.max_skipped_steps={limit}); the last checkpoint holds the weights of the last "
                    f"finite step")

    def _reward_error_stop(self, bad_rewards: bool, data: StepData | None) -> Stop | None:
        """When more of the step's samples than reward.max_error_frac were scored
        reward.fallback: rank 0's verdict (_all_reduce_verdicts), and its reason."""
        if not bad_rewards:
            return None
        if self.rank != 0:
            return Stop(EXIT_REWARD_ERRORS, "")
        reason = (f"stopped: {data.metrics['reward/error_frac']:.0%} of step {self.version}'s samples were "
                  f"scored reward.fallback ({describe(data.reward_errors)}), over "
                  f"reward.max_error_frac={self.cfg.reward.max_error_frac:g}: fix task.reward (the actor "
                  f"log has its first failure of each kind)")
        log.error("%s; checkpoint at %s", reason, self._checkpoint_dir())
        return Stop(EXIT_REWARD_ERRORS, reason)

    # -- evaluation -------------------------------------------------------------
    def _request_eval(self) -> None:
        if self.rank == 0:
            self.coordinator.request_eval(self.version)

    def _log_evals(self) -> int:
        """Log the evaluation rounds the actors finished; returns how many are still open."""
        lines, pending = self.coordinator.eval_results()
        for line in lines:
            self.metrics.log(line)
        return pending

    def _final_eval(self) -> None:
        """Evaluate the final weights on the actors and wait for every open round, for as
        long as results keep coming (learner.timeout_s without one ends the wait)."""
        if self.version % self.cfg.sync.every:
            self._sync_weights()  # the actors must hold the final weights to evaluate them
        self._request_eval()
        started, timeout = time.monotonic(), self.cfg.learner.timeout_s

        def poll() -> bool | None:
            if self._log_evals() == 0:
                return True
            if self.stop_event.is_set() or self.coordinator.idle_s(since=started) > timeout:
                log.warning("the final evaluation was given up (no result for %.0fs, or interrupted; live actors: "
                            "%d); final/ is written without it", timeout, self.coordinator.live_actors)
                return False
            time.sleep(POLL_S)
            return None

        with self.spans.span("eval", step=self.version):
            self._wait_together(poll)

    # -- checkpoints and the end ------------------------------------------------
    def _checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints" / f"step_{self.version:06d}"

    def _checkpoint(self) -> None:
        state = groups = None
        if self.rank == 0:
            coordinator_state, groups = self.coordinator.snapshot()
            state = {"version": self.version, "coordinator": coordinator_state, "learner": {
                "scheduler": self.scheduler.state_dict(), "samples": self.samples_total,
                "skipped": self.skipped_total, "elapsed": self.metrics.elapsed()}}

        def write_extra(directory: Path) -> None:  # save_checkpoint runs it on rank 0 only
            write_groups(directory / BUFFER_FILE, groups)
            (directory / "config.yaml").write_text(to_yaml(self.cfg))

        with self.spans.span("checkpoint", step=self.version):
            save_checkpoint(self._checkpoint_dir(), self._trained_parts(), state, write_extra,
                            keep=self.cfg.checkpoint.keep)
        if self.rank == 0:
            # After the checkpoint is complete: the trace a resumed run continues never
            # runs ahead of the checkpoint it resumes from.
            self.trace.write()

    def _finish(self) -> None:
        self._checkpoint()
        with self.spans.span("export", step=self.version):
            if self.synced is not None:  # LoRA: final/ is the adapter, loadable with peft on the base
                self._gather(lambda params: save_lora_final(params, self.cfg.model.lora, self.cfg.model.path,
                                                            self.prompt_format.tokenizer, self.run_dir / "final"),
                             self.synced)
            else:
                self._gather(lambda params: save_hf_model(params, self.cfg.model.path, self.prompt_format.tokenizer,
                                                          self.run_dir / "final"))
        if self.rank == 0:
            self._log_evals()
            self.coordinator.stop()
            # Actors already said goodbye: a broadcast still waiting for them (the last
            # step's weights) would only run into its timeout, so do not wait for it.
            self.broadcaster.close(wait_s=1.0)
            self.metrics.close()
            self.trace.write()  # again: the actors' last spans came with their goodbyes

