"""Learner rank 0's side of the evaluator: start it when the run starts (its model loads
while the first steps train), restart it when it exits (at most MAX_RESTARTS times, one
line each), stop it with the run. It dies with the learner (child_of), whatever
started the learner (`async-rl train`, torchrun, Slurm)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

from async_rl.evaluator.service import ROLE_ENV
from async_rl.evaluator.versions import mark_progress
from async_rl.run.processes import child_of

MAX_RESTARTS = 3
LOG_FILE = "evaluator.log"


class EvaluatorProcess:
    def __init__(self, folder: Path, log_path: Path, threads: int):
        self.folder, self.log_path, self.threads = folder, log_path, threads
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.given_up = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileNotFoundError):  # a (re)start is progress: the process marks its own until it is ready
            mark_progress(self.folder)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1", **{ROLE_ENV: "evaluator"})
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "async_rl.evaluator", str(self.folder)], env=env,
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=child_of(os.getpid()))

    def watch(self) -> str | None:
        """One look: a line to log when the evaluator exited (and is restarted, or not)."""
        if self.proc is None or self.given_up or (code := self.proc.poll()) is None:
            return None
        why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        if self.restarts >= MAX_RESTARTS:
            self.given_up = True
            return (f"the evaluator {why}; not restarting it after {MAX_RESTARTS} restarts: no more evaluation "
                    f"lines in this run; its log: {self.log_path}")
        self.restarts += 1
        self.start()
        return f"the evaluator {why}; restarted it ({self.restarts} of {MAX_RESTARTS}; its log: {self.log_path})"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.proc.kill()
