"""User reward code that fails on some responses is data: such samples are left out as
unscorable (reward.on_failure=exclude), counted per reason (reward/errors*), and the run
goes on; a reward
that fails on most responses stops the run with a checkpoint and exit status 4.
The rewards (tests/integration/fault_rewards.py) pass the launch check and fail only on model output."""
import os
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env, train

from async_rl.wire.messages import FAILURE_REASONS as REASONS

SMALL = ["learner.ranks=1", "eval.every=5", "train.max_steps=10", "reward.timeout_s=0.5"]


def _with_fault_rewards(env: dict[str, str]) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT / "tests" / "integration")) if p)
    return env  # the launcher and the actors import the reward from tests/integration/


def test_rewards_that_raise_hang_or_return_nan_or_none_are_counted_and_the_run_finishes(tmp_path, demo_model,
                                                                                         monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _with_fault_rewards(dict(os.environ))["PYTHONPATH"])
    run = tmp_path / "flaky"
    train(run, demo_model, *SMALL, "task.reward=fault_rewards:mixed_faults")
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 11))
    last = steps[-1]
    by_reason = {r: last[f"reward/errors_{r}"] for r in REASONS}
    assert last["reward/errors"] == sum(by_reason.values()) > 0
    assert all(n > 0 for n in by_reason.values()), by_reason  # raised, timeout (0.5 s), NaN, None
    assert all(s["reward/error_frac"] <= 0.5 for s in steps)
    assert any(s["reward/unscorable_frac"] > 0 for s in steps)  # left out, not trained on as zeros
    # Evaluation scored through the guard too: without it a None reward ends the actor
    # in the step-0 round; its first failure of each kind is logged once, in the actor log.
    assert evals and evals[0]["step"] == 0
    log = (run / "logs" / "actor-0.log").read_text()
    for reason in REASONS:
        assert log.count(f"further '{reason}' failures are counted") == 1, reason
    assert "ZeroDivisionError" in log and "Traceback" in log


def test_a_reward_that_fails_on_most_responses_stops_the_run_with_status_4(tmp_path, demo_model):
    run = tmp_path / "broken"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", *SMALL, "reward.max_error_frac=0.5",
           "task.reward=fault_rewards:broken_on_real_responses"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_with_fault_rewards(subprocess_env()))
    assert proc.returncode == 4, proc.stderr[-3000:]
    reasons = [line for line in proc.stderr.splitlines() if line.startswith("async-rl: stopped:")]
    assert len(reasons) == 1 and "reward.max_error_frac=0.5" in reasons[0] and "raised " in reasons[0], reasons
    steps, _ = read_metrics(run)
    assert len(steps) == 1 and steps[0]["reward/error_frac"] > 0.5 and steps[0]["reward/errors_raised"] > 0
    assert (run / "checkpoints" / "step_000001" / "coordinator.json").exists()
    assert (run / "final" / "model.safetensors").exists()
