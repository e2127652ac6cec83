"""The reward server in real runs (`placement: server`): killed with no restarts left,
its samples are unscorable, never scored 0, and the run stops in one line with exit 4,
from which `--resume` goes on; killed with restarts left, it comes back on its port and
the run finishes (final/ then scored by the task's reward, with no server)."""
import json
import os
import signal
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env, wait_for


def start(run_dir, model, reward_model, *overrides, resume=False):
    config = [str(run_dir / "config.yaml")] if resume else [
        str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}", f"model.path={model}", "train.batch_groups=8",
        "train.group_size=4", "actors.groups_per_request=4", "eval.every=0", "checkpoint.every=1",
        "reward.timeout_s=3",
        f"reward.components=[{{name: rm, reward: reward_model, model: {reward_model}, placement: server}}, "
        "{name: exact, reward: task, weight: 0}]"]
    again = ["--resume", str(run_dir)] if resume else []
    return subprocess.Popen([sys.executable, "-m", "async_rl.cli", "train", *config, *overrides, *again],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())


def steps_done(run_dir) -> int:
    try:
        return sum('"step"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()[1:])
    except FileNotFoundError:
        return 0


def kill_server(run_dir) -> int:
    pid = json.loads((run_dir / "reward_server.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def finish(proc, timeout=120):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()


def test_a_killed_server_stops_the_run_in_one_line_and_resume_goes_on(demo_model, reward_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = start(run, demo_model, reward_model_dir, "train.max_steps=500", "reward_server.max_restarts=0")
    assert wait_for(lambda: steps_done(run) >= 2 or proc.poll() is not None, timeout=120), "no steps"
    kill_server(run)
    _, err = finish(proc)
    assert proc.returncode == 4, err[-3000:]
    assert "the reward server was killed by SIGKILL; not restarting it" in err
    last = err.strip().splitlines()[-1]
    assert "failed in reward.components" in last and "reward server" in last, last
    assert "left out of training (unscorable)" in err  # never trained on as zeros
    steps, _ = read_metrics(run)
    scored = [s for s in steps if s["reward/rm/error_frac"] == 0.0]
    assert len(scored) >= 2 and all(s["train/reward_mean"] != 0.0 for s in scored)

    done = steps[-1]["step"]
    again = start(run, demo_model, reward_model_dir, f"train.max_steps={done + 2}", resume=True)
    _, err = finish(again)
    assert again.returncode == 0, err[-3000:]
    steps, _ = read_metrics(run)
    assert steps[-1]["step"] == done + 2 and steps[-1]["reward/rm/error_frac"] == 0.0


def test_a_killed_server_is_restarted_on_its_port_and_the_run_finishes(demo_model, reward_model_dir, tmp_path):
    run = tmp_path / "run"
    proc = start(run, demo_model, reward_model_dir, "train.max_steps=8", "reward.max_error_frac=1.0",
                 "eval.final_dtypes=[float32]")
    assert wait_for(lambda: steps_done(run) >= 2 or proc.poll() is not None, timeout=120), "no steps"
    first = kill_server(run)
    _, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "the reward server was killed by SIGKILL; restarting it (1 of reward_server.max_restarts=3" in err
    status = json.loads((run / "reward_server.json").read_text())
    assert status["pid"] != first and status["rows"] > 0  # the new one scored
    steps, _ = read_metrics(run)
    assert steps[-1]["step"] == 8 and steps[-1]["reward/rm/error_frac"] == 0.0
    # final/ scored again after the server stopped: by the task's reward, which needs no server
    assert any("final/accuracy_float32" in r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
