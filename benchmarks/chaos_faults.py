"""The run under faults of benchmarks/chaos.py: its launches and resumes, the faults and
what each cost. Every fault is injected from outside, as an operator or a
machine failure would: signals to the processes endpoints.json names, the bed's links,
a filled file system; and observed through the run's files (RunDir) and its launcher's
console log (OUT/launch-K.log, one per launch).

    chaos = Chaos(args, bed)        # args: out, model_path, seed, set, minutes, memory_every
    launcher_exit = chaos.play(kinds, count)
    chaos.faults                    # one dict per fault: kind, when, what, cost, passed
    chaos.close()                   # SIGCONT, then SIGKILL to whatever of the run is left
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import chaos_report
import psutil
from fault_drill import wait_for  # sibling scripts: the drill's wait, the namespace bed
from netns_bed import Bed

from async_rl.run.directory import RunDir
from async_rl.run.processes import process_tree

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"
HEARTBEAT_TIMEOUT_S = 5.0
SETTINGS = ["actors.count=2", "actors.max_restarts=1000", f"actors.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g}",
            "checkpoint.every=100", "train.max_steps=1000000"]
KINDS = ("actor-kill", "actor-stop", "learner-kill", "link", "disk")
BED_ACTOR = "bed-actor"
LINK_RATE_MBIT = 1.0
WAIT_S = 300.0  # the longest any wait for the run may take: far beyond a resume on a loaded machine
REJOIN_S = 120.0  # an actor restarted, continued or reconnected must be registered within this
RECOVERY_STEPS = 10  # a fault's longest pause is measured up to this many steps after it ended
END_MARGIN_S = 15.0  # no fault is due in the run's last seconds: room to see it recovered from
STOP_S = 120.0  # SIGTERM to exit: the step, a checkpoint and final/


def train_command(args, run: RunDir, *overrides: str, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "async_rl.cli", "train", str(CONFIG), f"run_dir={run.path}",
            f"model.path={args.model_path}", f"seed={args.seed}", *SETTINGS, *args.set, *overrides,
            *(["--resume", str(run.path)] if resume else [])]


def kill_tree(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def draw_schedule(kinds: list[str], count: int, start_s: float, end_s: float, rng: random.Random):
    """(due second, kind) pairs: `count` faults at uniform times, every kind at least once,
    and actor-stop twice where there is room (its pauses alternate, shorter and longer)."""
    required = list(kinds) + (["actor-stop"] if "actor-stop" in kinds and count > len(kinds) else [])
    chosen = required + [rng.choice(kinds) for _ in range(count - len(required))]
    rng.shuffle(chosen)
    return list(zip(sorted(rng.uniform(start_s, max(start_s, end_s)) for _ in chosen), chosen))


class Chaos:
    """One run under faults: its launches and resumes, the faults and their costs."""

    def __init__(self, args, bed: Bed | None):
        self.args, self.bed = args, bed
        self.run = RunDir((args.out / "run").resolve())
        self.rng = random.Random(args.seed)
        self.launcher: subprocess.Popen | None = None
        self.bed_actor: subprocess.Popen | None = None
        self.launches = 0
        self.stopped: set[int] = set()  # actors under SIGSTOP: continued whatever happens
        self.stop_longer = self.rng.random() < 0.5  # the next SIGSTOP's side of the heartbeat timeout
        self.faults: list[dict] = []
        self.windows: list[tuple[float, float]] = []  # each fault's, from injection to RECOVERY_STEPS after it
        self.start = time.time()
        self.watch = chaos_report.Watch(self.run, args.out / "memory.jsonl", self.roots, args.memory_every)
        self.watch.start_time = self.start

    def roots(self) -> list[int]:
        return [p.pid for p in (self.launcher, self.bed_actor) if p is not None and p.poll() is None]

    def elapsed(self) -> float:
        return round(time.time() - self.start, 1)

    def log_text(self) -> str:
        return (self.args.out / f"launch-{self.launches}.log").read_text(errors="replace")

    def wait(self, what: str, condition, timeout_s: float = WAIT_S) -> float:
        return wait_for(what, condition, self.launcher, timeout_s)

    def env(self) -> dict[str, str]:
        # gloo otherwise takes the address the host name resolves to, which is not the node's.
        return dict(os.environ, **({"GLOO_SOCKET_IFNAME": "eth0"} if self.bed else {}))

    def launch(self, resume: bool = False) -> None:
        # On the bed, the hub binds the learner node's own address, where the other node reaches it.
        host = [f"transport.host={self.bed.address('learner')}"] if self.bed else []
        cmd = train_command(self.args, self.run, *host, resume=resume)
        if self.bed:
            cmd = self.bed.exec("learner", cmd)
        self.launches += 1
        with open(self.args.out / f"launch-{self.launches}.log", "w") as log:
            self.launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                             start_new_session=True)
        self.wait("the hub's endpoints.json", lambda: self.run.endpoints() is not None)
        if self.bed:
            with open(self.args.out / f"{BED_ACTOR}-{self.launches}.log", "w") as log:
                self.bed_actor = subprocess.Popen(
                    self.bed.exec("actors", [sys.executable, "-m", "async_rl.cli", "actor", "--hub",
                                             self.run.endpoints()["hub"], "--name", BED_ACTOR]),
                    stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)

    def stop_bed_actor(self) -> None:
        if self.bed_actor is not None and self.bed_actor.poll() is None:
            self.bed_actor.terminate()
            try:
                self.bed_actor.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_tree(self.bed_actor)

    def actors(self, local: bool = True) -> list[dict]:
        return [a for a in (self.run.endpoints() or {}).get("actors", []) if (a["name"] != BED_ACTOR) == local]

    def pids(self, local: bool = True) -> list[int]:
        return [a["pid"] for a in self.actors(local)]

    def resume(self, record: dict) -> float:
        """`async-rl train ... --resume` after the launcher has exited; when it started."""
        self.stop_bed_actor()  # its hub is gone; a new one comes with the new hub
        killed_at = self.run.last_step()
        self.run.endpoints_path.unlink(missing_ok=True)  # the dead hub's: wait for the new one's
        relaunched = time.time()
        self.launch(resume=True)
        found = re.search(r"resuming from step_(\d+)", self.log_text())
        record["resumed_from_step"] = int(found.group(1)) if found else None
        record["steps_lost"] = killed_at - int(found.group(1)) if found else None
        return relaunched

    def ensure_running(self) -> None:
        """A launcher that exited unasked is a failure of its own, then resumed."""
        if self.launcher.poll() is None:
            return
        lines = self.log_text().strip().splitlines() or ["(no output)"]
        record = {"fault": "unplanned exit", "at_step": self.run.last_step(), "at_s": self.elapsed(),
                  "what": f"the launcher exited with status {self.launcher.returncode}: {lines[-1][:200]}",
                  "passed": False, "problem": "nothing was injected"}
        ended = self.resume(record)
        self.measure(record, ended, ended, ended)
        self.report(record)

    def report(self, record: dict) -> None:
        self.faults.append(record)
        print(json.dumps(record), flush=True)

    # -- the faults: each returns (injected, over, counted from), wall times -------------------
    def actor_kill(self, record: dict) -> tuple[float, float, float]:
        victim = self.rng.choice(self.actors())
        os.kill(victim["pid"], signal.SIGKILL)
        began = time.time()
        record["what"] = f"SIGKILL {victim['name']} (pid {victim['pid']})"
        record["restarted_after_s"] = round(self.wait(f"{victim['name']} restarted", lambda: any(
            a["name"] == victim["name"] and a["pid"] != victim["pid"] for a in self.actors()), REJOIN_S), 1)
        if f"{victim['name']} was killed by SIGKILL; restarting it" not in self.log_text():
            fail(record, "the launcher did not say it restarted the actor")
        return began, began, began

    def actor_stop(self, record: dict) -> tuple[float, float, float]:
        longer, self.stop_longer = self.stop_longer, not self.stop_longer
        pause = self.rng.uniform(1.5, 3.0) * HEARTBEAT_TIMEOUT_S if longer else \
            self.rng.uniform(0.2, 0.6) * HEARTBEAT_TIMEOUT_S
        victim = self.rng.choice(self.actors())
        pid = victim["pid"]
        removed = False
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)
        began = time.time()
        try:
            while time.time() < began + pause:
                removed = removed or pid not in self.pids()
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
            self.stopped.discard(pid)
        ended = time.time()
        record["what"] = (f"SIGSTOP {victim['name']} for {pause:.1f} s ({'longer' if longer else 'shorter'} than "
                          f"the {HEARTBEAT_TIMEOUT_S:g} s heartbeat timeout; {'dropped' if removed else 'kept'} "
                          "by the hub)")
        record["back_after_sigcont_s"] = round(self.wait(f"{victim['name']} registered after SIGCONT",
                                                         lambda: pid in self.pids(), REJOIN_S), 1)
        if removed != longer:
            fail(record, f"the hub {'dropped' if removed else 'kept'} an actor stopped for {pause:.1f} s")
        return began, ended, began

    def learner_kill(self, record: dict) -> tuple[float, float, float]:
        pid = self.run.endpoints()["learner_pid"]
        os.kill(pid, signal.SIGKILL)
        began = time.time()
        record["what"] = f"SIGKILL the learner (pid {pid})"
        record["launcher_exit"] = self.launcher.wait(timeout=STOP_S)
        if record["launcher_exit"] == 0 or "the learner failed" not in self.log_text():
            fail(record, "the launcher did not report the learner's failure")
        ended = self.resume(record)
        return began, ended, ended

    def link(self, record: dict) -> tuple[float, float, float]:
        pid = self.pids(local=False)[0]
        cut = self.rng.random() < 0.5
        seconds = self.rng.uniform(2.0, 3 * HEARTBEAT_TIMEOUT_S) if cut else self.rng.uniform(3.0, 10.0)
        removed = False
        self.bed.set_link("actors", up=False) if cut else self.bed.set_rate("actors", LINK_RATE_MBIT)
        began = time.time()
        try:
            while time.time() < began + seconds:
                removed = removed or pid not in self.pids(local=False)
                time.sleep(0.1)
        finally:
            self.bed.set_link("actors", up=True) if cut else self.bed.set_rate("actors", None)
        ended = time.time()
        record["what"] = (f"{BED_ACTOR}'s link {'cut' if cut else f'held to {LINK_RATE_MBIT:g} Mbit/s'} for "
                          f"{seconds:.1f} s ({'dropped' if removed else 'kept'} by the hub)")
        record["back_after_link_s"] = round(self.wait(f"{BED_ACTOR} registered after its link came back",
                                                      lambda: pid in self.pids(local=False), REJOIN_S), 1)
        return began, ended, began

    def disk(self, record: dict) -> tuple[float, float, float]:
        mount = self.run.checkpoints_dir
        size = sum(f.stat().st_size for f in self.run.checkpoints()[-1].rglob("*") if f.is_file())
        room = os.statvfs(mount)
        filler = mount / "filler"  # no checkpoint's name: the learner's checkpoint code passes it by
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, max(4096, room.f_bavail * room.f_frsize - size // 2))
        began = time.time()
        record["what"] = f"checkpoints' tmpfs filled to {size // 2 >> 10} KiB free (a checkpoint: {size >> 10} KiB)"
        try:
            record["launcher_exit"] = self.launcher.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            filler.unlink()
            fail(record, "no checkpoint write failed")
            return began, time.time(), began
        failed = [line for line in self.log_text().splitlines() if "the learner failed" in line]
        record["failure"] = failed[0][:300] if failed else None
        if record["launcher_exit"] != 1 or not failed or "checkpoint" not in failed[0]:
            fail(record, "the launcher did not report a failed checkpoint write")
        filler.unlink()
        ended = self.resume(record)
        return began, ended, ended

    def inject(self, kind: str) -> dict:
        self.ensure_running()
        record = {"fault": kind, "passed": True}
        try:
            if kind in ("actor-kill", "actor-stop"):
                self.wait("two actors registered", lambda: len(self.actors()) >= 2, REJOIN_S)
            elif kind in ("learner-kill", "disk"):
                self.wait("a checkpoint to resume from", lambda: bool(self.run.checkpoints()))
            else:
                self.wait(f"{BED_ACTOR} registered", lambda: bool(self.actors(local=False)), REJOIN_S)
            record.update(at_step=self.run.last_step(), at_s=self.elapsed())
            began, ended, counted_from = getattr(self, kind.replace("-", "_"))(record)
            self.measure(record, began, ended, counted_from)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            fail(record, str(err))
        return record

    def measure(self, record: dict, began: float, ended: float, counted_from: float) -> None:
        """What the fault cost: seconds from it to the first learner step after
        `counted_from`, and the longest time between two steps up to RECOVERY_STEPS after
        it was over."""
        self.wait(f"{RECOVERY_STEPS} steps after the fault",
                  lambda: len(self.watch.steps_between(ended, time.time())) >= RECOVERY_STEPS)
        window_end = self.watch.steps_between(ended, time.time())[RECOVERY_STEPS - 1][0]
        self.windows.append((began, window_end))
        record["resumed_after_s"] = round(self.watch.first_advance_after(counted_from)[0] - began, 2)
        record["longest_pause_s"] = self.watch.longest_pause(began, window_end)
        record.setdefault("steps_lost", 0)

    def play(self, kinds: list[str], count: int) -> int:
        """The run from launch to its SIGTERM; the launcher's last exit status."""
        self.launch()
        self.watch.start()
        self.wait("the first step", lambda: self.run.last_step() >= 1)
        for due_s, kind in draw_schedule(kinds, count, self.elapsed() + 5, self.args.minutes * 60 - END_MARGIN_S,
                                         self.rng):
            self.sleep_until(due_s)
            self.report(self.inject(kind))
        self.sleep_until(self.args.minutes * 60)
        self.ensure_running()
        self.launcher.send_signal(signal.SIGTERM)
        code = self.launcher.wait(timeout=STOP_S)
        if self.bed_actor is not None:  # the hub said goodbye to it
            self.bed_actor.wait(timeout=STOP_S)
        return code

    def sleep_until(self, second: float) -> None:
        while self.elapsed() < second:
            self.ensure_running()
            time.sleep(0.5)

    def close(self) -> None:
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for proc in (self.launcher, self.bed_actor):
            kill_tree(proc)
        if self.watch.is_alive():
            self.watch.stop()
        for process in self.watch.processes.values():  # those a dead parent left behind
            with contextlib.suppress(psutil.Error):
                if process.is_running():
                    process.kill()


def fail(record: dict, problem: str) -> None:
    record["passed"] = False
    record["problem"] = "; ".join(filter(None, (record.get("problem"), problem)))
