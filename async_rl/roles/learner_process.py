"""The learner's process: what `torchrun ... -m async_rl.roles.learner` runs on each rank.

Sets the process up (dies with torchrun, holds the run directory's lock when no
launcher does, joins the torchrun world), runs `Learner.run`, and turns a failure into
one console line, the traceback in RUN_DIR/logs/learner-rankN.err and the reason in
status.json.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config, ConfigError, load_config
from ..run_lock import RunLock
from ..runtime import EXIT_CONFIG, die_with_parent, quiet_libraries, resolve_device, sync_backend, write_status
from .learner import Learner, shutdown_world


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    faulthandler.enable()  # a crash in native code (gloo, BLAS) still prints where each thread was
    die_with_parent()  # torchrun's death (a launcher killed outright) ends the ranks too
    cfg = load_config(argv[0])
    resume = Path(argv[argv.index("--resume") + 1]) if "--resume" in argv else None
    rank = int(os.environ.get("RANK", 0))
    if rank == 0 and not os.environ.get("ASYNC_RL_RUN_LOCKED"):
        try:  # started by launch/learner.sh after `async-rl prepare`: hold the lock ourselves
            _lock = RunLock(Path(cfg.run_dir)).acquire()  # noqa: F841 - held until the process ends
        except ConfigError as err:
            print(f"async-rl: config error: {err}", file=sys.stderr)
            return EXIT_CONFIG
    try:
        return _train(cfg, resume)
    except Exception as err:
        return _fail(cfg, rank, err)


def _fail(cfg: Config, rank: int, err: Exception) -> int:
    """One line on the console, the traceback in RUN/logs, the reason in status.json."""
    import traceback

    logs = Path(cfg.run_dir) / "logs"
    where = logs / f"learner-rank{rank}.err"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(err)))
    except OSError:
        where = None  # the disk may be what failed
    text = str(err).splitlines()[0] if str(err) else ""
    reason = f"learner rank {rank}: {type(err).__name__}: {text}"[:500]
    print(f"async-rl: {reason}" + (f" (traceback in {where})" if where else ""), file=sys.stderr, flush=True)
    if rank == 0:
        try:
            write_status(Path(cfg.run_dir), 1, reason)
        except OSError:
            pass
    return 1  # non-zero: torchrun stops the other ranks at once instead of leaving them in a collective


def _train(cfg: Config, resume: Path | None) -> int:
    quiet_libraries()
    device = resolve_device(cfg.model.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(cfg.learner.threads)
    dist.init_process_group(backend=sync_backend(device), timeout=datetime.timedelta(seconds=cfg.learner.timeout_s))
    learner = Learner(cfg, resume)

    def request_stop(signum, _frame):
        learner.stop_event.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGHUP, request_stop)
    code = learner.run()
    shutdown_world()
    return code
