"""Check the simulator against a run whose actor and learner have a core each.

    python benchmarks/pinned_check.py [--model DIR] [--steps 300] [--staleness 1] [--out runs/pinned]
                                    [--learner-core 1] [--actor-core 0]

1. Runs the demo synchronously (max_staleness=0) with the learner world pinned to one
   core and the actor to the other (sched_setaffinity on every thread of each), so
   generation and training have their own hardware and never overlap.
2. Calibrates the simulator (benchmarks/simulate.py) from that run: the learner's step,
   the actor's generation per group, sync and overheads, each measured alone.
3. Predicts samples/s at --staleness from those rates, runs the same pinned demo at
   that bound, and prints one JSON line: predicted and measured samples/s of both runs,
   the predicted and measured speedup of asynchrony, and the prediction's error.
4. Prints a table of predicted speedups (async over sync, samples/s) for GPU-like rate
   ratios: generation of a batch 2-5x slower than training it, 1-8 actors, with the
   calibrated sync and overhead times scaled alike. These are predictions, not measurements.

Needs a machine with at least two cores; the rest of the machine should be quiet.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline_model import simulate, stationary, with_actors  # noqa: E402
from simulate import measure_run  # noqa: E402

CONFIG = ROOT / "configs/demo.yaml"


def _pin_tree(root_pid: int, learner_core: int, actor_core: int, stop: threading.Event) -> None:
    """Keep every thread of the actor on its core and everything else of the run on the
    learner's, including threads started later (gloo, ZeroMQ, torch)."""
    from async_rl.run.processes import process_tree

    while not stop.is_set():
        for pid in process_tree(root_pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                core = actor_core if b"actor" in cmdline.split(b"\0")[3:5] else learner_core
                for tid in os.listdir(f"/proc/{pid}/task"):
                    if os.sched_getaffinity(int(tid)) != {core}:
                        os.sched_setaffinity(int(tid), {core})
            except (OSError, IndexError):
                pass  # a process or thread that just ended
        stop.wait(0.2)


def pinned_run(out: Path, model: Path, staleness: int, steps: int, learner_core: int, actor_core: int) -> Path:
    run = out / f"staleness{staleness}"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(CONFIG), f"run_dir={run}", f"model.path={model}",
           f"max_staleness={staleness}", f"train.max_steps={steps}", "eval.every=0", "checkpoint.every=0"]
    print(f"[pinned] max_staleness={staleness}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    with open(out / f"staleness{staleness}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: os.sched_setaffinity(0, {learner_core}))
        stop = threading.Event()
        pinner = threading.Thread(target=_pin_tree, args=(proc.pid, learner_core, actor_core, stop), daemon=True)
        pinner.start()
        code = proc.wait()
        stop.set()
        pinner.join()
    if code != 0:
        raise SystemExit(f"the run at max_staleness={staleness} failed (exit {code}); see {run}/logs")
    return run


def speedup_table(p, staleness: int, steps: int = 300, seeds: int = 3) -> str:
    """Predicted samples/s of async (max_staleness) over sync, actors on their own
    devices, each the mean of `seeds` simulations of `steps` steps."""
    ratios, actor_counts = (2, 3, 4, 5), (1, 2, 4, 8)
    lines = ["| generation / training per batch | " + " | ".join(f"{n} actor{'s' * (n > 1)}" for n in actor_counts)
             + " |", "|---|" + "---|" * len(actor_counts)]
    per_batch = p.batch_groups * (p.gen_seconds_per_group[0] + p.overhead_seconds_per_group)
    for r in ratios:
        scale = r * p.step_seconds / per_batch  # generation (and its overhead) scaled to r x the step
        q = replace(p, gen_seconds_per_group=[g * scale for g in p.gen_seconds_per_group],
                    overhead_seconds_per_group=p.overhead_seconds_per_group * scale, steps=steps)
        cells = []
        for n in actor_counts:
            sync = simulate(replace(with_actors(q, n), max_staleness=0, sync_every=1), seeds=seeds)["samples_per_s"]
            fast = simulate(replace(with_actors(q, n), max_staleness=staleness), seeds=seeds)["samples_per_s"]
            cells.append(f"{fast / sync:.2f}x")
        lines.append(f"| {r}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a demo base model directory (default: built into OUT/base_model)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--staleness", type=int, default=1, help="the asynchronous run's max_staleness")
    ap.add_argument("--out", type=Path, default=Path("runs/pinned"))
    ap.add_argument("--learner-core", type=int, default=1)
    ap.add_argument("--actor-core", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from async_rl.config import load_config
        from async_rl.run.demo_model import ensure_demo_model

        model = ensure_demo_model(load_config(CONFIG), args.out / "base_model")
    runs = {}
    for eta in (0, args.staleness):
        run = args.out / f"staleness{eta}"
        if run.exists():
            import shutil

            shutil.rmtree(run)
        runs[eta] = pinned_run(args.out, model.resolve(), eta, args.steps, args.learner_core, args.actor_core)
    calibrated, sync_measured = measure_run(runs[0])
    p = stationary(calibrated)
    predicted_sync = simulate(p)["samples_per_s"]
    predicted = simulate(replace(p, max_staleness=args.staleness))["samples_per_s"]
    measured = measure_run(runs[args.staleness])[1]["samples_per_s"]
    print(json.dumps({
        "staleness": args.staleness, "steps": args.steps,
        "sync_measured_samples_per_s": round(sync_measured["samples_per_s"], 1),
        "sync_predicted_samples_per_s": round(predicted_sync, 1),
        "async_predicted_samples_per_s": round(predicted, 1), "async_measured_samples_per_s": round(measured, 1),
        "predicted_speedup": round(predicted / sync_measured["samples_per_s"], 3),
        "measured_speedup": round(measured / sync_measured["samples_per_s"], 3),
        "prediction_error": round(predicted / measured - 1, 4),
        "rates": {"step_s": round(p.step_seconds, 5), "gen_s_per_group": round(p.gen_seconds_per_group[0], 6),
                  "overhead_s_per_group": round(p.overhead_seconds_per_group, 6), "sync_s": round(p.sync_seconds, 5)},
    }))
    print(f"\nPredicted speedup of max_staleness={args.staleness} over synchronous training (samples/s), "
          f"each actor on its own device, rates from {runs[0]} with generation scaled:\n")
    print(speedup_table(p, args.staleness))
    return 0


if __name__ == "__main__":
    sys.exit(main())
