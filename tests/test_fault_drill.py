"""analysis/fault_drill.py on a tiny real run: its hostile-traffic fuzzer and its
kill-the-whole-job-then-resume orchestration (the kill-actor path is the same as
tests/test_elastic_actors.py). The full-size drill, with its accuracy target, is in the README."""
import json
import subprocess
import sys

from conftest import ROOT, subprocess_env

TINY = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
        "eval.every=10", "train.max_steps=30", "learner.ranks=1"]


def test_drill_hostile_and_kill_job_scenarios_pass(tmp_path, demo_model):
    cmd = [sys.executable, str(ROOT / "analysis/fault_drill.py"), "--scenarios", "hostile", "kill-job",
           "--out", str(tmp_path), "--model", str(demo_model), "--target", "0", "--kill-at", "5",
           "--checkpoint-every", "3", "--messages", "600", "--timeout", "90", "--set", *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=subprocess_env())
    results = {r["scenario"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-2000:])
    hostile, job = results["hostile"], results["kill-job"]
    assert hostile["passed"] and hostile["wire_rejected"] >= 600 and hostile["exit_code"] == 0
    assert job["passed"] and 3 <= job["resumed_from_step"] and job["steps_lost"] <= 3
    assert job["killed_processes"] >= 4 and job["each_step_once"] and job["prompts_consumed"] == 30 * 8
