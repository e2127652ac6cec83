"""Summarize run directories as one markdown table (e.g. asynchronous vs synchronous).

    python analysis/summarize.py RUN_DIR [RUN_DIR ...] [--target 0.9]

Columns: max_staleness, steps and wall time until held-out accuracy first reached
the target, first and last eval accuracy, mean samples/s, mean learner idle
fraction, staleness mean/max and drops. All figures come from metrics.jsonl and
config.yaml, so the table is reproducible from the run directories alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from async_rl.run.directory import run_dir_for_tool


def summarize(run_dir: Path, target: float) -> dict:
    run = run_dir_for_tool(run_dir)
    cfg = run.config()
    steps, evals = run.steps_and_evals()
    if not steps or not evals:
        raise SystemExit(f"{run_dir}: no training steps or evaluations in metrics.jsonl")
    hit = next((e for e in evals if e["eval/accuracy"] >= target), None)
    return {
        "run": run.name,
        "max_staleness": cfg["max_staleness"],
        "steps": steps[-1]["step"],
        "to_target": f"{hit['step']} steps / {hit.get('version_time', hit['time']):.0f} s" if hit else "not reached",
        "eval_first": evals[0]["eval/accuracy"],
        "eval_last": evals[-1]["eval/accuracy"],
        "samples_per_s": steps[-1]["train/samples"] / max(steps[-1]["time"] - steps[0]["time"], 1e-9),
        "idle": sum(s["learner/idle_frac"] for s in steps) / len(steps),
        "stale_mean": sum(s["staleness/mean"] for s in steps) / len(steps),
        "stale_max": max(s["staleness/max"] for s in steps),
        "dropped": steps[-1]["staleness/dropped"],
        "wall_s": steps[-1]["time"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--target", type=float, default=0.9, help="eval accuracy threshold")
    args = parser.parse_args(argv)
    rows = [summarize(r, args.target) for r in args.runs]
    print(f"| run | max_staleness | steps | to eval acc >= {args.target} | eval first -> last | samples/s "
          "| learner idle | staleness mean / max | dropped | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['max_staleness']} | {r['steps']} | {r['to_target']} | "
              f"{r['eval_first']:.3f} -> {r['eval_last']:.3f} | {r['samples_per_s']:.0f} | {r['idle']:.1%} | "
              f"{r['stale_mean']:.2f} / {r['stale_max']} | {r['dropped']} | {r['wall_s']:.0f} |")
    if len(rows) > 1:
        base = next((r for r in rows if r["max_staleness"] == 0), None)
        if base is not None:
            for r in rows:
                if r is not base:
                    print(f"\n{r['run']} vs {base['run']}: samples/s ratio "
                          f"{r['samples_per_s'] / base['samples_per_s']:.2f}x", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
