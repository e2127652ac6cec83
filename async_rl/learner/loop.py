"""The learner's loop, the same on every rank: the every-rank trainer (trainer.py) and
rank 0's services (services.py; `Followers` elsewhere) run together.

    resumed?  send the actors the restored weights
    evaluate the first version
    until train.max_steps or a stop rule:
        wait for the next batch (rank 0 takes it in admission order; every rank waits with it)
        scatter whole groups to the ranks; one learner step; version += 1
        every sync.every steps: gather the weights and publish them to the actors
        log the step; stop rules; evaluation and checkpoint when due
    the final evaluation, a checkpoint, final/

An evaluation is the version's weights saved for the evaluator (evaluator/; the run
goes on at once) or a round the actors score (eval.placement).

The version counts learner steps, whatever train.minibatches optimizer steps each
takes. Whenever rank 0 waits (for data, for the final evaluation) the other ranks wait
with it in short broadcasts, never in one collective as long as learner.timeout_s.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from async_rl.config import Config
from async_rl.learner.batching import Batch, scatter_batch
from async_rl.learner.step_data import StepData, describe
from async_rl.learner.trainer import Trainer
from async_rl.run.processes import peak_rss_mb
from async_rl.run.status import EXIT_CONFIG, EXIT_NONFINITE, EXIT_REWARD_ERRORS, EXIT_STALLED, no_restarts

log = logging.getLogger("async_rl.learner")
POLL_S = 0.5  # how long rank 0 waits between the broadcasts that keep the other ranks with it
EVAL_POLL_S = 0.05  # between looks at the final evaluation: the run's last wait, on the console
SKIPS_IN_A_ROW = 1000  # prompts skipped as too long, none granted between them: surely a config error


class Stop(NamedTuple):
    """How a run ended: status.json's exit code and reason."""
    exit_code: int
    reason: str


class Loop:
    def __init__(self, cfg: Config, trainer: Trainer, services, stop_event: threading.Event):
        """`services`: rank 0's (services.Rank0Services), elsewhere services.Followers;
        `stop_event`: set by SIGINT/SIGTERM/SIGHUP, rank 0 acts on it."""
        self.cfg, self.trainer, self.services, self.stop_event = cfg, trainer, services, stop_event
        self.rank0 = trainer.rank == 0
        self.spans = services.spans
        self.halt: Stop | None = None  # rank 0: a stop for want of data
        self.no_actor_since: float | None = None  # rank 0: since when no actor is live, none to be restarted
        self.compile_reported = False

    def run(self) -> Stop:
        """Train to train.max_steps or a stop rule; returns how the run ended."""
        cfg, trainer, services = self.cfg, self.trainer, self.services
        if trainer.version > 0:
            self.sync_weights()  # resumed: actors start from the base model, give them ours
        self.evaluate()
        stop = None
        while trainer.version < cfg.train.max_steps:
            local, data = self.next_batch()
            if local is None:  # rank 0 stopped before the step: a signal, or no data to be had
                stop = self.halt or Stop(0, f"interrupted at step {trainer.version}")
                break
            histograms: dict[str, list[torch.Tensor]] | None = {} if self.rank0 else None
            started = time.monotonic()
            with self.spans.span("train-step", step=trainer.version + 1):
                stats = trainer.step(local, histograms)
            if cfg.learner.compile and self.rank0 and not self.compile_reported:  # a restart's is shorter: cached
                log.info("the first step took %.1f s, compiling the blocks included (learner.compile)",
                         time.monotonic() - started)
                self.compile_reported = True
            stats["memory/learner_peak_rss_gb"], bad_rewards = self.all_reduce_verdicts(data)
            # Before the publish: its broadcast can complete, and the actors ask for work at
            # the new version, before publish() even returns (streamed buckets).
            services.advance(trainer.version)
            sync_s = self.sync_weights() if trainer.version % cfg.sync.every == 0 else 0.0
            services.log_step(trainer.version, stats, data, histograms, sync_s)
            stop = self.nonfinite_stop() or self.reward_error_stop(bad_rewards, data)
            if stop is not None:
                break
            if self.due(cfg.eval.every):
                self.evaluate()
            if self.due(cfg.checkpoint.every):
                self.checkpoint()
        if stop is None:  # a run stopped by a rule is not worth evaluating: its end must not wait on broken code
            self.final_eval()
        self.checkpoint()
        with self.spans.span("export", step=trainer.version):
            trainer.gather(services.export(trainer.version))
        services.close()
        return stop or Stop(0, "finished")

    def due(self, every: int) -> bool:
        """Every `every` steps (0: never), but not after the last: the end evaluates and checkpoints anyway."""
        version = self.trainer.version
        return bool(every) and version % every == 0 and version < self.cfg.train.max_steps

    # -- pieces of a step -------------------------------------------------------
    def next_batch(self) -> tuple[Batch | None, StepData | None]:
        """Rank 0 takes the next groups and scatters them: (this rank's rows, rank 0's
        StepData). (None, None) on every rank once rank 0 stops instead: on a signal,
        or when no data can come (self.halt)."""
        trainer, taken = self.trainer, None
        started = time.monotonic()

        def poll() -> bool | None:
            nonlocal taken
            taken = self.services.take(trainer.version, timeout=POLL_S, stop=self.stop_event)
            if taken is not None or self.stop_event.is_set():
                return taken is not None
            self.halt = self.halt_for_want_of_data(since=started)
            return False if self.halt else None

        signalled = self.rank0 and self.stop_event.is_set()  # the others follow rank 0's word
        with self.spans.span("wait-for-data", step=trainer.version + 1):
            if not self.wait_together((lambda: False) if signalled else poll):
                return None, None
        data = self.services.measure(taken, trainer.version, time.monotonic() - started)
        groups = taken.groups if taken is not None else None
        local = scatter_batch(groups, self.services.pad_id, trainer.rank, trainer.world, self.cfg.train.minibatches,
                              trainer.device)
        return local, data

    def wait_together(self, poll) -> bool:
        """Every rank waits until rank 0's `poll()` says go (True) or stop (False); None =
        not yet. One small broadcast per poll (a poll blocks rank 0 for at most about
        POLL_S): no rank sits in one collective, whose timeout is learner.timeout_s, for
        as long as rank 0 waits for the actors, whether they generate or evaluate."""
        flag = torch.zeros(1, dtype=torch.float64, device=self.trainer.device)
        while True:
            if self.rank0:
                outcome = poll()
                flag[0] = 0.0 if outcome is None else 1.0 if outcome else 2.0
            dist.broadcast(flag, src=0)
            if flag[0] > 0:
                return bool(flag[0] == 1.0)

    def all_reduce_verdicts(self, data: StepData | None) -> tuple[float, bool]:
        """(the largest peak RSS over the ranks in GB, whether the step's reward failures
        stop the run), in one all-reduce: only rank 0 sees the step's reward failures."""
        bad_rewards = data is not None and data.metrics["reward/error_frac"] > self.cfg.reward.max_error_frac
        shared = torch.tensor([peak_rss_mb(), float(bad_rewards)], dtype=torch.float64, device=self.trainer.device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return float(shared[0]) / 1024, bool(shared[1] > 0)

    def sync_weights(self) -> float:
        """Gather the weights and publish them (rank 0); the broadcast runs behind."""
        started = time.monotonic()
        with self.spans.span("sync", version=self.trainer.version):
            self.trainer.gather(self.services.publish(self.trainer.version))
        return time.monotonic() - started

    # -- stop rules ---------------------------------------------------------------
    def halt_for_want_of_data(self, since: float) -> Stop | None:
        """Rank 0, waiting for a batch since `since`: a stop when no data can come, every
        recent prompt being over the prompt limit (a config error), no actor live for
        actors.heartbeat_timeout_s with none to be restarted, or the actors having given
        nothing for learner.timeout_s.
        The run then ends like an interrupted one."""
        c, timeout, version = self.services.coordinator, self.cfg.learner.timeout_s, self.trainer.version
        halt = None
        note = no_restarts(Path(self.cfg.run_dir)) if c.live_actors == 0 else None
        if note is None:
            self.no_actor_since = None
        elif self.no_actor_since is None:  # an actor between removal and registering again is not gone yet
            self.no_actor_since = time.monotonic()
        if note is not None and time.monotonic() - self.no_actor_since > self.cfg.actors.heartbeat_timeout_s:
            halt = Stop(EXIT_STALLED, f"stopped at step {version}: no actor is left ({note}); fix what stopped it "
                        f"and --resume")
        elif c.too_long_in_a_row() >= SKIPS_IN_A_ROW:
            halt = Stop(EXIT_CONFIG, f"the last {c.too_long_in_a_row()} prompts were all longer than the prompt "
                        f"limit of {self.services.prompt_limit} tokens: raise task.max_prompt_tokens (or lower "
                        f"actors.max_new_tokens, which the default limit leaves room for)")
        elif c.idle_s(since=since) > timeout:
            halt = Stop(EXIT_STALLED, f"stopped at step {version}: no experience or evaluation result "
                        f"arrived for {timeout:.0f}s (learner.timeout_s; live actors: {c.live_actors}); "
                        f"start actors and --resume")
        if halt is not None:
            log.error("%s", halt.reason)
        return halt

    def nonfinite_stop(self) -> Stop | None:
        """After train.max_skipped_steps steps in a row with a non-finite loss or
        gradient. Every rank counts the same streak (the skip decision is all-reduced)."""
        streak, limit = self.trainer.skipped_streak, self.cfg.train.max_skipped_steps
        if streak and self.rank0:
            log.warning("step %d: non-finite loss or gradient, optimizer step(s) skipped (%d in a row)",
                        self.trainer.version, streak)
        if streak < limit:
            return None
        if self.rank0:
            log.error("stopping: %d consecutive steps with a non-finite loss or gradient (last at step %d); "
                      "weights are those of the last finite step, checkpoint at %s", streak, self.trainer.version,
                      self.checkpoint_dir())
        return Stop(EXIT_NONFINITE, f"stopped: {streak} consecutive steps with a non-finite loss or gradient "
                    f"(train.max_skipped_steps={limit}); the last checkpoint holds the weights of the last "
                    f"finite step")

    def reward_error_stop(self, bad_rewards: bool, data: StepData | None) -> Stop | None:
        """When more of the step's samples than reward.max_error_frac failed in their
        reward or environment: rank 0's verdict (all_reduce_verdicts), and its reason, which
        names the code that failed most (the environment or the task's reward)."""
        if not bad_rewards:
            return None
        if not self.rank0:
            return Stop(EXIT_REWARD_ERRORS, "")
        errors = data.errors
        if errors.in_environment():
            culprit, counts, fix = f"environment {self.cfg.env.name}", errors.env, "fix the environment"
        elif self.cfg.reward.components:
            served = any(c.placement == "server" for c in self.cfg.reward.components)
            culprit, counts = "reward.components", errors.reward
            fix = "fix the failing component" + (" or the reward server (its log: logs/reward-server.log)"
                                                 if served else "")
        else:
            culprit, counts, fix = "task.reward", errors.reward, "fix task.reward"
        first = f"; first: {errors.first}" if errors.first else ""
        fate = ("were left out as unscorable" if self.cfg.reward.on_failure == "exclude"
                else "were scored reward.fallback")
        reason = (f"stopped: {errors.frac:.0%} of step {self.trainer.version}'s samples failed in {culprit} "
                  f"({describe(counts)}) and {fate}, over "
                  f"reward.max_error_frac={self.cfg.reward.max_error_frac:g}: {fix} (the actor log has its "
                  f"first failure of each kind, with its traceback){first}")
        log.error("%s; checkpoint at %s", reason, self.checkpoint_dir())
        return Stop(EXIT_REWARD_ERRORS, reason)

    # -- evaluation and checkpoints -----------------------------------------------
    def evaluate(self) -> None:
        """An evaluation round of the current version: its weights saved for the evaluator
        (a gather, on every rank), or a round for the actors."""
        if self.cfg.eval.placement == "evaluator":
            with self.spans.span("save-version", step=self.trainer.version):
                self.trainer.gather(self.services.save_version(self.trainer.version))
        else:
            self.services.request_eval(self.trainer.version)

    def final_eval(self) -> None:
        """Evaluate the final weights and wait for every open round, for as long as
        results keep coming (learner.timeout_s without one ends the wait)."""
        if self.cfg.eval.placement == "actors" and self.trainer.version % self.cfg.sync.every:
            self.sync_weights()  # the actors must hold the final weights to evaluate them
        self.evaluate()
        started, timeout = time.monotonic(), self.cfg.learner.timeout_s

        def poll() -> bool | None:
            if self.services.log_evals() == 0:
                return True
            if self.stop_event.is_set() or self.services.eval_idle_s(since=started) > timeout:
                log.warning("the final evaluation was given up (no result for %.0fs, or interrupted; live actors: "
                            "%d); final/ is written without it", timeout, self.services.coordinator.live_actors)
                return False
            time.sleep(EVAL_POLL_S)
            return None

        with self.spans.span("eval", step=self.trainer.version):
            self.wait_together(poll)

    def checkpoint_dir(self) -> Path:
        return Path(self.cfg.run_dir) / "checkpoints" / f"step_{self.trainer.version:06d}"

    def checkpoint(self) -> None:
        state, write_extra = self.services.checkpoint_state(self.trainer)
        with self.spans.span("checkpoint", step=self.trainer.version):
            self.trainer.save(self.checkpoint_dir(), state, write_extra, keep=self.cfg.checkpoint.keep)
        self.services.checkpoint_written()
