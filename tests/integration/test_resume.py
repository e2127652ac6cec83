"""Lossless resume: the whole job is SIGKILLed mid-run and `--resume` continues from
the latest complete checkpoint, with every admitted prompt consumed exactly once."""
import json
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from conftest import ROOT, kill_tree, read_metrics, subprocess_env, train

from async_rl.learner.checkpoint import BUFFER_FILE, read_groups, write_groups
from async_rl.run.checkpoints import latest_checkpoint

SMALL = ["train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4", "task.eval_size=32",
         "eval.every=5", "max_staleness=2"]


def _command(run: Path, model: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
            f"model.path={model}", *SMALL, *overrides]


def _partition_holds(checkpoint: Path) -> None:
    """Every admitted slot is exactly one of: consumed, buffered, pending re-issue."""
    state = json.loads((checkpoint / "coordinator.json").read_text())["coordinator"]
    buffered = [index for index, _, _ in read_groups(checkpoint / BUFFER_FILE)]
    consumed = state["consumed"] + state["dropped"]
    ready = [i for i in buffered if i < state["buffer_next"]]
    assert state["buffer_next"] == consumed + len(ready)
    parts = list(range(consumed)) + buffered + state["pending"]
    assert sorted(parts) == list(range(state["admitted"])), "an admitted prompt is lost or held twice"


@pytest.mark.smoke
@pytest.mark.timeout(300)
def test_sigkilled_job_resumes_from_its_last_checkpoint(tmp_path, demo_model):
    run = tmp_path / "run"
    cmd = _command(run, demo_model, "train.max_steps=24", "checkpoint.every=3", "learner.ranks=2")
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while latest_checkpoint(run) is None or latest_checkpoint(run).name < "step_000006":
            assert proc.poll() is None and time.time() < deadline, "no second checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        kill_tree(proc)  # a machine failure: nothing gets to clean up
    killed_at = read_metrics(run)[0][-1]["step"]
    checkpoint = latest_checkpoint(run)
    ckpt_step = int(checkpoint.name.split("_")[1])
    assert 6 <= ckpt_step <= killed_at < 24 and killed_at - ckpt_step <= 3
    _partition_holds(checkpoint)
    # A half-written checkpoint, newer than every complete one, must never be loaded.
    (run / "checkpoints" / "step_999999.partial").mkdir()
    (run / "checkpoints" / "step_999999.partial" / "coordinator.json").write_text("{not json")

    # Resume on one learner rank: DCP reshards the two-rank checkpoint.
    resumed = subprocess.run(cmd + ["learner.ranks=1", "--resume", str(run)], capture_output=True, text=True,
                             timeout=180, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint.name}" in resumed.stderr
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 25)), "each step exactly once"
    # The resumed run evaluates its restored weights first. The actors score a round with
    # the first weights they hold at or after the request (up to max_staleness + 1 later;
    # a round of the killed run that landed after the checkpoint is not kept).
    requested = sorted({0, 5, 10, 15, 20, 24, ckpt_step})
    got = sorted(e["step"] for e in evals)
    assert got[0] == 0 and got[-1] == 24 and len(requested) - 1 <= len(got) <= len(requested)
    assert all(any(r <= g <= r + 3 for r in requested) for g in got)
    assert any(ckpt_step <= g <= ckpt_step + 3 for g in got)
    last = steps[-1]
    # Nothing lost or counted twice across the crash: consumption is FIFO by admission index.
    assert last["data/prompts_consumed"] == 24 * 8 and last["staleness/dropped"] == 0
    assert last["train/samples"] == 24 * 8 * 4
    assert all(s["staleness/max"] <= 2 for s in steps)
    times = [s["time"] for s in steps]
    assert times == sorted(times), "time continues from the checkpoint"
    # The resumed run's first step continues the schedule and the counters.
    first = steps[ckpt_step]
    assert first["data/prompts_admitted"] >= (ckpt_step + 1) * 8
    _partition_holds(latest_checkpoint(run))
    assert latest_checkpoint(run).name == "step_000024"
    assert len([p for p in (run / "checkpoints").iterdir() if not p.name.endswith(".partial")]) == 2  # keep=2
    assert (run / "final" / "config.json").exists()


def test_buffer_file_round_trips_groups_in_wire_format(tmp_path):
    from wire_samples import make_group

    groups = [(5, 2, make_group()), (7, 3, make_group())]
    write_groups(tmp_path / "b", groups)
    back = read_groups(tmp_path / "b")
    assert [(i, v) for i, v, _ in back] == [(5, 2), (7, 3)]
    import numpy as np

    assert np.array_equal(back[0][2].response_tokens, groups[0][2].response_tokens)
    # A tampered file fails loudly through the wire validator, it is not trusted.
    with open(tmp_path / "bad", "wb") as f:
        f.write(msgpack.packb([1, 0, [b"\x00garbage"]]))
    from async_rl.wire import WireError

    with pytest.raises(WireError):
        read_groups(tmp_path / "bad")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, demo_model):
    run = tmp_path_factory.mktemp("resume") / "run"
    train(run, demo_model, "train.max_steps=1", "learner.ranks=1", "eval.every=0")
    return run


@pytest.mark.parametrize("extra, key", [([], "--resume"), (["train.group_size=8"], "train.group_size"),
                                        (["run_dir=/tmp/elsewhere"], "run_dir")])
def test_bad_resume_exits_2_naming_the_problem(tmp_path, demo_model, finished_run, extra, key):
    """A refused resume changes nothing in the run directory."""
    run = finished_run if key != "--resume" else tmp_path / "empty"
    run.mkdir(exist_ok=True)
    before = sorted(p.name for p in run.iterdir())
    cmd = _command(run, demo_model, *extra, "--resume", str(run))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], proc.stderr
    assert sorted(p.name for p in run.iterdir()) == before
