"""The launcher under an operator's faults, on real runs: a second writer on a live run
directory is refused, a launcher killed outright takes its whole run with it, and SIGHUP
stops a run like SIGTERM (a checkpoint, final/, exit 129)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, kill_tree, subprocess_env, survivors

from async_rl.config import ConfigError
from async_rl.run.directory import RunDir
from async_rl.run.lock import RunLock
from async_rl.run.processes import process_tree

SMALL = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
         "eval.every=0", "learner.ranks=1"]


def launch(run: Path, model: Path, *overrides: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={model}", *SMALL, *overrides]
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def wait_training(run: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while RunDir(run).last_step() < 2:
        assert proc.poll() is None and time.time() < deadline, "the run did not start training"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_second_writer_is_refused_and_a_killed_launcher_leaves_nothing_running(tmp_path, demo_model):
    run = tmp_path / "run"
    first = launch(run, demo_model, "train.max_steps=100000", "actors.count=2", log=tmp_path / "first.log")
    try:
        wait_training(run, first)
        tree = process_tree(first.pid)
        assert len(tree) >= 4  # launcher, torchrun, a learner rank, two actors
        endpoints = (run / "endpoints.json").read_text()
        for extra in ([], ["--resume", str(run)]):
            second = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"),
                                     f"run_dir={run}", f"model.path={demo_model}", *SMALL, *extra],
                                    capture_output=True, text=True, timeout=60, env=subprocess_env())
            assert second.returncode == 2, second.stderr[-2000:]
            # Its one line is the refusal: it said nothing of a run directory, so it started nothing.
            lines = [line for line in second.stderr.splitlines() if line.startswith("async-rl")]
            assert lines == [lines[-1]] and f"is in use by pid {first.pid}" in lines[-1]
        assert (run / "endpoints.json").read_text() == endpoints  # the first run's files untouched

        os.kill(first.pid, signal.SIGKILL)  # the launcher alone: its children lead their own sessions
        first.wait(timeout=30)
        assert not survivors(tree[1:]), "processes of the run outlived their launcher"
    finally:
        if first.poll() is None:
            kill_tree(first)
    # The lock died with its holders: the directory can be taken again. A killed
    # multi-threaded process shows as a zombie before its last thread has closed its
    # files (and so released the lock): allow the kernel a moment.
    deadline = time.time() + 30
    while True:
        try:
            RunLock(run).acquire().release()
            break
        except ConfigError:
            assert time.time() < deadline, "the run directory's lock outlived its holders by 30 s"
            time.sleep(0.1)


@pytest.mark.timeout(120)
def test_sighup_stops_the_run_like_sigterm(tmp_path, demo_model):
    run = tmp_path / "run"
    proc = launch(run, demo_model, "train.max_steps=100000", log=tmp_path / "launcher.log")
    try:
        wait_training(run, proc)
        tree = process_tree(proc.pid)
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    err = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 128 + signal.SIGHUP, err[-3000:]
    assert "stopping (SIGHUP)" in err and "Traceback" not in err
    status = RunDir(run).status()
    assert status["reason"].startswith("interrupted at step") and status["reason"].endswith("(SIGHUP)")
    assert status["exit_code"] == 128 + signal.SIGHUP  # what the launcher exits with
    assert (run / "final" / "model.safetensors").exists() and list((run / "checkpoints").glob("step_*"))
    assert not survivors(tree[1:])


LATE_SIGNAL = """
import os, signal, sys
from async_rl import cli
from async_rl.run import launcher
summary = launcher.print_summary
def signalled_summary(run_dir):
    os.kill(os.getpid(), signal.SIGTERM)  # the learner has ended: the signal comes too late to stop it
    summary(run_dir)
launcher.print_summary = signalled_summary
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
def test_a_signal_after_the_learner_ended_leaves_the_finished_run_finished(tmp_path, demo_model):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", LATE_SIGNAL, "train", str(ROOT / "configs/demo.yaml"),
                           f"run_dir={run}", f"model.path={demo_model}", *SMALL, "train.max_steps=2"],
                          capture_output=True, text=True, timeout=100, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "stopping" not in proc.stderr
    status = RunDir(run).status()
    assert status["exit_code"] == 0 and "SIGTERM" not in status["reason"]


@pytest.mark.timeout(120)
def test_a_killed_learner_rank_is_one_console_line_with_the_resume_command(tmp_path, demo_model):
    run = tmp_path / "run"
    proc = launch(run, demo_model, "train.max_steps=100000", "learner.ranks=2", log=tmp_path / "launcher.log")
    try:
        wait_training(run, proc)
        tree = process_tree(proc.pid)
        ranks = {env["RANK"]: p for p in tree if "RANK" in (env := environ(p))}
        assert sorted(ranks) == ["0", "1"]
        os.kill(ranks["1"], signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    err = (tmp_path / "launcher.log").read_text()
    assert proc.returncode == 1, err[-3000:]
    # One line for the failure, naming the root cause (not rank 0's "connection closed"),
    # and no torchrun report or traceback on the console: that is in logs/torchrun.log.
    failed = [line for line in err.splitlines() if "learner" in line and "fail" in line]
    assert len(failed) == 1 and "learner rank 1" in failed[0] and "SIGKILL" in failed[0], err[-3000:]
    assert f"--resume {run}" in failed[0]
    assert "Traceback" not in err and "ChildFailedError" not in err and "FAILED" not in err
    assert "SIGKILL" in (run / "logs" / "torchrun.log").read_text()
    assert "SIGKILL" in RunDir(run).status()["reason"]
    assert not survivors(tree[1:])


@pytest.mark.timeout(60)
def test_a_full_disk_when_the_launcher_writes_is_one_line(tmp_path, demo_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").symlink_to("/dev/full")  # the kernel answers every write with ENOSPC
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"),
                           f"run_dir={run}", f"model.path={demo_model}", *SMALL],
                          capture_output=True, text=True, timeout=50, env=subprocess_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["async-rl: [Errno 28] No space left on device"], proc.stderr[-3000:]
    assert not (run / "run.lock").exists() and not (run / "logs").exists()


def test_root_cause_is_the_killed_rank_else_the_first_error_written(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from async_rl.learner.world import root_cause

    def failure(rank, exitcode):
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file="")

    (tmp_path / "learner-rank0.err").write_text("learner rank 0: RuntimeError: Connection closed by peer\n\n...")
    assert root_cause({0: failure(0, 1), 1: failure(1, -9)}, tmp_path) == \
        "learner rank 1 (pid 101) was killed by SIGKILL"
    time.sleep(0.01)
    (tmp_path / "learner-rank1.err").write_text("learner rank 1: ValueError: bad batch\n\n...")
    os.utime(tmp_path / "learner-rank0.err", ns=(time.time_ns(), time.time_ns()))  # rank 0's came second
    assert root_cause({0: failure(0, 1), 1: failure(1, 1)}, tmp_path) == "learner rank 1: ValueError: bad batch"
    assert root_cause({2: failure(2, 3)}, tmp_path) == "learner rank 2 (pid 102) exited with status 3"
