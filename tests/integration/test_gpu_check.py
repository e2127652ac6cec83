"""benchmarks/gpu_check.py --dry-run: every section of the GPU check runs on the CPU at toy
sizes and the report is whole (its figures mean nothing here; on a GPU machine the
same command without --dry-run is the check docs/scale.md describes)."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

SECTIONS = {"ceilings", "tests", "ipc_sync", "learner", "async_run"}


@pytest.mark.extended
def test_dry_run_checks_its_own_plumbing(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--jobs", "3", "--out",
                           str(tmp_path)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + (tmp_path / "gpu_check.log").read_text()[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert report["dry_run"] and set(sections) == SECTIONS
    assert all(s["status"] == "ok" for s in sections.values()), sections
    tests = sections["tests"]
    assert tests["failed"] == 0 and tests["passed"] == 0 and tests["skipped"] >= 5  # every CUDA test, skipped here
    assert sections["ipc_sync"]["transport"] == "gloo" and sections["ipc_sync"]["sync_s"] > 0
    assert {line["variant"] for line in sections["learner"]["learner"]} == {"packed", "shared"}
    assert sections["learner"]["generate"]["tokens_per_s"] > 0
    run = sections["async_run"]
    assert run["steps"] == 6 and run["transports"] == ["gloo"] and run["staleness_max"] <= 1
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| ok |") == 7 and "dry run" in table


def test_refuses_to_run_for_real_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr
