"""Supervised training on demonstrations, on every rank of the learner's world.

The model is the learner's (learner/models.py's policy: the same loading, LoRA adapters
when model.lora.rank > 0, FSDP2 sharding, precision and activation checkpointing), and
so is the optimizer (AdamW) with a schedule over all the epochs' steps. Each step
takes `sft.batch_size` conversations in a seeded shuffle, each rank every world-th of
them in micro-batches of `learner.micro_batch_size` right-padded rows. The loss is the
mean negative log-likelihood of the assistant tokens of the whole batch (every
assistant token counts the same, as in TRL's and verl's SFT trainers), so a step does
not depend on how the batch is split among ranks and micro-batches.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from async_rl.algorithms.normalization import backward_share
from async_rl.algorithms.token_logp import chosen_logp
from async_rl.config import Config
from async_rl.learner.checkpoint import save_hf_model
from async_rl.learner.models import load_policy
from async_rl.learner.optimizer import adamw, lr_factor
from async_rl.learner.precision import dither_masters
from async_rl.learner.sharding import full_parameters, shard_model
from async_rl.learner.step import clipped_grad_norm
from async_rl.learner.trainer import drain
from async_rl.sft.conversations import Demonstration

log = logging.getLogger("async_rl.sft")


@dataclass
class Split:
    train: list[Demonstration]
    held_out: list[Demonstration]
    cut: int  # conversations longer than sft.max_tokens, cut there


def save_split(path: Path, split: Split) -> None:
    """The split as msgpack (ids and trained masks), written atomically."""
    import msgspec

    def rows(demos):
        return [[d.ids, d.trained] for d in demos]

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(msgspec.msgpack.encode({"train": rows(split.train), "held_out": rows(split.held_out),
                                            "cut": split.cut}))
    tmp.replace(path)


def load_split(path: Path) -> Split:
    import msgspec

    data = msgspec.msgpack.decode(path.read_bytes())
    return Split([Demonstration(ids, trained) for ids, trained in data["train"]],
                 [Demonstration(ids, trained) for ids, trained in data["held_out"]], data["cut"])


def split_demonstrations(demos: Sequence[Demonstration], max_tokens: int, eval_fraction: float, seed: int) -> Split:
    """Cut each to max_tokens, drop those left with nothing to train, hold out a seeded
    `eval_fraction` (at least one conversation when the fraction is positive)."""
    cut = sum(len(d.ids) > max_tokens for d in demos)
    kept = [Demonstration(d.ids[:max_tokens], d.trained[:max_tokens]) for d in demos]
    kept = [d for d in kept if any(d.trained[1:])]  # the first token has no prediction
    if not kept:
        raise ValueError(f"no conversation has an assistant token within sft.max_tokens={max_tokens}")
    order = np.random.default_rng(seed).permutation(len(kept))
    held = min(len(kept) - 1, math.ceil(eval_fraction * len(kept))) if eval_fraction > 0 else 0
    return Split([kept[i] for i in order[held:]], [kept[i] for i in order[:held]], cut)


def sharded_with_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device, world: int,
                           lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`model` sharded by FSDP2 over `world` ranks with the learner's precision and
    activation checkpointing, and the learner's AdamW on what it trains, at peak `lr`."""
    from torch.distributed.device_mesh import init_device_mesh

    lc = cfg.learner
    sharded = shard_model(model, init_device_mesh(device.type, (world,)), precision=lc.precision,
                          activation_checkpointing=lc.activation_checkpointing, compile=lc.compile)
    return sharded, adamw([p for p in sharded.parameters() if p.requires_grad], lr=lr,
                          weight_decay=cfg.train.weight_decay, eps=cfg.train.adam_eps)


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule, total_steps: int):
    """`schedule` (a ScheduleConfig) over `total_steps` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(schedule, total_steps, step))


def apply_step(optimizer: torch.optim.Optimizer, scheduler, finite: bool) -> float:
    """The optimizer's step when the step's loss and gradient norm were finite (global
    figures: the same on every rank), then the schedule's; the learning rate it used."""
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    return lr


def rank_micro_batches(batch: Sequence, rank: int, world: int, size: int) -> list[list]:
    """This rank's share of `batch` (the same list on every rank) in micro-batches of
    `size`, as many as every other rank runs (FSDP's collectives run per forward and
    backward); [] marks a padding one."""
    mine = list(batch[rank::world])
    count = math.ceil(math.ceil(len(batch) / world) / size)
    return [mine[k * size:(k + 1) * size] for k in range(count)]


def padded(demos: Sequence[Demonstration], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, trained-target mask) of right-padded rows; the target
    mask is over the shifted positions: [n, L-1]."""
    width = max(len(d.ids) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    target = torch.zeros((len(demos), width), dtype=torch.bool)
    for row, d in enumerate(demos):
        ids[row, :len(d.ids)] = torch.tensor(d.ids)
        attention[row, :len(d.ids)] = 1
        target[row, :len(d.ids)] = torch.tensor(d.trained)
    return ids.to(device), attention.to(device), target[:, 1:].to(device)


class SFTTrainer:
    def __init__(self, cfg: Config, device: torch.device, pad_id: int):
        self.cfg, self.device, self.pad_id = cfg, device, pad_id
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        policy = load_policy(cfg, device)
        dither_masters(policy, cfg)
        if cfg.model.lora.rank:
            from async_rl.lora.adapters import with_adapters

            policy = with_adapters(policy, cfg.model.lora)
        self.model, self.optimizer = sharded_with_optimizer(policy, cfg, device, self.world, cfg.sft.lr)
        self.steps_done = 0

    def schedule(self, total_steps: int) -> None:
        self.scheduler = lr_scheduler(self.optimizer, self.cfg.sft.lr_schedule, total_steps)

    def _micro_batches(self, batch: Sequence[Demonstration]) -> list[list[Demonstration]]:
        return rank_micro_batches(batch, self.rank, self.world, self.cfg.learner.micro_batch_size)

    def _nll_sum(self, demos: Sequence[Demonstration]) -> torch.Tensor:
        """Summed negative log-likelihood of the trained tokens of `demos` ([] scores a
        one-token row with weight 0, to keep the ranks' collectives in step)."""
        rows = list(demos) or [Demonstration([self.pad_id], [False])]
        ids, attention, target = padded(rows, self.pad_id, self.device)
        logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        if not target.any():
            return logits.sum() * 0.0
        logp, _ = chosen_logp(logits[target].contiguous(), ids[:, 1:][target])
        return -logp.sum()

    def step(self, batch: Sequence[Demonstration]) -> dict[str, float]:
        """One optimizer step on `batch` (the same list on every rank); global figures."""
        tokens = sum(d.trained_tokens - d.trained[0] for d in batch)
        total = torch.zeros((), device=self.device)
        for micro in self._micro_batches(batch):
            nll = self._nll_sum(micro)
            backward_share(nll / tokens, self.world)
            total += nll.detach()
        grad_norm = clipped_grad_norm(self.model, self.cfg.train.grad_clip)
        if self.world > 1:
            dist.all_reduce(total)
        finite = math.isfinite(float(total)) and math.isfinite(float(grad_norm))
        lr = apply_step(self.optimizer, self.scheduler, finite)
        self.steps_done += 1
        return {"sft/loss": float(total) / tokens, "sft/grad_norm": float(grad_norm), "sft/lr": lr,
                "sft/tokens": tokens, "sft/skipped": 0.0 if finite else 1.0}

    @torch.no_grad()
    def held_out_loss(self, demos: Sequence[Demonstration]) -> float:
        """Mean negative log-likelihood per trained token of `demos`, over all ranks."""
        tokens = sum(d.trained_tokens - d.trained[0] for d in demos)
        total = torch.zeros((), device=self.device)
        for micro in self._micro_batches(demos):
            total += self._nll_sum(micro)
        if self.world > 1:
            dist.all_reduce(total)
        return float(total) / tokens

    def export(self, out: Path, tokenizer) -> None:
        """Write the trained model (a collective; rank 0 writes): a Hugging Face model
        directory. With LoRA: the adapter in OUT.adapter, merged into the base in OUT."""
        cfg = self.cfg
        if cfg.model.lora.rank:
            from async_rl.lora.adapters import is_adapter, save_adapter, save_merged

            adapter = out.with_name(out.name + ".adapter")
            params = full_parameters(self.model, is_adapter)
            if self.rank == 0:
                save_adapter(params, cfg.model.lora, cfg.model.path, tokenizer, adapter)
                save_merged(adapter, cfg.model.path, tokenizer, out)
            else:
                drain(params)
            return
        params = full_parameters(self.model)
        if self.rank == 0:
            save_hf_model(params, cfg.model.path, tokenizer, out)
        else:
            drain(params)
