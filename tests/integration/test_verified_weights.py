"""Verified weights in a live run: an actor whose syncs arrive corrupted (one bit, after
the transport, before the check: tests/integration/corrupting_actor.py) refuses them,
keeps generating on its last whole version, and the hub has rank 0 send the version
again; an actor whose syncs keep arriving corrupted leaves, and the run goes on."""
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, kill_tree, subprocess_env
from test_elastic_actors import Run, start_actor

from async_rl.run.directory import RunDir


@pytest.mark.timeout(150)
def test_corrupted_weights_are_refused_sent_again_and_an_actor_that_keeps_failing_leaves(tmp_path, demo_model):
    run_dir = tmp_path / "verified"
    run_dir.mkdir()
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=100000", "learner.ranks=1", "actors.count=1",
           "sync.timeout_s=8", "sync.bucket_mb=0.05", "transport.timeout_s=10"]
    with open(tmp_path / "launcher.log", "wb") as err:
        launcher = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=err)
    run = Run(run_dir, launcher)
    started = []
    try:
        run.wait("two training steps", lambda: RunDir(run_dir).last_step() >= 2, timeout=120)
        script = str(ROOT / "tests/integration/corrupting_actor.py")

        # 1. Its second sync arrives corrupted: refused, sent again, then used.
        once, once_log = start_actor(run_dir, "once", script, "2", "1")
        started.append(once)
        run.wait("the refusal and the sync after it",
                 lambda: "rejected the weights" in once_log.read_text()
                 and once_log.read_text().count("synced to version") >= 2)
        text = once_log.read_text()
        refusal = next(line for line in text.splitlines() if "rejected the weights" in line)
        assert "did not arrive as sent: model.embed_tokens.weight (bucket 0, bytes 0-" in refusal, text
        assert "keeping version" in refusal
        run.wait("the learner's line and metric", lambda: RunDir(run_dir).steps()[-1].get("sync/rejected", 0) >= 1)
        assert "sending them again" in (tmp_path / "launcher.log").read_text()

        # 2. Every sync from the second on arrives corrupted: after three in a row it leaves.
        always, always_log = start_actor(run_dir, "always", script, "2", "1000")
        started.append(always)
        always.wait(timeout=60)
        assert always.returncode == 1, always_log.read_text()[-2000:]
        assert always_log.read_text().count("rejected the weights") == 3
        assert "failed their check 3 syncs in a row" in always_log.read_text()
        steps = RunDir(run_dir).last_step()
        run.wait("training going on", lambda: RunDir(run_dir).last_step() >= steps + 2)

        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=90)
        once.wait(timeout=30)
    finally:
        for proc in [launcher, *started]:
            if proc.poll() is None:
                kill_tree(proc)
    assert launcher.returncode == 130, (tmp_path / "launcher.log").read_text()[-3000:]
    assert once.returncode == 0
    assert RunDir(run_dir).steps()[-1]["sync/rejected"] >= 4
