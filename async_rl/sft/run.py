"""`async-rl sft CONFIG sft.data=DEMOS`: the warm start (run/offline.py launches it: bad
data one line and exit 2 before any process starts, one rank here or `learner.ranks`
under torchrun, Ctrl-C one line and exit 130). Rank 0 writes RUN/metrics.jsonl and
RUN/tb (`sft/loss`, `sft/held_out_loss`, ...), a progress line every PROGRESS_EVERY_S
seconds and one per epoch, and at the end the model (sft.out, default RUN/model), which
`async-rl train CONFIG model.path=...` starts from.
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

log = logging.getLogger("async_rl.sft")
PROGRESS_EVERY_S = 15.0
DEMONSTRATIONS_FILE = "demonstrations.msgpack"  # the encoded split, written by the launcher's check


def demonstrations(cfg: Config):
    """The demonstrations encoded and split, the same on every rank: read from the run
    directory, where the launcher's check of the data left them (they are tokenized
    once), else encoded here."""
    from async_rl.sft.trainer import load_split

    cached = Path(cfg.run_dir) / DEMONSTRATIONS_FILE if cfg.run_dir else None
    return load_split(cached) if cached is not None and cached.exists() else encode_demonstrations(cfg)


def encode_demonstrations(cfg: Config):
    from async_rl.models.loading import load_tokenizer
    from async_rl.sft.conversations import Encoder, read_conversations, stop_token
    from async_rl.sft.trainer import split_demonstrations
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids

    sft = cfg.sft
    tokenizer = load_tokenizer(cfg.model.path)
    prompt_format = prompt_format_for(cfg.model.path, cfg.task, tokenizer)
    encoder = Encoder(prompt_format, stop_token(prompt_format, stop_token_ids(cfg.model.path, tokenizer)),
                      cfg.actors.stop, max_tokens=sft.max_tokens)
    conversations = read_conversations(sft.data, sft.split, sft.messages_column)
    return split_demonstrations([encoder.encode(c) for c in conversations], sft.max_tokens, sft.eval_fraction,
                                cfg.seed)


def train(cfg: Config, device) -> None:
    from async_rl.models.loading import load_tokenizer
    from async_rl.sft.trainer import SFTTrainer

    split, tokenizer = demonstrations(cfg), load_tokenizer(cfg.model.path)
    sft = cfg.sft
    steps_per_epoch = math.ceil(len(split.train) / sft.batch_size)
    total = sft.epochs * steps_per_epoch
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = SFTTrainer(cfg, device, pad_id)
    trainer.schedule(total)
    metrics = None
    if trainer.rank == 0:
        from async_rl.run.metrics import MetricsLogger

        metrics = MetricsLogger(Path(cfg.run_dir), total)
        trained = sum(d.trained_tokens for d in split.train)
        log.info("sft: %d conversations (%d held out), %d assistant tokens, %d steps%s", len(split.train),
                 len(split.held_out), trained, total,
                 f"; {split.cut} longer than sft.max_tokens={sft.max_tokens} were cut" if split.cut else "")
    last_line = time.monotonic()
    for epoch in range(sft.epochs):
        order = np.random.default_rng([cfg.seed, epoch]).permutation(len(split.train))
        for start in range(0, len(order), sft.batch_size):
            stats = trainer.step([split.train[i] for i in order[start:start + sft.batch_size]])
            step = trainer.steps_done
            if metrics is not None:
                metrics.log({"step": step, "sft/epoch": epoch + 1, **stats})
                if time.monotonic() - last_line >= PROGRESS_EVERY_S:
                    last_line = time.monotonic()
                    print(f"sft: step {step}/{total}  loss {stats['sft/loss']:.4f}", file=sys.stderr, flush=True)
        held = trainer.held_out_loss(split.held_out) if split.held_out else None
        if metrics is not None:
            if held is not None:
                metrics.log({"step": trainer.steps_done, "sft/held_out_loss": held})
            print(f"sft: epoch {epoch + 1}/{sft.epochs}  step {trainer.steps_done}/{total}  "
                  f"train loss {stats['sft/loss']:.4f}" + (f"  held-out loss {held:.4f}" if held is not None else ""),
                  file=sys.stderr, flush=True)
    trainer.export(SFT.output_dir(cfg), tokenizer)
    if metrics is not None:
        metrics.close()


def _count(cfg: Config) -> int:
    """Encode and check the demonstrations, leaving them in the run directory for the ranks."""
    from async_rl.sft.trainer import save_split

    split = encode_demonstrations(cfg)
    save_split(Path(cfg.run_dir) / DEMONSTRATIONS_FILE, split)
    return len(split.train)


def _done(cfg: Config) -> str:
    out = SFT.output_dir(cfg)
    return f"supervised model in {out}; start RL from it with `async-rl train CONFIG model.path={out}`"


SFT = OfflineCommand("sft", "async_rl.sft", "the demonstrations (a JSON lines file or a dataset)", _count, train, _done)
