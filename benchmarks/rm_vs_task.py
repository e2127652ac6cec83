"""RL from a learned reward model against RL on the task's verifiable reward: the same
config, seeds and steps, the reward model the only trained reward (placement: server)
with the task's reward watched at weight 0.

    python benchmarks/rm_vs_task.py RM_DIR [--config configs/smollm2.yaml] [--seeds 0 1] [--steps 30]
        [--out runs/rm-vs-task]

Per seed, the two runs back to back (their order alternating). Prints one JSON line per
run (held-out accuracy at each evaluation; per window of --window steps the reward
model's mean and the watched verifiable reward's mean; the hacking line when the
learner wrote one), then one of the medians over seeds of held-out accuracy per step,
per arm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, config: str, seed: int, steps: int, rm: Path | None) -> dict:
    arm = "rm" if rm else "task"
    run_dir = out / f"{arm}-seed{seed}"
    reward = ([f"reward.components=[{{name: rm, reward: reward_model, model: {rm}, placement: server}}, "
               "{name: exact, reward: task, weight: 0}]"] if rm else [])
    done = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / config), f"run_dir={run_dir}",
                           f"seed={seed}", f"train.max_steps={steps}", *reward],
                          capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise SystemExit(f"{run_dir} failed: {done.stderr[-2000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hacking = next((x for x in done.stderr.splitlines() if "reward hacking" in x), None)
    return {"arm": arm, "seed": seed, "run_dir": str(run_dir),
            "eval_accuracy": {s["step"]: s["eval/accuracy"] for s in lines if "eval/accuracy" in s},
            "steps": [s for s in lines if "train/samples" in s], "hacking_line": hacking}


def windows(steps: list[dict], key: str, size: int) -> list[float]:
    values = [s[key] for s in steps if key in s]
    return [round(statistics.fmean(values[k:k + size]), 4) for k in range(0, len(values), size)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rm", type=Path)
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "rm-vs-task")
    args = parser.parse_args()
    results = []
    for k, seed in enumerate(args.seeds):
        for rm in ((args.rm.resolve(), None) if k % 2 == 0 else (None, args.rm.resolve())):
            r = run(args.out, args.config, seed, args.steps, rm)
            row = {key: r[key] for key in ("arm", "seed", "eval_accuracy", "hacking_line")}
            if r["arm"] == "rm":
                row["rm_mean_by_window"] = windows(r["steps"], "reward/rm/mean", args.window)
                row["watched_task_by_window"] = windows(r["steps"], "reward/exact/mean", args.window)
            else:
                row["task_mean_by_window"] = windows(r["steps"], "train/reward_mean", args.window)
            print(json.dumps(row), flush=True)
            results.append(row)
    for arm in ("task", "rm"):
        by_step: dict[int, list[float]] = {}
        for row in results:
            if row["arm"] == arm:
                for step, accuracy in row["eval_accuracy"].items():
                    by_step.setdefault(int(step), []).append(accuracy)
        print(json.dumps({"arm": arm, "median_eval_accuracy": {s: statistics.median(v)
                                                               for s, v in sorted(by_step.items())}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
