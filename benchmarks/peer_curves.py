"""Per-step learning of the two systems of a bench_peer.py race, side by side.

    python benchmarks/peer_curves.py OUT [--window 5]

OUT is a bench_peer.py output directory (OUT/seedS/{async-rl,trl}/metrics.jsonl). For
each seed and window of steps, one row per system: the mean training reward of the
samples it trained on, their mean length and the fraction cut at the token limit, the
mean gradient norm before clipping, and the held-out evaluations in the window. Both
systems log the same quantities under their own names (TRL's `reward`,
`completions/mean_length`, `completions/clipped_ratio`, `grad_norm`); this maps them.
Where the training reward rises alike, the systems learn alike per step, and a
difference in steps to a held-out target is the evaluations' spread, not the algorithm.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

KEYS = {  # quantity: (async-rl's metric, TRL's)
    "reward": ("train/reward_mean", "reward"),
    "length": ("train/response_len_mean", "completions/mean_length"),
    "truncated": ("train/truncated_frac", "completions/clipped_ratio"),
    "grad_norm": ("learner/grad_norm", "grad_norm"),
}
SYSTEMS = ("async-rl", "trl")


def read_run(path: Path, system: str) -> tuple[dict[int, dict], dict[int, float]]:
    """(per-step quantities, held-out accuracy by step) of one run's metrics.jsonl."""
    column = SYSTEMS.index(system)
    steps, evals = {}, {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "eval/accuracy" in row:
            evals[int(row["step"])] = row["eval/accuracy"]
            continue
        values = {q: row[names[column]] for q, names in KEYS.items() if names[column] in row}
        if "step" in row and "reward" in values:
            steps[int(row["step"])] = values
    return steps, evals


def table(out: Path, window: int) -> list[str]:
    lines = ["| seed | steps | system | train reward | response tokens | truncated | grad norm | held-out |",
             "|---|---|---|---|---|---|---|---|"]
    for seed_dir in sorted(out.glob("seed*")):
        runs = {s: read_run(seed_dir / s / "metrics.jsonl", s) for s in SYSTEMS
                if (seed_dir / s / "metrics.jsonl").exists()}
        last = max((max(steps, default=0) for steps, _ in runs.values()), default=0)
        for start in range(1, last + 1, window):
            span = range(start, start + window)
            for system, (steps, evals) in runs.items():
                rows = [steps[k] for k in span if k in steps]
                if not rows:
                    continue
                mean = {q: statistics.fmean(r[q] for r in rows if q in r) for q in KEYS if any(q in r for r in rows)}
                held = ", ".join(f"{evals[k]:.3f} at {k}" for k in span if k in evals)
                lines.append(f"| {seed_dir.name[4:]} | {start}–{start + window - 1} | {system} | "
                             f"{mean.get('reward', float('nan')):.3f} | {mean.get('length', float('nan')):.1f} | "
                             f"{mean.get('truncated', float('nan')):.2f} | {mean.get('grad_norm', float('nan')):.2f} | "
                             f"{held} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a bench_peer.py output directory")
    parser.add_argument("--window", type=int, default=5, help="steps per row")
    args = parser.parse_args(argv)
    if not any(args.out.glob("seed*/*/metrics.jsonl")):
        print(f"peer_curves: no OUT/seedS/SYSTEM/metrics.jsonl under {args.out}", file=sys.stderr)
        return 2
    print("\n".join(table(args.out, args.window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
