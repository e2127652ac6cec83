"""A held-out round far slower than sync.timeout_s (a reward that sleeps on the held-out
rows alone) never makes a weight sync wait, with the evaluator scoring the rounds:
every broadcast completes in its first epoch, every round's line arrives at its
version's step, stamped with that version's time; with the actors scoring the rounds,
the same run's broadcasts time out (what the evaluator is for)."""
import json
import subprocess
import sys

from conftest import ROOT, read_metrics, subprocess_env

SLOW_S = 1.0  # per held-out response: a round of 12 takes longer than sync.timeout_s=3 (which one 1 s wait could not)

REWARD = f'''
import time


def score(prompt, response, answer, slow=0, **_):
    if slow:
        time.sleep({SLOW_S})
    return float(response.strip() == answer)
'''


def arithmetic_rows(start: int, n: int, slow: int) -> str:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "slow": slow}
            for a, b in ((i % 10, (i * 7) % 10) for i in range(start, start + n))]
    return "".join(json.dumps(row) + "\n" for row in rows)


def run(tmp_path, demo_model, placement: str) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "slow_reward.py").write_text(REWARD)
    (tmp_path / "train.jsonl").write_text(arithmetic_rows(0, 64, slow=0))
    (tmp_path / "eval.jsonl").write_text(arithmetic_rows(100, 12, slow=1))
    run_dir = tmp_path / f"run-{placement}"
    proc = subprocess.run(
        [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
         f"model.path={demo_model}", "task.name=jsonl", f"task.train_path={tmp_path / 'train.jsonl'}",
         f"task.eval_path={tmp_path / 'eval.jsonl'}", "task.reward=slow_reward:score", "train.max_steps=8",
         "train.batch_groups=4", "train.group_size=4", "actors.groups_per_request=4", "eval.every=2",
         "eval.size=12", "eval.batch_size=12", f"eval.placement={placement}", "sync.timeout_s=3",
         "reward.timeout_s=10", "checkpoint.every=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=150, env=subprocess_env())
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    return proc, proc.stderr + logs


def test_a_slow_evaluation_never_makes_a_sync_wait(tmp_path, demo_model):
    proc, logs = run(tmp_path, demo_model, "evaluator")
    assert proc.returncode == 0, logs[-3000:]
    assert "weight broadcast" not in logs and "(epoch 2" not in logs, logs[-3000:]  # all in the first epoch
    steps, evals = read_metrics(tmp_path / "run-evaluator")
    assert [e["step"] for e in evals] == [0, 2, 4, 6, 8]
    made = {s["step"]: s["time"] for s in steps}
    for e in evals:
        assert e["eval/seconds"] > 3 and e["eval/prompts"] == 12
        assert e["version_time"] <= made.get(e["step"], e["version_time"]) < e["time"]


def test_the_same_slow_round_on_the_actors_makes_the_broadcast_time_out(tmp_path, demo_model):
    proc, logs = run(tmp_path, demo_model, "actors")
    assert "weight broadcast of version" in logs and "Timed out" in logs, logs[-3000:]
