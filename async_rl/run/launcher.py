"""`async-rl train`: one machine, one process per role.

Takes the run directory's lock (lock.py), spawns the learner world (one rank as its
own child, several under torchrun) and the actors, which start up while the learner
does and join its hub once the coordinator publishes its endpoints, and restarts an
actor that dies (at most actors.max_restarts times). A config with a `placement: server`
reward component also gets the reward server, started first and watched and restarted
the same way (reward_server/process.py). Ctrl-C, SIGTERM and SIGHUP stop
the run the same way: the learner ranks finish their step and write a checkpoint and
final/, the actors are told goodbye, and whatever does not leave within a grace period
is killed. Every child dies with the launcher (a parent-death signal), so a launcher
killed outright leaves nothing running behind it.

Exit status: the learner's (0, or run/status.py's EXIT_* for a run it stopped), 128 + the
signal's number when interrupted (130 SIGINT, 143 SIGTERM, 129 SIGHUP), 2 for a config
error, 1 when the learner failed.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from async_rl.config import Config, ConfigError, from_yaml, resolve_run_dir, to_yaml
from async_rl.device import device_type
from async_rl.reward_server.process import ServerProcess
from async_rl.run.checkpoints import latest_intact_checkpoint
from async_rl.run.checks import check_engine, check_lora, check_task
from async_rl.run.demo_model import ensure_demo_model
from async_rl.run.directory import RunDir
from async_rl.run.lock import RunLock
from async_rl.run.processes import STOP_SIGNALS, child_of
from async_rl.run.status import LAUNCHER_ENV, NO_RESTARTS_FILE, write_no_restarts, write_status

log = logging.getLogger("async_rl.launch")
GRACE_S = 30.0
HUB_START_S = 300.0
# A resumed run must keep these: they define the prompt stream, the admission slots,
# the shape of buffered groups and which models the checkpoint holds.
RESUME_FIXED = ("seed", "model.path", "task", "train.batch_groups", "train.group_size", "train.advantage.name")


def _lookup(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def find_resume_checkpoint(cfg: Config, resume: str) -> Path:
    """The checkpoint `--resume RUN` continues from; ConfigError when there is none or
    when the config changed a key the checkpoint depends on."""
    run_dir = Path(resume).resolve()
    if cfg.run_dir is None:
        cfg.run_dir = str(run_dir)
    elif Path(cfg.run_dir).resolve() != run_dir:
        raise ConfigError(f"run_dir: {cfg.run_dir} differs from --resume {resume}; a run resumes in its own directory")
    # Verified, newest first: a damaged one is set aside with a warning (or, when none is
    # intact, named in the refusal), never loaded.
    checkpoint, damaged = latest_intact_checkpoint(run_dir, log.warning)
    if checkpoint is None:
        raise ConfigError(f"--resume: no {'intact' if damaged else 'complete'} checkpoint in "
                          f"{run_dir / 'checkpoints'}" + (f" ({'; '.join(damaged)})" if damaged else ""))
    saved = from_yaml((checkpoint / "config.yaml").read_text())
    if cfg.model.path == "demo":
        cfg.model.path = str(run_dir / "base_model")
    for key in RESUME_FIXED:
        if _lookup(cfg, key) != _lookup(saved, key):
            raise ConfigError(f"{key}: {_lookup(cfg, key)} differs from the checkpoint's {_lookup(saved, key)}; "
                              f"a resumed run must keep it")
    return checkpoint


def prepare_run_dir(cfg: Config, resuming: bool = False) -> Path:
    run_dir = resolve_run_dir(cfg).resolve()
    if (run_dir / "metrics.jsonl").exists() and not resuming:
        raise ConfigError(f"run_dir: {run_dir} already holds a run; choose another run_dir (or --resume it)")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("endpoints.json", "status.json", NO_RESTARTS_FILE):  # the launcher waits for a fresh endpoints.json
        (run_dir / stale).unlink(missing_ok=True)
    cfg.run_dir = str(run_dir)
    check_engine(cfg)
    if cfg.model.path == "demo":
        cfg.model.path = str(ensure_demo_model(cfg, run_dir / "base_model"))
    elif not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError(f"model.path: {cfg.model.path} is not a Hugging Face model directory (no config.json)")
    check_engine(cfg, model=True)
    check_lora(cfg)
    check_task(cfg)
    chosen = choose_learner_ranks(cfg)
    if chosen:
        log.info("%s", chosen)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def choose_learner_ranks(cfg: Config) -> str | None:
    """Resolve `learner.ranks: auto` in place: one rank per visible GPU on CUDA, one on
    CPU (ranks on one machine share its memory, so sharding fits no larger model there,
    and one rank's intra-op threads use the cores without collectives). Returns the
    line that says what was chosen and why; None when the config names a number.
    ConfigError when the choice does not divide the batch."""
    if cfg.learner.ranks != "auto":
        return None
    try:
        kind = device_type(cfg.model.device)
    except RuntimeError as err:
        raise ConfigError(f"model.device: {err}") from None
    if kind == "cuda":
        import torch

        cfg.learner.ranks = torch.cuda.device_count()
        why = f"one per visible GPU ({cfg.learner.ranks})"
    else:
        cfg.learner.ranks = 1
        why = "CPU: one process trains without collectives; more ranks on one machine would fit no larger model"
    try:
        Config.model_validate(cfg.model_dump())
    except ValidationError as err:
        raise ConfigError(f"learner.ranks: auto chose {cfg.learner.ranks}, but "
                          f"{err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    return f"learner.ranks=auto: {cfg.learner.ranks} ({why}; set learner.ranks to choose)"


def prepare(cfg: Config, resume: str | None = None) -> tuple[Path, Path | None, RunLock]:
    """What every launch does before starting the learner world (`async-rl train`, and
    `async-rl prepare` for launch/learner.sh): (run directory, checkpoint to resume or
    None, the run directory's lock, held). The lock comes first: nothing is written to
    (or set aside in) a directory another run is using."""
    lock = RunLock(Path(resume) if resume else resolve_run_dir(cfg)).acquire()
    try:
        checkpoint = find_resume_checkpoint(cfg, resume) if resume else None
        return prepare_run_dir(cfg, resuming=checkpoint is not None), checkpoint, lock
    except BaseException:
        lock.release(refused=True)
        raise


def _wait_for_hub(run_dir: Path, learner: subprocess.Popen, timeout_s: float, stopping=lambda: False) -> str:
    def give_up() -> str | None:
        if stopping():
            return "interrupted while the learner was starting"
        if learner.poll() is not None:
            return f"the learner exited with status {learner.returncode} before starting its hub"
        return None

    return RunDir(run_dir).wait_for_hub(timeout_s, give_up)


def _child_env(threads: int) -> dict[str, str]:
    # The working directory goes on the children's path, so a reward module next to the
    # config (`task.reward: my_rewards:score`) imports in the learner and actors as in prepare.
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=path)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)  # each child leads its own process group (torchrun's workers too)
            except ProcessLookupError:
                pass


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _say(text: str) -> None:
    """One line on the console; a closed terminal (SIGHUP) must not stop the shutdown.
    On a terminal it first clears the line the learner's progress bar may hold (the bar
    is redrawn below it), so that the line starts a line of its own."""
    try:
        clear = "\r\x1b[K" if sys.stderr.isatty() else ""
        print(f"{clear}async-rl: {text}", file=sys.stderr, flush=True)
    except OSError:
        pass


def _learner_workers(torchrun: subprocess.Popen) -> list[int]:
    from async_rl.run.processes import process_tree

    return process_tree(torchrun.pid)[1:]


def _spawn_actor(cfg: Config, i: int, logs: Path, hub: str | None = None, run_dir: Path | None = None,
                 hub_wait_s: float = 0.0, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Actor i, joining `hub`, or the hub `run_dir`'s learner is about to start: then it
    imports and starts up while the learner does, and waits up to `hub_wait_s` for it."""
    where = ["--hub", hub] if hub is not None else ["--run-dir", str(run_dir)]
    wait_s = max(cfg.actors.connect_timeout_s, hub_wait_s)
    out = open(logs / f"actor-{i}.log", "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "async_rl.cli", "actor", *where, "--name", f"actor-{i}",
             "--connect-timeout", str(wait_s), *(["--keys", cfg.security.keys_dir] if cfg.security.curve else [])],
            env=dict(_child_env(cfg.actors.threads), **(env or {})), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_of(os.getpid()))
    finally:
        out.close()


def train(cfg: Config, resume: str | None = None) -> int:
    """`resume`: a run directory to continue from its latest intact checkpoint."""
    # The stop handlers stay until the summary is printed: a signal that comes after the
    # learner ended must not kill this process halfway through reporting a finished run.
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        return _train(cfg, resume)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _train(cfg: Config, resume: str | None) -> int:
    run_dir, checkpoint, lock = prepare(cfg, resume)
    _say(f"run directory {run_dir}" + (f", resuming from {checkpoint.name}" if checkpoint else ""))
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    # The learner holds the lock too (an inherited descriptor): it is released only once
    # neither is alive. Its ranks take no lock of their own and leave the console line
    # of a failure to this process (LAUNCHER_ENV).
    learner = subprocess.Popen(learner_command(cfg, run_dir, checkpoint),
                               env=dict(_child_env(cfg.learner.threads), **{LAUNCHER_ENV: "1"}),
                               start_new_session=True, pass_fds=(lock.fd,), preexec_fn=child_of(os.getpid()))
    direct = runs_directly(cfg)
    actors: list[subprocess.Popen] = []
    restarts = 0
    given_up: set[int] = set()
    stop_signal = 0
    failure = None
    server = ServerProcess.for_run(cfg, run_dir, _child_env(cfg.reward_server.threads), child_of(os.getpid()))
    actor_env = server.actor_env if server else {}

    def on_signal(signum, _frame):
        nonlocal stop_signal
        stop_signal = stop_signal or signum

    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)
    try:
        # Loading a large model comes before the hub: give start-up at least HUB_START_S.
        # The actors start at once: their imports and set-up overlap the learner's.
        hub_wait_s = max(cfg.learner.timeout_s, HUB_START_S)
        if server:  # its models load while the learner and the actors start; actors score once it serves
            server.start()
        actors = [_spawn_actor(cfg, i, logs, run_dir=run_dir, hub_wait_s=hub_wait_s, env=actor_env)
                  for i in range(cfg.actors.count)]
        if server:
            try:
                server.wait_ready(lambda: "interrupted while the reward server was starting" if stop_signal else
                                  f"the learner exited with status {learner.returncode} while the reward server was "
                                  f"starting" if learner.poll() is not None else None)
            except RuntimeError as err:
                failure = str(err)
                raise
        hub = _wait_for_hub(run_dir, learner, timeout_s=hub_wait_s, stopping=lambda: bool(stop_signal))
        while learner.poll() is None and not stop_signal:
            time.sleep(0.2)
            if server:
                server.watch(_say)
            for i, actor in enumerate(actors):
                # Exit 0 is an actor the hub said goodbye to; anything else died.
                if actor.poll() not in (None, 0) and learner.poll() is None and not stop_signal:
                    if restarts >= cfg.actors.max_restarts:
                        if i not in given_up:
                            given_up.add(i)
                            note = (f"actor-{i} {ended(actor)} and actors.max_restarts={cfg.actors.max_restarts} "
                                    f"are used up; its log: {logs / f'actor-{i}.log'}")
                            _say(f"{note}: not restarting it")
                            with contextlib.suppress(OSError):  # the learner then waits out learner.timeout_s
                                write_no_restarts(run_dir, note)
                        continue
                    restarts += 1
                    _say(f"actor-{i} {ended(actor)}; restarting it ({restarts} of "
                         f"actors.max_restarts={cfg.actors.max_restarts}; its log: {logs / f'actor-{i}.log'})")
                    actors[i] = _spawn_actor(cfg, i, logs, hub=hub, env=actor_env)
        if stop_signal:
            # The ranks finish their step, write a checkpoint and final/, and the hub
            # tells the actors goodbye; they are only killed if they do not leave.
            # torchrun itself is left alone: its ranks exiting 0 end it without a report.
            _say(f"stopping ({signal.Signals(stop_signal).name}): saving a checkpoint")
            for pid in [learner.pid] if direct else _learner_workers(learner):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        _wait_all([learner], GRACE_S)
        if learner.returncode == 0:  # the hub told the actors goodbye; a failed one cannot
            _wait_all(actors, 10.0)
    except RuntimeError as err:
        _say(str(err))
    finally:
        stopped_by = stop_signal  # one that comes later finds the run already over
        everyone = [learner, *actors, *([server.proc] if server and server.proc else [])]
        _stop(everyone, signal.SIGTERM)
        _wait_all(everyone, 5.0)
        _stop(everyone, signal.SIGKILL)
        _wait_all(everyone, 5.0)
        lock.release()
    run = RunDir(run_dir)
    if failure and not stopped_by:
        with contextlib.suppress(OSError):
            write_status(run_dir, 1, failure)
        print_summary(run_dir)
        return 1
    status = run.status()
    if not stopped_by and learner.returncode == 0 and status and not status["exit_code"] and cfg.eval.final_dtypes \
            and run.final_model():
        _score_final(cfg, run, stopping=lambda: bool(stop_signal))
    if stopped_by:  # the learner ended cleanly on our SIGTERM; the run's status is the signal's
        reason = status["reason"] if status else "stopped before the learner had started"
        with contextlib.suppress(OSError):  # a full disk must not change what the launcher exits with
            write_status(run_dir, 128 + stopped_by, f"{reason} ({signal.Signals(stopped_by).name})")
    print_summary(run_dir)
    if stopped_by:
        return 128 + stopped_by
    if learner.returncode == 0 and status and status["exit_code"]:
        _say(status["reason"])
        return int(status["exit_code"])
    if learner.returncode != 0:
        reason = status["reason"] if status and status["exit_code"] else killed_or_failed(learner)
        if direct and learner.returncode < 0:  # no torchrun to have recorded why
            with contextlib.suppress(OSError):
                write_status(run_dir, 1, reason)
        _say(f"the learner failed: {reason}; details in {logs}; continue from the last checkpoint with: "
             f"async-rl train {run_dir / 'config.yaml'} --resume {run_dir}")
        return 1
    return 0


def learner_command(cfg: Config, run_dir: Path, checkpoint: Path | None) -> list[str]:
    """The learner world's command: one rank runs as this process's child, several under
    torchrun, with torchrun's failure report sent to logs/ (learner/world.py)."""
    learner = ["-m", "async_rl.learner", str(run_dir / "config.yaml"),
               *(["--resume", str(checkpoint)] if checkpoint else [])]
    if runs_directly(cfg):
        return [sys.executable, *learner]
    return [sys.executable, "-m", "async_rl.learner.world", str(run_dir), "--standalone",
            f"--nproc-per-node={cfg.learner.ranks}", *learner]


def runs_directly(cfg: Config) -> bool:
    """Whether the learner is one rank run as this process's child: torchrun's own
    interpreter and rendezvous would only add seconds to it."""
    return cfg.learner.ranks == 1


def ended(proc: subprocess.Popen) -> str:
    """How a process that ended did: `was killed by SIGKILL`, `exited with status 1`."""
    code = proc.returncode
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def killed_or_failed(learner: subprocess.Popen) -> str:
    """Why a learner process that recorded no reason ended, as torchrun's report names it."""
    if learner.returncode < 0:
        return f"learner rank 0 (pid {learner.pid}) was killed by {signal.Signals(-learner.returncode).name}"
    return f"exit status {learner.returncode}"


def _score_final(cfg: Config, run: RunDir, stopping) -> None:
    """eval.final_dtypes: final/ scored again, in a process per dtype; one line either way."""
    from async_rl.run.model_card import score_final

    step = run.last_step()
    _say(f"scoring final/ in {', '.join(cfg.eval.final_dtypes)} (eval.final_dtypes)")
    scores = score_final(run.path, step, cfg.eval.final_dtypes, cfg.eval.threads or cfg.actors.threads,
                         cfg.learner.timeout_s, stopping)
    if isinstance(scores, str):
        _say(scores)


def print_summary(run_dir: Path) -> None:
    from async_rl.run.summary import summary_lines

    for line in summary_lines(run_dir):
        _say(line.removeprefix("async-rl: "))
