"""Non-finite losses or gradients: the step is skipped on every rank, and repeated ones
stop the run with a clear message, a checkpoint and exit status 3."""
import json
import os
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env
from safetensors.torch import load_file


def test_repeated_non_finite_steps_stop_the_run_with_weights_intact(tmp_path, demo_model):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10, 30) for b in range(40, 45)))
    run = tmp_path / "faulty"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "eval.size=32", "train.max_steps=50", "train.max_skipped_steps=3", "train.loss=opmd",
           "task.name=jsonl", f"task.train_path={data}", "task.reward=fault_rewards:overflowing"]
    env = subprocess_env()
    # the actors import the reward from tests/integration/
    env["PYTHONPATH"] += f"{os.pathsep}{ROOT / 'tests' / 'integration'}"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "async-rl: stopped: 3 consecutive steps with a non-finite loss or gradient" in proc.stderr
    steps, _ = read_metrics(run)
    assert [s["learner/skipped_steps"] for s in steps] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003" / "coordinator.json").exists()
    # Every step was skipped: the exported weights are exactly the initial ones.
    start, end = load_file(demo_model / "model.safetensors"), load_file(run / "final" / "model.safetensors")
    assert start.keys() == end.keys() and all((start[k] == end[k]).all() for k in start)
