"""Learner: one torchrun worker per rank, the model sharded with FSDP2.

Rank 0 also hosts the coordinator (prompts, admission, replay buffer, registry) and
the weight broadcaster. One step: rank 0 takes `batch_groups` groups in admission
order, computes advantages, scatters whole groups to ranks; every rank recomputes
log-probs, runs the loss over micro-batches, and FSDP2 averages gradients; then the
version increments and, every `sync.every` steps, full weights go to the actors.

Run with: torchrun --nproc-per-node R -m async_rl.roles.learner RUN_DIR/config.yaml
"""
from __future__ import annotations

import collections
import datetime
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .. import algorithms
from ..batching import Batch, build_batch, scatter_batch
from ..checkpoint import save_checkpoint, save_hf_model
from ..config import Config, load_config
from ..evaluation import evaluate
from ..runtime import load_tokenizer, make_task_from_config, quiet_libraries, resolve_device, sync_backend

log = logging.getLogger("async_rl.learner")


def shard_model(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer (HF names them in `_no_split_modules`), plus the root."""
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_parameters(model: torch.nn.Module):
    """Yield (name, full tensor) one parameter at a time; a collective on every rank."""
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield name, full.detach()


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)


def global_denominator(cfg: Config, batch: Batch, n_groups: int) -> float:
    if cfg.train.loss == "opmd":
        return float(n_groups)
    return algorithms.agg_denominator(batch.loss_mask, cfg.train.agg)


def lr_factor(cfg: Config, step: int) -> float:
    """Multiplier of train.lr at optimizer step `step` (0-based): warmup, then decay."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.lr_schedule == "cosine" else 1 - progress
    return t.lr_min_ratio + (1 - t.lr_min_ratio) * shape


def train_step(cfg: Config, model, optimizer, local: Batch, denominator: float, world: int) -> dict[str, float]:
    """Forward/backward over micro-batches of whole groups, then one optimizer step."""
    model.train()
    G = cfg.train.group_size
    rows_per_micro = max(1, cfg.learner.micro_batch_size // G) * G
    sums = torch.zeros(6, dtype=torch.float64)  # loss, clip_frac*d, sum w, sum w^2, tokens, d
    for start in range(0, local.tokens.shape[0], rows_per_micro):
        micro = local.rows(start, start + rows_per_micro)
        logp = token_logprobs(model, micro)
        if cfg.train.loss == "ppo":
            p = cfg.train.ppo
            loss, stats = algorithms.ppo_clip_loss(
                logp, logp.detach(), micro.logp_behav, micro.advantages, micro.loss_mask,
                eps_low=p.eps_low, eps_high=p.eps_high, is_cap=p.is_cap, decoupled=p.decoupled, agg=cfg.train.agg)
            d_micro = algorithms.agg_denominator(micro.loss_mask, cfg.train.agg)
        else:
            loss, stats = algorithms.opmd_loss(logp, micro.logp_behav, micro.loss_mask, micro.rewards, micro.group,
                                               tau=cfg.train.opmd.tau)
            d_micro = float(torch.unique(micro.group).numel())
        # FSDP2 averages gradients over ranks, so scale the micro loss to its share of
        # the global-batch normalization times the world size.
        (loss * (d_micro / denominator) * world).backward()
        # Behavior -> current-policy importance weights over the whole batch (diagnostic
        # ESS, summed across micro-batches and ranks so it is the global value).
        m = micro.loss_mask
        w = torch.exp(torch.where(m.bool(), logp.detach() - micro.logp_behav, 0.0))
        sums += torch.tensor([loss.item() * d_micro / denominator, stats.get("clip_frac", 0.0) * d_micro,
                              float((w * m).sum()), float((w * w * m).sum()), float(m.sum()), d_micro],
                             dtype=torch.float64)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sums = sums.to(local.tokens.device)  # NCCL reduces device tensors only
    dist.all_reduce(sums)
    loss_total, clip_d, sw, sw2, ntok, d = sums.tolist()
    return {"loss/total": loss_total, "is/clip_frac": clip_d / max(d, 1e-12),
            "is/ess": (sw * sw) / max(ntok * sw2, 1e-12), "learner/grad_norm": float(grad_norm)}


class Learner:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = resolve_device(cfg.model.device)
        from transformers import AutoModelForCausalLM
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).to(self.device)
        self.specs = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
        self.model = shard_model(model, init_device_mesh(self.device.type, (self.world,)))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_factor(cfg, step))
        self.version = 0
        self.stop_event = threading.Event()  # set by SIGINT/SIGTERM; rank 0 acts on it
        if self.rank == 0:
            self._init_rank0()

    def _init_rank0(self) -> None:
        from ..engines.torch_engine import TorchEngine
        from ..metrics import MetricsLogger
        from ..weight_sync import WeightBroadcaster
        from .coordinator import Coordinator

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.task = make_task_from_config(cfg)
        self.eval_engine = TorchEngine(cfg.model.path, device=self.device)  # full copy for eval and export
        self.broadcaster = WeightBroadcaster(self.specs, bucket_mb=cfg.sync.bucket_mb, host=cfg.transport.host,
                                             backend=sync_backend(self.device), device=self.device,
                                             timeout_s=cfg.sync.timeout_s)
        self.coordinator = Coordinator(cfg, self.task, self.broadcaster, self.run_dir)
        self.coordinator.start()
        self.metrics = MetricsLogger(self.run_dir, cfg.train.max_steps)

    # -- pieces of a step -------------------------------------------------------
    def _next_batch(self) -> tuple[Batch | None, dict[str, float]]:
        """Rank 0 takes the next groups and scatters them; (None, {}) on every rank once
        rank 0 decides to stop (signal received while training or waiting for data)."""
        info: dict[str, float] = {}
        batch = None
        if self.rank == 0 and not self.stop_event.is_set():
            cfg = self.cfg
            taken = self.coordinator.buffer.take(cfg.train.batch_groups, self.version,
                                                 timeout=cfg.learner.timeout_s, stop=self.stop_event)
            if taken is None and not self.stop_event.is_set():
                raise RuntimeError(f"no experience arrived for {cfg.learner.timeout_s:.0f}s "
                                   f"(live actors: {self.coordinator.live_actors})")
            if taken is not None:
                batch = build_batch(taken.groups, self.tokenizer.pad_token_id or 0)
                batch.advantages = algorithms.group_advantages(batch.rewards, batch.group,
                                                               method=cfg.train.advantage)
                staleness = [self.version - v for v in taken.versions]
                info = {"waited": taken.waited_s, "staleness/mean": sum(staleness) / len(staleness),
                        "staleness/max": max(staleness), "train/reward_mean": float(batch.rewards.mean()),
                        "gen_tokens": float(batch.loss_mask.sum()), "samples": float(batch.tokens.shape[0]),
                        "denominator": global_denominator(cfg, batch, len(taken.groups))}
        # [denominator, stop]: one small broadcast keeps every rank in lock-step.
        control = torch.tensor([info.get("denominator", 0.0), float(self.rank == 0 and batch is None)],
                               dtype=torch.float64, device=self.device)
        dist.broadcast(control, src=0)
        if control[1] > 0:
            return None, {}
        local = scatter_batch(batch, self.rank, self.world, self.device)
        info["denominator"] = float(control[0])
        return local, info

    def _gather(self, consume) -> None:
        """Gather full parameters one tensor at a time (a collective on every rank);
        rank 0 hands the (name, tensor) stream to `consume`."""
        params = full_parameters(self.model)
        if self.rank == 0:
            consume(params)
        else:
            collections.deque(params, maxlen=0)

    def _sync_weights(self) -> float:
        started = time.monotonic()
        self._gather(lambda params: self.broadcaster.publish(self.version, params))
        return time.monotonic() - started

    def _load_eval_copy(self, params) -> None:
        named = dict(self.eval_engine.parameters_for_sync())
        with torch.no_grad():
            for name, full in params:
                named[name].copy_(full)

    def _evaluate(self) -> None:
        self._gather(self._load_eval_copy)
        if self.rank != 0:
            return
        result = evaluate(self.eval_engine, self.tokenizer, self.task, max_new_tokens=self.cfg.actors.max_new_tokens)
        self.metrics.log({"step": self.version, "version": self.version, "eval/accuracy": result.accuracy,
                          "eval/reward_mean": result.reward_mean})

    # -- the loop ---------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        self._evaluate()
        samples_total, last_end = 0, time.monotonic()
        while self.version < cfg.train.max_steps:
            local, info = self._next_batch()
            if local is None:
                break
            stats = train_step(cfg, self.model, self.optimizer, local, info["denominator"], self.world)
            stats["learner/lr"] = self.scheduler.get_last_lr()[0]
            self.scheduler.step()
            self.version += 1
            sync_s = self._sync_weights() if self.version % cfg.sync.every == 0 else 0.0
            if self.rank == 0:
                self.coordinator.version = self.version
                now = time.monotonic()
                interval, last_end = max(now - last_end, 1e-9), now
                samples_total += int(info["samples"])
                c = self.coordinator
                self.metrics.log({
                    "step": self.version, "version": self.version, "train/reward_mean": info["train/reward_mean"],
                    "train/samples": samples_total, **stats, "staleness/mean": info["staleness/mean"],
                    "staleness/max": info["staleness/max"], "staleness/dropped": c.buffer.dropped,
                    "throughput/samples_per_s": info["samples"] / interval,
                    "throughput/gen_tokens_per_s": info["gen_tokens"] / interval,
                    "learner/idle_frac": min(1.0, info["waited"] / interval), "sync/seconds": sync_s,
                    "sync/broadcast_seconds": self.broadcaster.last_broadcast_s,
                    "wire/rejected": c.rejects.total, "actors/live": c.live_actors,
                    "data/prompts_admitted": c.admission.admitted, "data/prompts_consumed": c.buffer.consumed,
                })
            if cfg.eval.every and self.version % cfg.eval.every == 0 and self.version < cfg.train.max_steps:
                self._evaluate()
            if cfg.checkpoint.every and self.version % cfg.checkpoint.every == 0 and self.version < cfg.train.max_steps:
                self._checkpoint()
        self._evaluate()
        self._finish()
        return 0

    def _checkpoint(self) -> None:
        save_checkpoint(self.run_dir / "checkpoints" / f"step_{self.version:06d}", self.model, self.optimizer,
                        self._coordinator_state() if self.rank == 0 else None)

    def _finish(self) -> None:
        self._checkpoint()
        if self.rank == 0:
            # The final evaluation just loaded the final weights into the eval copy.
            save_hf_model(self.eval_engine.model, self.tokenizer, self.run_dir / "final")
            self.coordinator.stop()
            self.broadcaster.close()
            self.metrics.close()

    def _coordinator_state(self) -> dict:
        c = self.coordinator
        return {"version": self.version, "admitted": c.admission.admitted, "consumed": c.buffer.consumed,
                "dropped": c.buffer.dropped, "rejected": c.rejects.total}


def shutdown_world() -> None:
    """Leave the torchrun world together. A rank that tears gloo down while a peer is
    still working (rank 0 writing final/) intermittently aborts at exit with
    "terminate called without an active exception" (torch 2.13 CPU); a barrier first
    prevents it."""
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = load_config(argv[0])
    quiet_libraries()
    device = resolve_device(cfg.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(cfg.learner.threads)
    dist.init_process_group(backend=sync_backend(device), timeout=datetime.timedelta(seconds=cfg.learner.timeout_s))
    learner = Learner(cfg)

    def request_stop(signum, _frame):
        learner.stop_event.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    code = learner.run()
    shutdown_world()
    return code


if __name__ == "__main__":
    from ..runtime import exit_now

    exit_now(main())
