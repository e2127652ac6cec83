"""A disk that fills under one of the run's writers (TensorBoard, samples, the trace)
ends the run in one line naming the writer, with status.json and the error log written
in the room set aside at the start; no traceback on the console."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT, subprocess_env

DEV_FULL = "/dev/full"


def fill(run, writer, full_disk):
    """Put the writer's file (or folder) on a full disk before the run starts."""
    if writer == "TensorBoard events in":
        (run / "tb").symlink_to(full_disk, target_is_directory=True)
        return run / "tb"
    name = {"samples": "samples.jsonl", "the trace": "trace.json"}[writer]
    (run / (name + ".tmp" if writer == "the trace" else name)).symlink_to(DEV_FULL)  # the trace is renamed in
    return run / name


@pytest.mark.parametrize("writer", ["TensorBoard events in", "samples", "the trace"])
def test_a_full_disk_under_any_writer_is_one_line_and_a_status(tmp_path, demo_model, writer, request):
    full_disk = request.getfixturevalue("full_disk") if writer.startswith("TensorBoard") else None
    run = tmp_path / "run"
    run.mkdir()
    where = fill(run, writer, full_disk)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=3", "metrics.samples_every=1",
           "checkpoint.every=2"]  # a checkpoint writes the trace
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=subprocess_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = f"learner rank 0: the disk is full: {writer} {where} could not be written ("
    failed = [line for line in proc.stderr.splitlines() if "the learner failed" in line]
    assert len(failed) == 1 and said in failed[0] and f"--resume {run}" in failed[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Errno" not in failed[0]
    status = json.loads((run / "status.json").read_text())
    assert status["exit_code"] == 1 and status["reason"].startswith(said)
    assert said in (run / "logs" / "learner-rank0.err").read_text()
