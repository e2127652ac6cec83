"""benchmarks/bench_peer.py (the async-rl side end to end, the TRL side where TRL is
installed) and benchmarks/verify_cost.py, run as scripts on the demo model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_metrics, subprocess_env

ROOT = Path(__file__).resolve().parents[2]

PEER = ROOT / "benchmarks/bench_peer.py"
PEER_SMALL = ["--set", "train.batch_groups=8", "--set", "train.group_size=4", "--set", "actors.groups_per_request=4",
              "--set", "task.eval_size=32", "--seeds", "0", "--target", "0.0"]  # 32 samples per step


def bench_peer(out: Path, model: Path, *args: str) -> dict:
    """Run the benchmark from `model` (the fixture's, instead of a warm start built per seed)."""
    proc = subprocess.run([sys.executable, str(PEER), "--out", str(out), "--model", str(model), *PEER_SMALL, *args],
                          capture_output=True, text=True, timeout=110, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]  # stdout: JSON lines only
    assert len(lines) == 1 and lines == [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return lines[0]


def check_peer_figures(r: dict, steps: int) -> None:
    assert r["reached"] and r["steps_to_target"] == steps and r["steps_run"] >= steps
    # time_to_target_s is rounded to 10 ms, which matters for TRL's tiny step on this model
    assert r["samples_per_s"] == pytest.approx(steps * 32 / r["time_to_target_s"],
                                               rel=0.05 + 0.005 / r["time_to_target_s"])
    assert r["cpu_s"] > 1 and r["cpu_s_per_sample"] == pytest.approx(r["cpu_s"] / (r["steps_run"] * 32), abs=0.01)
    assert r["first_step_s"] <= r["time_to_target_s"]


@pytest.mark.extended
def test_bench_peer_async_rl(tmp_path, demo_model):
    line = bench_peer(tmp_path, demo_model, "--systems", "async-rl", "--max-steps", "4", "--eval-every", "2")
    assert line["seed"] == 0 and line["trl"] is None and line["ratio_trl_over_async_rl"] is None
    r = line["async_rl"]
    check_peer_figures(r, steps=2)  # step 0's evaluation never counts as reaching the target
    _, evals = read_metrics(Path(r["run_dir"]))
    hit = next(e for e in evals if e["step"] >= 1)  # scored by the evaluator: the version's time counts
    assert r["time_to_target_s"] == pytest.approx(hit["version_time"], abs=0.01) and hit["version_time"] < hit["time"]
    assert r["eval_first"] == evals[0]["eval/accuracy"] and evals[0]["step"] == 0
    for name in ("own", "float32"):  # the demo's actors run float32: both protocols score the same
        protocol = r["protocols"][name]
        assert protocol["step"] == 2 and protocol["with_eval_s"] == protocol["without_eval_s"] == r["time_to_target_s"]
    assert hit["eval/accuracy"] == hit["eval/accuracy@float32"]


def test_bench_peer_trl_through_a_chat_template(tmp_path, chat_model):
    """The SmolLM2 race's setup on a tiny chat model: TRL gets conversations, and its
    prompt tokens must be the ones async-rl's actors use (peer_trl.py stops otherwise)."""
    pytest.importorskip("trl")
    proc = subprocess.run([sys.executable, str(PEER), "--config", str(ROOT / "configs/smollm2.yaml"), "--out",
                           str(tmp_path), "--model", str(chat_model), "--systems", "trl", "--max-steps", "1",
                           "--eval-every", "1", "--target", "0.0", "--set", "train.batch_groups=2",
                           "--set", "train.group_size=2", "--set", "task.eval_size=4", "--set", "eval.size=4",
                           "--set", "eval.batch_size=4"],
                          capture_output=True, text=True, timeout=110, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout)
    assert line["config"].endswith("smollm2.yaml") and line["trl"]["steps_to_target"] == 1


def test_bench_peer_trl(tmp_path, demo_model):
    pytest.importorskip("trl")
    line = bench_peer(tmp_path, demo_model, "--systems", "trl", "--max-steps", "2", "--eval-every", "1")
    assert line["async_rl"] is None and line["ratio_trl_over_async_rl"] is None
    r = line["trl"]
    check_peer_figures(r, steps=1)  # stopped at the first evaluation after step 0
    assert r["steps_run"] == 1 and r["eval_s_subtracted"] > 0
    own = r["protocols"]["own"]
    assert own["with_eval_s"] == r["time_to_target_s"] and own["without_eval_s"] <= own["with_eval_s"]
    assert r["protocols"]["float32"]["step"] == 1


def test_verify_cost_runs_the_demo_both_ways(tmp_path, demo_model):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/verify_cost.py"), "--config",
                           str(ROOT / "configs/demo.yaml"), "--runs", "1", "--steps", "4", "--out", str(tmp_path),
                           f"model.path={demo_model}", "checkpoint.every=0"],
                          capture_output=True, text=True, timeout=120, env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [line.get("verify") for line in lines[:2]] == [True, False] and lines[2]["kind"] == "summary"
    for line in lines[:2]:
        assert line["actor_syncs"] >= 3 and line["actor_sync_median_ms"] > 0 and line["steps_per_s"] > 0
    assert lines[2]["runs_each"] == 1
