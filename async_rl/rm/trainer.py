"""A reward model trained on preference pairs, on every rank of the learner's world.

The model is the config's with a scalar head (transformers' sequence-classification
class for its architecture, `num_labels: 1`, the head initialized as transformers
does), read at the last real token of each side (transformers' own pooling: the
rightmost token that is not padding; rows are right-padded), sharded by FSDP2 with the
learner's precision and activation checkpointing, LoRA adapters when model.lora.rank >
0 (the head then trained whole). The optimizer and schedule are the SFT trainer's.

The loss of a pair is Bradley-Terry's, -log sigmoid(r_chosen - r_rejected - m) (Ouyang
et al. 2022, arXiv 2203.02155, eq. 1; the margin m of Llama 2, arXiv 2307.09288,
section 3.2.2), plus `rm.center_coef` * (r_chosen + r_rejected)^2 (reward centering,
Eisenstein et al. 2023, arXiv 2312.09244; TRL's RewardTrainer adds the same term),
averaged over the batch's pairs, so a step does not depend on how the batch is split
among ranks and micro-batches. Each micro-batch scores its pairs' two sides in one
forward.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from async_rl.algorithms.normalization import backward_share
from async_rl.config import Config
from async_rl.learner.checkpoint import save_hf_model
from async_rl.learner.precision import dither_masters
from async_rl.learner.sharding import full_parameters
from async_rl.learner.step import clipped_grad_norm
from async_rl.learner.trainer import drain
from async_rl.rewards.reward_model import NORMALIZATION_FILE
from async_rl.rm.pairs import Pair
from async_rl.sft.trainer import apply_step, lr_scheduler, rank_micro_batches, sharded_with_optimizer


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor, center_coef: float) -> torch.Tensor:
    """Per pair: -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2."""
    loss = -F.logsigmoid(chosen - rejected - margin)
    return loss + center_coef * (chosen + rejected).square() if center_coef else loss


def load_reward_head(cfg: Config, device: torch.device, path: str | None = None) -> torch.nn.Module:
    """The model at `path` (model.path) with a one-output sequence-classification head,
    float32 on `device`; padding is what its pooling skips."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from async_rl.models.loading import load_tokenizer

    path = path or cfg.model.path
    kernel = {"attn_implementation": cfg.learner.attention} if cfg.learner.attention else {}
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report names the new head "MISSING": the one we train
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32, **kernel)
    finally:
        hf_logging.set_verbosity(level)
    if model.config.pad_token_id is None:
        tokenizer = load_tokenizer(path)
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
    return model.to(device)


def _peft_config(lora):
    from peft import LoraConfig, TaskType

    # SEQ_CLS: peft trains the head (`score`) whole beside the adapters.
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type=TaskType.SEQ_CLS)


class RMTrainer:
    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.seed)
        model = load_reward_head(cfg, device)
        self.pad_id = model.config.pad_token_id
        self.hf_config = model.config
        self.hf_config.architectures = [type(model).__name__]  # before FSDP2 renames the class
        dither_masters(model, cfg)
        if cfg.model.lora.rank:
            from peft import get_peft_model

            model = get_peft_model(model, _peft_config(cfg.model.lora))
        self.model, self.optimizer = sharded_with_optimizer(model, cfg, device, self.world, cfg.rm.lr)
        self.steps_done = 0

    def schedule(self, total_steps: int) -> None:
        self.scheduler = lr_scheduler(self.optimizer, self.cfg.rm.lr_schedule, total_steps)

    def scores(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """The head's score of each token sequence, [n] float32 ([] scores one pad token)."""
        rows = list(sequences) or [[self.pad_id]]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, :len(row)] = torch.tensor(row)
            attention[k, :len(row)] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits[:, 0]
        return out.float()

    def _pair_scores(self, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen scores, rejected scores, margins) of `pairs` (not empty), both sides in one forward."""
        both = self.scores([p.chosen for p in pairs] + [p.rejected for p in pairs])
        margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32, device=self.device)
        return both[:len(pairs)], both[len(pairs):], margin

    def step(self, batch: Sequence[Pair]) -> dict[str, float]:
        """One optimizer step on `batch` (the same list on every rank); global figures."""
        rm = self.cfg.rm
        totals = torch.zeros(3, device=self.device)  # loss, correct, margin: summed over pairs
        for micro in rank_micro_batches(batch, self.rank, self.world, self.cfg.learner.micro_batch_size):
            if not micro:  # a padding micro-batch: its forward and backward keep the ranks' collectives in step
                backward_share(self.scores([]).sum() * 0.0, self.world)
                continue
            chosen, rejected, margin = self._pair_scores(micro)
            loss = pair_loss(chosen, rejected, margin, rm.center_coef).sum()
            backward_share(loss / len(batch), self.world)
            with torch.no_grad():
                totals += torch.stack([loss.detach(), (chosen > rejected).float().sum(), (chosen - rejected).sum()])
        grad_norm = clipped_grad_norm(self.model, self.cfg.train.grad_clip)
        if self.world > 1:
            dist.all_reduce(totals)
        finite = math.isfinite(float(totals[0])) and math.isfinite(float(grad_norm))
        lr = apply_step(self.optimizer, self.scheduler, finite)
        self.steps_done += 1
        loss, correct, margin = (float(x) / len(batch) for x in totals)
        return {"rm/loss": loss, "rm/accuracy": correct, "rm/margin": margin, "rm/grad_norm": float(grad_norm),
                "rm/lr": lr, "rm/skipped": 0.0 if finite else 1.0}

    @torch.no_grad()
    def evaluate(self, pairs: Sequence[Pair]) -> dict[str, float]:
        """Over `pairs`, all ranks: pair accuracy (ties count as wrong), mean margin
        r_c - r_r, mean loss, and the mean and std of every side's score."""
        totals = torch.zeros(5, dtype=torch.float64, device=self.device)  # loss, correct, margin, sum, sum sq
        for micro in rank_micro_batches(pairs, self.rank, self.world, self.cfg.learner.micro_batch_size):
            if not micro:  # a padding micro-batch: its forward keeps the ranks' collectives in step
                self.scores([])
                continue
            chosen, rejected, margin = self._pair_scores(micro)
            both = torch.cat([chosen, rejected]).double()
            totals += torch.stack([pair_loss(chosen, rejected, margin, 0.0).sum().double(),
                                   (chosen > rejected).double().sum(), (chosen - rejected).double().sum(),
                                   both.sum(), both.square().sum()])
        if self.world > 1:
            dist.all_reduce(totals)
        n = len(pairs)
        mean = float(totals[3]) / (2 * n)
        return {"loss": float(totals[0]) / n, "accuracy": float(totals[1]) / n, "margin": float(totals[2]) / n,
                "score_mean": mean, "score_std": math.sqrt(max(float(totals[4]) / (2 * n) - mean * mean, 0.0))}

    def export(self, out: Path, tokenizer, normalization: dict[str, float]) -> None:
        """Write the reward model (a collective; rank 0 writes): a Hugging Face
        sequence-classification directory, LoRA merged into it, with the scores' mean
        and std over the training pairs (NORMALIZATION_FILE)."""
        cfg = self.cfg
        params = full_parameters(self.model)
        if self.rank != 0:
            drain(params)
            return
        if cfg.model.lora.rank:
            params = _merged(params, cfg)
        save_hf_model(params, cfg.model.path, tokenizer, out, config=self.hf_config,
                      extra={NORMALIZATION_FILE: json.dumps(normalization, indent=1) + "\n"})


def _merged(params, cfg: Config):
    """The adapters merged into a fresh copy of the base and head, on CPU: its tensors."""
    from peft import get_peft_model

    model = get_peft_model(load_reward_head(cfg, torch.device("cpu")), _peft_config(cfg.model.lora))
    model.load_state_dict(dict(params))
    return list(model.merge_and_unload().state_dict().items())
