"""Elastic actors in a live run: actors SIGKILLed mid-generation and mid-broadcast are
reaped as soon as their connection closes, training goes on with the survivors without a
restart, and an actor started with only `--hub` gets the config and the current weights
from the hub, joins the broadcast group and carries the training alone."""
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, kill_tree, subprocess_env, survivors

from async_rl.run.directory import RunDir

MAX_STALENESS = 2  # configs/demo.yaml


def actor_pids(run: Path) -> set[int]:
    return {a["pid"] for a in RunDir(run).endpoints()["actors"]}


class Run:
    """The `async-rl train` process and the conditions the test waits for."""

    def __init__(self, run: Path, launcher: subprocess.Popen):
        self.dir, self.launcher = run, launcher

    def wait(self, what: str, predicate, timeout: float = 45.0) -> None:
        deadline = time.time() + timeout
        while not predicate():
            assert self.launcher.poll() is None, f"the run ended while waiting for: {what}"
            assert time.time() < deadline, f"not within {timeout:.0f}s: {what}"
            time.sleep(0.2)

    def wait_for_progress(self, what: str, live: int, more_steps: int = 2) -> None:
        """Wait for a step logged with `live` actors, then `more_steps` further steps."""
        start = RunDir(self.dir).last_step()
        self.wait(f"{what}: a step with actors/live == {live}",
                  lambda: any(s["actors/live"] == live for s in RunDir(self.dir).steps() if s["step"] > start))
        seen = next(s["step"] for s in RunDir(self.dir).steps() if s["step"] > start and s["actors/live"] == live)
        self.wait(f"{what}: {more_steps} more steps", lambda: RunDir(self.dir).last_step() >= seen + more_steps)


def start_actor(run: Path, name: str, *cmd: str) -> tuple[subprocess.Popen, Path]:
    log = run / f"{name}.log"
    hub = RunDir(run).endpoints()["hub"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *cmd, "--hub", hub], env=subprocess_env(), stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, log


@pytest.mark.timeout(180)
def test_actors_killed_and_started_during_a_run(tmp_path, demo_model):
    run_dir = tmp_path / "elastic"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=100000", "learner.ranks=1", "actors.count=2",
           "actors.heartbeat_timeout_s=3", "actors.max_restarts=0", "sync.timeout_s=8", "sync.every=1",
           "sync.bucket_mb=0.05",  # several buckets: a broadcast can break off midway
           "transport.timeout_s=10"]  # bounds how long an actor that missed its goodbye lingers
    with open(tmp_path / "launcher.log", "wb") as err:  # a file, not a pipe that could fill up and block
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)
    run = Run(run_dir, launcher)
    started: list[subprocess.Popen] = []
    pids: set[int] = set()
    try:
        run.wait("two training steps, both actors registered",
                 lambda: RunDir(run_dir).last_step() >= 2 and len(actor_pids(run_dir)) == 2, timeout=120)
        learner_pid = RunDir(run_dir).endpoints()["learner_pid"]
        first, second = RunDir(run_dir).endpoints()["actors"]
        pids = {learner_pid, first["pid"], second["pid"]}

        # 1. Kill an actor wherever it is (generating, or in a sync: they are frequent).
        os.kill(first["pid"], signal.SIGKILL)
        run.wait_for_progress("after killing actor 0", live=1)
        assert actor_pids(run_dir) == {second["pid"]}

        # 2. A new actor, given only the hub address, joins and receives the current weights.
        newcomer, newcomer_log = start_actor(run_dir, "newcomer", "-m", "async_rl.cli", "actor")
        started.append(newcomer)
        pids.add(newcomer.pid)
        run.wait("the newcomer in endpoints.json", lambda: actor_pids(run_dir) == {second["pid"], newcomer.pid})
        run.wait("the newcomer's first weight sync", lambda: "synced to version" in newcomer_log.read_text())
        run.wait_for_progress("after the newcomer joined", live=2)

        # 3. An actor that dies halfway through its second sync, at the end of the chain
        # (tests/integration/dying_actor.py): rank 0 misses its acknowledgement, counts the sync as
        # failed and sends the version again once the dead actor is reaped.
        failed_syncs = (tmp_path / "launcher.log").read_text().count("failed: Connection closed by peer")
        dying, dying_log = start_actor(run_dir, "dying", str(ROOT / "tests/integration/dying_actor.py"), "2")
        started.append(dying)
        pids.add(dying.pid)
        dying.wait(timeout=60)
        assert dying.returncode == -signal.SIGKILL, dying_log.read_text()[-2000:]
        assert "synced to version" in dying_log.read_text()  # it had joined before dying
        run.wait("the dying actor reaped", lambda: actor_pids(run_dir) == {second["pid"], newcomer.pid})
        run.wait_for_progress("after the mid-broadcast kill", live=2)
        assert (tmp_path / "launcher.log").read_text().count("failed: Connection closed by peer") > failed_syncs

        # 4. The last original actor goes too: the newcomer alone keeps the run going.
        os.kill(second["pid"], signal.SIGKILL)
        run.wait_for_progress("with the newcomer alone", live=1)
        assert actor_pids(run_dir) == {newcomer.pid}

        launcher.send_signal(signal.SIGINT)  # a clean stop: 130, as for any interrupted run
        launcher.wait(timeout=90)
        newcomer.wait(timeout=30)  # told goodbye by the hub
    finally:
        for proc in [launcher, *started]:
            if proc.poll() is None:
                kill_tree(proc)
    launcher_log = (tmp_path / "launcher.log").read_text()
    assert launcher.returncode == 130, launcher_log[-3000:]
    assert newcomer.returncode == 0, newcomer_log.read_text()[-2000:]
    assert "leaving: run finished" in newcomer_log.read_text()

    steps = RunDir(run_dir).steps()
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))  # no restart
    for s in steps:
        assert s["staleness/max"] <= MAX_STALENESS and s["staleness/dropped"] == 0, s
        assert math.isfinite(s["loss/total"]), s
    assert "removed: its connection closed" in launcher_log  # reaped at once, not after the heartbeat timeout
    assert not survivors(pids), "orphan processes left behind"


@pytest.mark.timeout(180)
def test_the_run_goes_on_with_the_actors_left_and_ends_in_one_line_when_none_is(tmp_path, demo_model):
    """actors.max_restarts used up: each actor not restarted is one line; the run goes on
    while an actor is live, and stops (checkpoint, final/, exit 5) as soon as none is,
    not after learner.timeout_s."""
    run_dir = tmp_path / "exhausted"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=100000", "learner.ranks=1", "actors.count=2",
           "actors.max_restarts=0", "actors.heartbeat_timeout_s=3", "learner.timeout_s=600",
           "sync.timeout_s=8",  # the survivor may sit downstream of the killed actor in a broadcast: bounded
           "transport.timeout_s=10"]
    with open(tmp_path / "launcher.log", "wb") as err:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)
    run = Run(run_dir, launcher)
    try:
        run.wait("two training steps, both actors registered",
                 lambda: RunDir(run_dir).last_step() >= 2 and len(actor_pids(run_dir)) == 2, timeout=120)
        first, second = RunDir(run_dir).endpoints()["actors"]
        os.kill(first["pid"], signal.SIGKILL)
        run.wait_for_progress("after killing actor 0", live=1)
        os.kill(second["pid"], signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=90)
        stopped_in = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            kill_tree(launcher)
    log = (tmp_path / "launcher.log").read_text()
    assert launcher.returncode == 5, log[-3000:]
    assert stopped_in < 90 and "Traceback" not in log  # not learner.timeout_s (600 s)
    for i in (0, 1):
        assert (f"actor-{i} was killed by SIGKILL and actors.max_restarts=0 are used up; its log: "
                f"{run_dir / 'logs' / f'actor-{i}.log'}: not restarting it") in log
    status = RunDir(run_dir).status()
    assert status["exit_code"] == 5 and status["reason"].startswith("stopped at step ")
    # the launcher's last note when the learner looked: actor-1's, or actor-0's if that one came first
    assert "no actor is left (actor-" in status["reason"] and "actors.max_restarts=0 are used up" in status["reason"]
    assert status["reason"] in log
    assert (run_dir / "final").is_dir()


@pytest.mark.timeout(180)
def test_a_hand_started_actor_stopped_with_ctrl_c_says_so_in_one_line(tmp_path, demo_model):
    run_dir = tmp_path / "hand"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=100000", "learner.ranks=1", "actors.count=1"]
    with open(tmp_path / "launcher.log", "wb") as err:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)
    run = Run(run_dir, launcher)
    hand = None
    try:
        run.wait("two steps", lambda: RunDir(run_dir).last_step() >= 2, timeout=120)
        hand, log = start_actor(run_dir, "hand", "-m", "async_rl.cli", "actor", "--name", "mine")
        run.wait("the hand-started actor's first sync", lambda: "synced to version" in log.read_text())
        hand.send_signal(signal.SIGINT)
        hand.wait(timeout=60)
        run.wait_for_progress("after it left", live=1)
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=90)
    finally:
        for proc in (launcher, hand):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    said = log.read_text()
    assert hand.returncode == 130, said[-3000:]
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert said.strip().splitlines()[-1] == "async-rl: actor mine stopped (SIGINT); the hub re-issues its prompts"
