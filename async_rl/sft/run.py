"""`async-rl sft CONFIG sft.data=DEMOS`: the warm start, from the command to the model.

The launch reads and encodes the demonstrations first, so bad data is one line and exit
2 before any process starts; then one rank trains in this process, or `learner.ranks`
ranks under torchrun (`python -m async_rl.sft RUN/config.yaml` each). Rank 0 writes
RUN/metrics.jsonl and RUN/tb (`sft/loss`, `sft/held_out_loss`, ...), a progress line
every PROGRESS_EVERY_S seconds and one per epoch, and at the end the model (sft.out,
default RUN/model), which `async-rl train CONFIG model.path=...` starts from.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from async_rl.config import Config, ConfigError, load_config, to_yaml
from async_rl.config.loading import resolve_run_dir
from async_rl.run.lock import RunLock

log = logging.getLogger("async_rl.sft")
PROGRESS_EVERY_S = 15.0


def output_dir(cfg: Config) -> Path:
    return Path(cfg.sft.out).resolve() if cfg.sft.out else Path(cfg.run_dir) / "model"


def demonstrations(cfg: Config):
    """(the split demonstrations, the tokenizer): the same on every rank."""
    from async_rl.models.loading import load_tokenizer
    from async_rl.sft.conversations import Encoder, read_conversations, stop_token
    from async_rl.sft.trainer import split_demonstrations
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids

    sft = cfg.sft
    tokenizer = load_tokenizer(cfg.model.path)
    prompt_format = prompt_format_for(cfg.model.path, cfg.task, tokenizer)
    encoder = Encoder(prompt_format, stop_token(prompt_format, stop_token_ids(cfg.model.path, tokenizer)),
                      cfg.actors.stop)
    conversations = read_conversations(sft.data, sft.split, sft.messages_column)
    return split_demonstrations([encoder.encode(c) for c in conversations], sft.max_tokens, sft.eval_fraction,
                                cfg.seed), tokenizer


def prepare(cfg: Config) -> tuple[Path, RunLock]:
    """The run directory (locked, with config.yaml), the model and the data checked:
    ConfigError in one line for anything amiss."""
    from async_rl.run.checks import check_lora
    from async_rl.run.launcher import choose_learner_ranks, ensure_demo_model

    if not cfg.sft.data:
        raise ConfigError("sft.data: required: the demonstrations (a JSON lines file or a dataset)")
    run_dir = resolve_run_dir(cfg).resolve()
    lock = RunLock(run_dir).acquire()
    try:
        if (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"run_dir: {run_dir} already holds a run; choose another run_dir")
        cfg.run_dir = str(run_dir)
        if cfg.model.path == "demo":
            cfg.model.path = str(ensure_demo_model(cfg, run_dir / "base_model"))
        elif not (Path(cfg.model.path) / "config.json").exists():
            raise ConfigError(f"model.path: {cfg.model.path} is not a Hugging Face model directory (no config.json)")
        cfg.model.path = str(Path(cfg.model.path).resolve())
        cfg.sft.data = str(Path(cfg.sft.data).resolve())
        check_lora(cfg)
        choose_learner_ranks(cfg)
        try:
            split, _ = demonstrations(cfg)
        except (ValueError, OSError) as err:
            raise ConfigError(f"sft.data: {str(err).splitlines()[0]}") from None
        if len(split.train) < cfg.learner.ranks:
            raise ConfigError(f"sft.data: {len(split.train)} conversations to train on, fewer than learner.ranks")
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        return run_dir, lock
    except BaseException:
        lock.release(refused=True)
        raise


def launch(cfg: Config) -> int:
    """The command: prepare, train (here, or under torchrun), say where the model is."""
    run_dir, lock = prepare(cfg)
    # Set here, not inherited: a shell starts background jobs with SIGINT ignored, and
    # Python then never turns Ctrl-C (or a kill) into KeyboardInterrupt.
    handlers = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    try:
        print(f"async-rl: run directory {run_dir}", file=sys.stderr, flush=True)
        try:
            status = rank_main(cfg) if cfg.learner.ranks == 1 else _torchrun(cfg, run_dir)
        except KeyboardInterrupt:  # minutes of work, no checkpoint: stop at once, say so
            print(f"async-rl: sft interrupted; no model written (the run's metrics are in {run_dir})",
                  file=sys.stderr, flush=True)
            return 130
        if status == 0:
            out = output_dir(cfg)
            print(f"async-rl: supervised model in {out}; start RL from it with "
                  f"`async-rl train CONFIG model.path={out}`", file=sys.stderr, flush=True)
        return status
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        lock.release()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _torchrun(cfg: Config, run_dir: Path) -> int:
    """learner.ranks ranks under torchrun; interrupted, they are stopped with it."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.learner.threads), PYTHONUNBUFFERED="1")
    world = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={cfg.learner.ranks}", "-m", "async_rl.sft",
                              str(run_dir / "config.yaml")], env=env)
    try:
        return world.wait()
    except KeyboardInterrupt:
        world.terminate()  # torchrun passes it on to the ranks
        try:
            world.wait(timeout=30)
        except subprocess.TimeoutExpired:
            world.kill()
        raise


def main(argv: list[str] | None = None) -> int:
    """A torchrun rank: python -m async_rl.sft RUN/config.yaml."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return rank_main(load_config(argv[0]))


def rank_main(cfg: Config) -> int:
    """Join the world (of one without torchrun), train, write the model. A failure is
    one line on the console and its traceback in RUN/logs/sft-rankN.err; exit 1."""
    import torch.distributed as dist

    from async_rl.learner.process import join_world
    from async_rl.models.loading import quiet_libraries

    rank = int(os.environ.get("RANK", 0))
    logs = Path(cfg.run_dir) / "logs"
    quiet_libraries(logs / f"sft-rank{rank}.warnings")
    try:
        device = join_world(cfg)
        try:
            train(cfg, device)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return 0
    except Exception as err:
        reason = f"sft rank {rank}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:500]
        where = logs / f"sft-rank{rank}.err"
        where.write_text(reason + "\n\n" + "".join(traceback.format_exception(err)))
        print(f"async-rl: {reason} (traceback in {where})", file=sys.stderr, flush=True)
        return 1


def train(cfg: Config, device) -> None:
    from async_rl.sft.trainer import SFTTrainer

    split, tokenizer = demonstrations(cfg)
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
    trainer.export(output_dir(cfg), tokenizer)
    if metrics is not None:
        metrics.close()
