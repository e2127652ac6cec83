"""The launcher's side of the reward server: start it (on a free loopback port, its log
in logs/reward-server.log, its status in RUN_DIR/reward_server.json), wait until it has
loaded its models, watch it, restart it (at most reward_server.max_restarts times, on
the same port, so the actors' sockets reconnect by themselves), and stop it with the
run. A server that exited, or whose status file went stale for heartbeat_timeout_s (a
hung forward pass: it is killed), is restarted; one that may not be restarted leaves its
components' samples unscorable, and reward.max_error_frac stops the run.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from async_rl.reward_server.config import ENDPOINT_ENV, RewardServerConfig

STATUS_FILE = "reward_server.json"
LOG_FILE = "reward-server.log"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    def __init__(self, section: RewardServerConfig, config: Path, run_dir: Path, env: dict[str, str],
                 preexec: Callable[[], None] | None = None) -> None:
        self.section, self.config, self.env, self.preexec = section, config, env, preexec
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.status = run_dir / STATUS_FILE
        self.log = run_dir / "logs" / LOG_FILE
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.given_up = False

    @classmethod
    def for_run(cls, cfg, run_dir: Path, env: dict[str, str], preexec=None) -> ServerProcess | None:
        """The server a run needs: one with a placement: server component and no
        reward_server.endpoint of its own."""
        if cfg.reward_server.endpoint or not any(c.placement == "server" for c in cfg.reward.components):
            return None
        return cls(cfg.reward_server, run_dir / "config.yaml", run_dir, env, preexec)

    @property
    def actor_env(self) -> dict[str, str]:
        """What the actors' environment adds: where the server is."""
        return {ENDPOINT_ENV: self.endpoint}

    def start(self) -> None:
        self.status.unlink(missing_ok=True)
        self.started = time.monotonic()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "async_rl.reward_server", str(self.config), "--bind", self.endpoint,
                 "--status", str(self.status)],
                env=dict(self.env, OMP_NUM_THREADS=str(self.section.threads)), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=self.preexec)

    def wait_ready(self, stopping: Callable[[], str | None]) -> None:
        """Until the server serves; RuntimeError naming why it never will (it exited, it
        took longer than reward_server.start_timeout_s, `stopping` said why to give up)."""
        deadline = time.monotonic() + self.section.start_timeout_s
        while not self.status.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the reward server exited with status {self.proc.returncode} before it served; "
                                   f"its log: {self.log}")
            if (why := stopping()) is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reward server did not serve within reward_server.start_timeout_s="
                                   f"{self.section.start_timeout_s:g} s; its log: {self.log}")
            time.sleep(0.1)

    def watch(self, say: Callable[[str], None]) -> None:
        """One look, from the launcher's loop: restart a server that exited or hung."""
        if self.proc is None or self.given_up:
            return
        why = None
        if (code := self.proc.poll()) is not None:
            why = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        elif self._stale():
            why = f"stopped answering (no heartbeat for {self.section.heartbeat_timeout_s:g} s): killed"
            self.stop(signal.SIGKILL)
        if why is None:
            return
        if self.restarts >= self.section.max_restarts:
            self.given_up = True
            say(f"the reward server {why}; not restarting it (reward_server.max_restarts="
                f"{self.section.max_restarts}): its components' samples are unscorable, and reward.max_error_frac "
                f"stops the run; its log: {self.log}")
            return
        self.restarts += 1
        say(f"the reward server {why}; restarting it ({self.restarts} of reward_server.max_restarts="
            f"{self.section.max_restarts}; its log: {self.log})")
        self.start()

    def _stale(self) -> bool:
        try:
            beat = self.status.stat().st_mtime
        except FileNotFoundError:  # still loading its models: the start timeout's business
            return time.monotonic() - self.started > self.section.start_timeout_s
        return time.time() - beat > self.section.heartbeat_timeout_s

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                self.proc.wait(timeout=10)
