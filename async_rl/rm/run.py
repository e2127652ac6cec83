"""`async-rl rm CONFIG rm.data=PAIRS`: a reward model from preference pairs (run/offline.py
launches it: bad data one line and exit 2 before any process starts, one rank here or
`learner.ranks` under torchrun, Ctrl-C one line and exit 130). Rank 0 writes
RUN/metrics.jsonl and RUN/tb (`rm/loss`, `rm/accuracy`, `rm/margin` per step;
`rm/held_out_accuracy`, `rm/held_out_margin`, `rm/held_out_loss` per epoch), a progress
line every PROGRESS_EVERY_S seconds and one per epoch, and at the end the model (rm.out,
default RUN/model) with its scores' mean and std over the training pairs.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import numpy as np

from async_rl.config import Config
from async_rl.run.offline import OfflineCommand

log = logging.getLogger("async_rl.rm")
PROGRESS_EVERY_S = 15.0


def preference_pairs(cfg: Config):
    """(the split pairs, the tokenizer): the same on every rank."""
    from async_rl.models.loading import load_tokenizer
    from async_rl.rm.pairs import read_pairs, split_pairs

    rm = cfg.rm
    tokenizer = load_tokenizer(cfg.model.path)
    rows = read_pairs(rm.data, rm.split, rm.margin_column)
    return split_pairs(rows, tokenizer, rm.max_tokens, rm.eval_fraction, cfg.seed), tokenizer


def train(cfg: Config, device) -> None:
    from async_rl.rm.trainer import RMTrainer

    split, tokenizer = preference_pairs(cfg)
    rm = cfg.rm
    total = rm.epochs * math.ceil(len(split.train) / rm.batch_size)
    trainer = RMTrainer(cfg, device)
    trainer.schedule(total)
    metrics = None
    if trainer.rank == 0:
        from async_rl.run.metrics import MetricsLogger

        metrics = MetricsLogger(Path(cfg.run_dir), total)
        log.info("rm: %d pairs (%d held out), %d steps%s", len(split.train), len(split.held_out), total,
                 f"; {split.too_long} with a side longer than rm.max_tokens={rm.max_tokens} left out"
                 if split.too_long else "")
    last_line = time.monotonic()
    for epoch in range(rm.epochs):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(split.train))
        for start in range(0, len(order), rm.batch_size):
            stats = trainer.step([split.train[i] for i in order[start:start + rm.batch_size]])
            if metrics is not None:
                metrics.log({"step": trainer.steps_done, "rm/epoch": epoch + 1, **stats})
                if time.monotonic() - last_line >= PROGRESS_EVERY_S:
                    last_line = time.monotonic()
                    print(f"rm: step {trainer.steps_done}/{total}  loss {stats['rm/loss']:.4f}  "
                          f"accuracy {stats['rm/accuracy']:.3f}", file=sys.stderr, flush=True)
        held = trainer.evaluate(split.held_out) if split.held_out else None
        if metrics is not None:
            line = f"rm: epoch {epoch + 1}/{rm.epochs}  step {trainer.steps_done}/{total}  " \
                   f"train loss {stats['rm/loss']:.4f}"
            if held is not None:
                metrics.log({"step": trainer.steps_done, "rm/held_out_accuracy": held["accuracy"],
                             "rm/held_out_margin": held["margin"], "rm/held_out_loss": held["loss"]})
                line += f"  held-out accuracy {held['accuracy']:.3f}  margin {held['margin']:.3f}"
            print(line, file=sys.stderr, flush=True)
    scored = trainer.evaluate(split.train)
    trainer.export(RM.output_dir(cfg), tokenizer,
                   {"mean": scored["score_mean"], "std": scored["score_std"], "pairs": len(split.train)})
    if metrics is not None:
        metrics.close()


def _count(cfg: Config) -> int:
    split, _ = preference_pairs(cfg)
    return len(split.train)


def _done(cfg: Config) -> str:
    out = RM.output_dir(cfg)
    return (f"reward model in {out}; train with it as a reward component: "
            f"reward.components='[{{name: rm, reward: reward_model, model: {out}}}]'")


RM = OfflineCommand("rm", "async_rl.rm", "the preference pairs (a JSON lines file or a dataset)", _count, train,
                    _done)
