"""The learner's process: what `torchrun ... -m async_rl.learner` runs on each rank.

Sets the process up (dies with torchrun, holds the run directory's lock when no
launcher does, joins the torchrun world), builds the every-rank trainer and, on rank 0,
the services beside it, runs the loop (loop.py), and turns a failure into
its reason and traceback in RUN_DIR/logs/learner-rankN.err, the reason in status.json
(rank 0), and one console line. Under `async-rl train` (ASYNC_RL_LAUNCHER set) the
console line is the launcher's, naming the root cause among the ranks' failures
(world.py); under launch/learner.sh each failing rank prints its own.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from async_rl.config import Config, ConfigError, load_config
from async_rl.device import collective_backend, resolve_device
from async_rl.learner.loop import Loop
from async_rl.learner.services import Followers, Rank0Services
from async_rl.learner.trainer import Trainer
from async_rl.models.loading import quiet_libraries
from async_rl.run.disk import DiskFull, release_room
from async_rl.run.lock import RunLock
from async_rl.run.processes import die_with_parent
from async_rl.run.status import EXIT_CONFIG, LAUNCHER_ENV, write_status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    faulthandler.enable()  # a crash in native code (gloo, BLAS) still prints where each thread was
    die_with_parent()  # torchrun's death (a launcher killed outright) ends the ranks too
    cfg = load_config(argv[0])
    resume = Path(argv[argv.index("--resume") + 1]) if "--resume" in argv else None
    rank = int(os.environ.get("RANK", 0))
    lock = None
    if rank == 0 and not os.environ.get(LAUNCHER_ENV):
        try:  # started by launch/learner.sh after `async-rl prepare`: hold the lock ourselves
            lock = RunLock(Path(cfg.run_dir)).acquire()
        except ConfigError as err:
            print(f"async-rl: config error: {err}", file=sys.stderr)
            return EXIT_CONFIG
    try:
        return _train(cfg, resume)
    except Exception as err:
        return _fail(cfg, rank, err)
    finally:
        if lock is not None:
            lock.release()


def _fail(cfg: Config, rank: int, err: Exception) -> int:
    """The reason (first line) and traceback in RUN/logs, the reason in status.json
    and, without a launcher to report it, on the console."""
    import traceback

    release_room(Path(cfg.run_dir))  # what a full disk left no room for: the error log and status.json
    logs = Path(cfg.run_dir) / "logs"
    where = logs / f"learner-rank{rank}.err"
    text = str(err).splitlines()[0] if str(err) else ""
    kind = "" if isinstance(err, DiskFull) else f"{type(err).__name__}: "  # its message says what it is
    reason = f"learner rank {rank}: {kind}{text}"[:500]
    try:
        logs.mkdir(parents=True, exist_ok=True)
        where.write_text(reason + "\n\n" + "".join(traceback.format_exception(err)))
    except OSError:
        where = None  # the disk may be what failed
    if not os.environ.get(LAUNCHER_ENV) or where is None:
        print(f"async-rl: {reason}" + (f" (traceback in {where})" if where else ""), file=sys.stderr, flush=True)
    if rank == 0:
        try:
            write_status(Path(cfg.run_dir), 1, reason)
        except OSError:
            pass
    return 1  # non-zero: torchrun stops the other ranks at once instead of leaving them in a collective


def _train(cfg: Config, resume: Path | None) -> int:
    quiet_libraries(Path(cfg.run_dir) / "logs" / f"learner-rank{os.environ.get('RANK', 0)}.warnings")
    trainer = Trainer(cfg, join_world(cfg))
    resumed = trainer.resume(resume) if resume else None
    services = Rank0Services(cfg, trainer, resumed, resume) if trainer.rank == 0 else Followers()
    stop_event = threading.Event()

    def request_stop(signum, _frame):
        stop_event.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGHUP, request_stop)
    stop = Loop(cfg, trainer, services, stop_event).run()
    if trainer.rank == 0:
        write_status(Path(cfg.run_dir), *stop)
    shutdown_world()
    return 0  # every rank: torchrun turns a worker's nonzero exit into its own error report


def join_world(cfg: Config) -> torch.device:
    """This rank's device (its GPU made the current one), its threads, and the process
    group: torchrun's world, or without torchrun a world of one (no rendezvous)."""
    if resolve_device(cfg.model.device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = resolve_device(cfg.model.device)  # this rank's GPU, now that it is the current one
    torch.set_num_threads(cfg.learner.threads)
    timeout = datetime.timedelta(seconds=cfg.learner.timeout_s)
    if "MASTER_ADDR" in os.environ:  # under torchrun
        dist.init_process_group(backend=collective_backend(device), timeout=timeout)
    else:
        dist.init_process_group(backend=collective_backend(device), timeout=timeout, store=dist.HashStore(),
                                rank=0, world_size=1)
    return device


def shutdown_world() -> None:
    """Leave the torchrun world together. A rank that tears gloo down while a peer is
    still working (rank 0 writing final/) intermittently aborts at exit with
    "terminate called without an active exception" (torch 2.13 CPU); a barrier first
    prevents it."""
    dist.barrier()
    dist.destroy_process_group()
