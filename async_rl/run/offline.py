"""Commands that train the run's model offline on a dataset (`async-rl sft`, `async-rl
rm`), from the command line to the written model, one way for both.

The launch locks a new run directory and checks the model and the data first, so that
bad data is one line and exit 2 before any process starts; then one rank trains in this
process, or `learner.ranks` ranks under torchrun (`python -m MODULE RUN/config.yaml`
each, in a session of their own, torchrun's report in RUN/logs/torchrun.log:
learner/world.py). A rank's failure is one line on the console and its traceback in
RUN/logs/NAME-rankN.err (exit 1); Ctrl-C, SIGTERM or SIGHUP stop every rank with one
line and exit 128 + the signal (130, 143, 129), as `async-rl train` does: minutes of
work and no checkpoint, so nothing is kept but the metrics.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from async_rl.config import Config, ConfigError, load_config, to_yaml
from async_rl.config.loading import resolve_run_dir
from async_rl.run.lock import RunLock
from async_rl.run.processes import STOP_SIGNALS, Interrupted, raise_interrupted
from async_rl.run.status import LAUNCHER_ENV


@dataclass(frozen=True)
class OfflineCommand:
    """One offline training command: `name` is its config section and its command."""
    name: str  # "sft": the section (sft.data, sft.out) and the command
    module: str  # what each torchrun rank runs: python -m MODULE RUN/config.yaml
    data: str  # what sft.data holds, for its error: "the demonstrations (a JSON lines file or a dataset)"
    count: Callable[[Config], int]  # reads and checks the data: how many items it trains on (ValueError, OSError)
    train: Callable[[Config, object], None]  # on each rank, given its torch device: trains, writes the model
    done: Callable[[Config], str]  # the line that says where the model is

    def section(self, cfg: Config):
        return getattr(cfg, self.name)

    def output_dir(self, cfg: Config) -> Path:
        out = self.section(cfg).out
        return Path(out).resolve() if out else Path(cfg.run_dir) / "model"


def prepare(cfg: Config, command: OfflineCommand) -> tuple[Path, RunLock]:
    """The run directory (locked, with config.yaml), the model and the data checked:
    ConfigError in one line for anything amiss."""
    from async_rl.run.checks import check_lora
    from async_rl.run.demo_model import ensure_demo_model
    from async_rl.run.launcher import choose_learner_ranks

    section = command.section(cfg)
    if not section.data:
        raise ConfigError(f"{command.name}.data: required: {command.data}")
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
        if Path(section.data).exists():  # else a name `datasets` resolves
            section.data = str(Path(section.data).resolve())
        check_lora(cfg)
        choose_learner_ranks(cfg)
        try:
            count = command.count(cfg)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{command.name}.data: {str(err).splitlines()[0]}") from None
        if count < cfg.learner.ranks:
            raise ConfigError(f"{command.name}.data: {count} to train on, fewer than learner.ranks")
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        return run_dir, lock
    except BaseException:
        lock.release(refused=True)
        raise


def launch(cfg: Config, command: OfflineCommand) -> int:
    """The command: prepare, train (here, or under torchrun), say where the model is."""
    run_dir, lock = prepare(cfg, command)
    # Set here, not inherited: a shell starts background jobs with SIGINT ignored, and
    # Python then never turns Ctrl-C (or a kill) into KeyboardInterrupt.
    handlers = {s: signal.signal(s, raise_interrupted) for s in STOP_SIGNALS}
    try:
        print(f"async-rl: run directory {run_dir}", file=sys.stderr, flush=True)
        try:
            status = rank_main(cfg, command) if cfg.learner.ranks == 1 else _torchrun(cfg, run_dir, command)
        except KeyboardInterrupt as err:
            signum = getattr(err, "signum", signal.SIGINT)
            print(f"async-rl: {command.name} interrupted ({signal.Signals(signum).name}); no model written (the "
                  f"run's metrics are in {run_dir})", file=sys.stderr, flush=True)
            return 128 + signum
        if status == 0:
            print(f"async-rl: {command.done(cfg)}", file=sys.stderr, flush=True)
        return status
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        lock.release()


def _torchrun(cfg: Config, run_dir: Path, command: OfflineCommand) -> int:
    """learner.ranks ranks under torchrun, in a session of their own (a terminal's Ctrl-C
    reaches this process alone); interrupted, the ranks are told to stop and torchrun,
    its ranks all ended, ends without a report."""
    from async_rl.run.processes import process_tree

    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.learner.threads), PYTHONUNBUFFERED="1", **{LAUNCHER_ENV: "1"})
    world = subprocess.Popen([sys.executable, "-m", "async_rl.learner.world", str(run_dir), "--standalone",
                              f"--nproc-per-node={cfg.learner.ranks}", "-m", command.module,
                              str(run_dir / "config.yaml")], env=env, start_new_session=True)
    try:
        status = world.wait()
        if status:  # the ranks left their lines to us (LAUNCHER_ENV)
            print(f"async-rl: {_world_failure(run_dir, command)} (tracebacks in {run_dir / 'logs'})",
                  file=sys.stderr, flush=True)
        return status
    except KeyboardInterrupt:
        for pid in process_tree(world.pid)[1:]:  # the ranks (torchrun runs in `world` itself)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            world.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(world.pid, signal.SIGKILL)
            world.wait()
        raise


def _world_failure(run_dir: Path, command: OfflineCommand) -> str:
    """The reason learner/world.py recorded for a failed world (its root cause)."""
    from async_rl.run.directory import RunDir

    status = RunDir(run_dir).status()
    return status["reason"] if status else f"{command.name} failed; torchrun's report: {run_dir}/logs/torchrun.log"


def rank_main_from_argv(command: OfflineCommand, argv: list[str] | None = None) -> int:
    """A torchrun rank: python -m MODULE RUN/config.yaml. A stop signal ends it quietly,
    exit 0 (the launcher says it was interrupted): its peers, stopped too, may break a
    collective under it first, which is no failure either."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    stopped: list[int] = []

    def stop(signum, _frame):
        stopped.append(signum)
        raise Interrupted(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    try:
        return rank_main(load_config(argv[0]), command, stopping=lambda: bool(stopped))
    except KeyboardInterrupt:
        return 0


def rank_main(cfg: Config, command: OfflineCommand, stopping: Callable[[], bool] = lambda: False) -> int:
    """Join the world (of one without torchrun), train, write the model. A failure is
    one line on the console and its traceback in RUN/logs/NAME-rankN.err; exit 1 (when
    not `stopping`: a rank told to stop ends quietly, exit 0)."""
    import torch.distributed as dist

    from async_rl.learner.process import join_world
    from async_rl.models.loading import quiet_libraries

    rank = int(os.environ.get("RANK", 0))
    logs = Path(cfg.run_dir) / "logs"
    quiet_libraries(logs / f"{command.name}-rank{rank}.warnings")
    try:
        device = join_world(cfg)
        try:
            command.train(cfg, device)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return 0
    except Exception as err:
        if stopping():
            return 0
        reason = f"{command.name} rank {rank}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:500]
        where = logs / f"{command.name}-rank{rank}.err"
        where.write_text(reason + "\n\n" + "".join(traceback.format_exception(err)))
        if not os.environ.get(LAUNCHER_ENV):  # under the launcher's torchrun, it says the root cause once
            print(f"async-rl: {reason} (traceback in {where})", file=sys.stderr, flush=True)
        return 1
