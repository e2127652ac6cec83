"""What checking every weight version costs a real run: one config (the demo by
default) trained several times with `sync.verify` on and off, interleaved, and the
runs' weight syncs and step rates compared.

    python benchmarks/verify_cost.py [--config configs/demo.yaml] [--runs 3] [--steps 300]
                                   [--out runs/verify-cost] [overrides ...]

Each run's trace gives the actors' `sync` spans (from the hub's order to the weights in
use: the receive, the check, the copy into the model) and the learner's; its steps/s
are counted from the end of the first train-step to the end of the last. Prints one
JSON line per run, then a summary: the check's share of an actor's sync (1 - off/on,
from the medians over the runs of each run's median span) and the on/off ratio of
steps/s. benchmarks/bench_sync.py measures the same check on one isolated sync of a
synthetic model of any size; this script measures it where it runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from async_rl.run.directory import read_trace


def run_once(config: str, steps: int, verify: bool, run_dir: Path, overrides: list[str]) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-c", "from async_rl.cli import main; raise SystemExit(main())", "train", config,
               f"train.max_steps={steps}", f"run_dir={run_dir}", f"sync.verify={str(verify).lower()}",
               f"eval.every={10 * steps}", *overrides]
    log = run_dir.with_suffix(".out")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"verify_cost: the run with sync.verify={verify} exited {code}: see {log}")
    spans = read_trace(run_dir / "trace.json") or []
    actor_syncs = [s.dur_s for s in spans if s.track.startswith("actor") and s.name == "sync"]
    learner_syncs = [s.dur_s for s in spans if s.track == "learner" and s.name == "sync"]
    steps_ends = sorted(s.start_s + s.dur_s for s in spans if s.track == "learner" and s.name == "train-step")
    if not actor_syncs or len(steps_ends) < 2:
        raise SystemExit(f"verify_cost: {run_dir}/trace.json has no actor syncs or too few steps")
    return {"verify": verify, "run_dir": str(run_dir), "actor_syncs": len(actor_syncs),
            "actor_sync_median_ms": round(1e3 * statistics.median(actor_syncs), 4),
            "learner_sync_median_ms": round(1e3 * statistics.median(learner_syncs), 4) if learner_syncs else None,
            "steps_per_s": round((len(steps_ends) - 1) / (steps_ends[-1] - steps_ends[0]), 3)}


def summarize(lines: list[dict]) -> dict:
    def median_of(key: str, verify: bool) -> float:
        return statistics.median(line[key] for line in lines if line["verify"] is verify)

    def spread(key: str, verify: bool) -> list[float]:
        values = [line[key] for line in lines if line["verify"] is verify]
        return [min(values), max(values)]

    on, off = median_of("actor_sync_median_ms", True), median_of("actor_sync_median_ms", False)
    return {"kind": "summary", "runs_each": sum(line["verify"] for line in lines),
            "actor_sync_ms_verified": on, "actor_sync_ms_unverified": off,
            "actor_sync_ms_verified_range": spread("actor_sync_median_ms", True),
            "actor_sync_ms_unverified_range": spread("actor_sync_median_ms", False),
            "verify_share_of_actor_sync": round(1 - off / on, 4),
            "steps_per_s_on_over_off": round(median_of("steps_per_s", True) / median_of("steps_per_s", False), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--runs", type=int, default=3, help="runs with the check and as many without, interleaved")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/verify-cost")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = ap.parse_args(argv)
    lines = []
    for i in range(args.runs):
        for verify in ((True, False) if i % 2 == 0 else (False, True)):
            line = run_once(args.config, args.steps, verify, Path(args.out) / f"{'on' if verify else 'off'}{i}",
                            args.overrides)
            print(json.dumps(line), flush=True)
            lines.append(line)
    print(json.dumps(summarize(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
