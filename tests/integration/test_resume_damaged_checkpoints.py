"""`--resume` with damaged checkpoints, on real runs: it falls back past a damaged
checkpoint to the newest intact one, or refuses in one line when none is intact; a full
disk in the learner is one line and leaves the checkpoints intact."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, flip_one_bit, read_metrics, subprocess_env, train, truncate_half

from async_rl.learner.checkpoint import BUFFER_FILE, STATE_FILE, read_groups
from async_rl.run.checkpoints import (
    MANIFEST,
    check_partition,
    complete_checkpoints,
    latest_checkpoint,
    latest_intact_checkpoint,
    verify_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SMALL = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
         "max_staleness=2", "eval.every=0", "learner.ranks=1", "checkpoint.every=2", "checkpoint.keep=3"]


def _command(run: Path, model: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
            f"model.path={model}", *SMALL, *overrides]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, demo_model):
    """A 4-step run with checkpoints at steps 2 and 4; each test damages a copy of it."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    train(run, demo_model, *SMALL, "train.max_steps=4")
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_000002", "step_000004"]
    return run


@pytest.mark.timeout(60)
def test_resume_refuses_in_one_line_when_every_checkpoint_is_damaged(tmp_path, demo_model, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / "step_000004" / ".metadata").unlink()
    flip_one_bit(run / "checkpoints" / "step_000002" / STATE_FILE)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = subprocess.run(_command(run, demo_model, "train.max_steps=6", "--resume", str(run)),
                          capture_output=True, text=True, timeout=50, env=subprocess_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[-1].startswith("async-rl: config error: --resume: no intact checkpoint in "), \
        proc.stderr
    assert "(step_000004: missing file .metadata; step_000002: coordinator.json: checksum mismatch)" in lines[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.timeout(120)
def test_resume_falls_back_past_a_truncated_buffer(tmp_path, demo_model, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    newest = run / "checkpoints" / "step_000004"
    buffer = newest / BUFFER_FILE
    if buffer.stat().st_size:
        truncate_half(buffer)
    else:  # nothing buffered at the end of that run: damage it all the same
        buffer.write_bytes(b"\x90")
    evidence = buffer.read_bytes()
    resumed = subprocess.run(_command(run, demo_model, "train.max_steps=6", "--resume", str(run)),
                             capture_output=True, text=True, timeout=110, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warned = [line for line in resumed.stderr.splitlines() if "is damaged" in line]
    assert len(warned) == 1 and "checkpoint step_000004 is damaged (buffer.msgpack" in warned[0], resumed.stderr
    assert "resuming from step_000002" in resumed.stderr
    assert (run / "checkpoints" / "step_000004.damaged" / BUFFER_FILE).read_bytes() == evidence
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 7)), "each step exactly once"
    assert steps[-1]["data/prompts_consumed"] == 6 * 8 and steps[-1]["staleness/dropped"] == 0
    # Rotation (keep=3) counted the new checkpoints only; the evidence stays.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000002", "step_000004", "step_000004.damaged", "step_000006"]
    for ckpt in complete_checkpoints(run / "checkpoints"):
        assert verify_checkpoint(ckpt) is None
    latest = latest_checkpoint(run)
    check_partition(json.loads((latest / STATE_FILE).read_text())["coordinator"],
                    [i for i, _, _ in read_groups(latest / BUFFER_FILE)])


@pytest.mark.timeout(90)
def test_a_full_disk_in_the_learner_is_one_line_and_keeps_the_checkpoints(tmp_path, demo_model, finished_run):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = {p.name: (p / MANIFEST).read_bytes() for p in complete_checkpoints(run / "checkpoints")}
    # The resumed learner rewrites metrics.jsonl through this file: the kernel answers ENOSPC.
    (run / "metrics.jsonl.tmp").symlink_to("/dev/full")
    proc = subprocess.run(_command(run, demo_model, "train.max_steps=6", "--resume", str(run)),
                          capture_output=True, text=True, timeout=80, env=subprocess_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    failed = [line for line in proc.stderr.splitlines() if "fail" in line]
    assert len(failed) == 1 and "No space left on device" in failed[0] and f"--resume {run}" in failed[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "No space left on device" in (run / "logs" / "learner-rank0.err").read_text()
    assert {p.name: (p / MANIFEST).read_bytes() for p in complete_checkpoints(run / "checkpoints")} == before
    assert latest_intact_checkpoint(run)[0].name == "step_000004"
