"""benchmarks/fault_drill.py on a tiny real run: its hostile-traffic fuzzer and its
kill-the-whole-job-then-resume orchestration (the kill-actor path is the same as
tests/integration/test_elastic_actors.py). The full-size drill, with its accuracy
target, is in docs/faults.md."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.extended

TINY = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
        "eval.every=10", "train.max_steps=30", "learner.ranks=1"]


def run_drill(tmp_path, demo_model, scenario: str, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks/fault_drill.py"), "--scenarios", scenario,
           "--out", str(tmp_path), "--model", str(demo_model), "--target", "0", "--timeout", "90", *args,
           "--set", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=subprocess_env())
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    (result,) = [r for r in map(json.loads, proc.stdout.splitlines()) if r["scenario"] == scenario]
    return result


def test_drill_hostile_scenario_passes(tmp_path, demo_model):
    hostile = run_drill(tmp_path, demo_model, "hostile", "--messages", "600")
    assert hostile["passed"] and hostile["wire_rejected"] >= 600 and hostile["exit_code"] == 0


def test_drill_kill_job_scenario_passes(tmp_path, demo_model):
    job = run_drill(tmp_path, demo_model, "kill-job", "--kill-at", "5", "--checkpoint-every", "3")
    assert job["passed"] and 3 <= job["resumed_from_step"] and job["steps_lost"] <= 3
    # The launcher, the learner (one rank: the launcher's own child, no torchrun) and the actor.
    assert job["killed_processes"] >= 3 and job["each_step_once"] and job["prompts_consumed"] == 30 * 8


def test_drill_stall_actor_scenario_passes(tmp_path, demo_model):
    stall = run_drill(tmp_path, demo_model, "stall-actor", "--kill-at", "3")
    assert stall["passed"] and stall["registered_again"] and stall["exit_code"] == 0
