"""Cost as the work grows: samples/s and peak memory per process over a grid of short
real runs, with the simulator's prediction beside each measured cell.

    python benchmarks/cost_grid.py configs/smollm2.yaml [--out runs/cost-grid] [--steps 6]
                                 [--cells base actors=2 ...] [--report-only] [--set key=value ...]

One axis at a time moves away from the config (the `base` cell):

    actors=N   actors.count=N, each actor with max(1, actor cores / N) threads: the
               config's actor threads (and the learner's) stay what they were
    tokens=T   actors.max_new_tokens=T
    batch=B    train.batch_groups=B prompt groups per step

Each cell is `async-rl train CONFIG run_dir=OUT/<cell>` for --steps steps, with a small
held-out set (the rounds at step 0 and at the end stay) and no checkpoint; a directory
that holds a finished run is reused. Figures come from each run directory:

- samples/s and the learner's idle share over the simulator's window (benchmarks/simulate.py
  --calibrate: the steps after the first quarter), peak resident memory per learner rank
  and per actor (the largest, memory/*_peak_rss_gb);
- the role that bounds the cell: the learner when it waits for data under 10% of its
  time, the actors otherwise;
- predicted samples/s: the base run's rates (simulate.measure_run), changed only as the
  cell changes the work, then simulated. More actors: the CPU times scaled as the
  processes outnumber --cores (pipeline_model.with_actors). Longer responses: the
  seconds per generated group scaled by the cell's measured mean response length over
  the base's, the training step by its tokens (prompt + group_size x response) over the
  base's. More groups per step: the step scaled by the group count. The response length
  is the one input taken from the cell itself: how long the policy answers is not a rate
  the base run can know.

The table goes to OUT/cost_grid.md (and is printed); --report-only rebuilds it without
running anything.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from pipeline_model import simulate, stationary, with_actors
from simulate import calibrate, measure_run

from async_rl.config import load_config
from async_rl.run.directory import RunDir

DEFAULT_CELLS = ["base", "actors=2", "actors=4", "tokens=64", "tokens=128", "batch=4", "batch=16"]
SHORT_RUN = ["eval.every=0", "eval.size=8", "eval.batch_size=8", "checkpoint.every=0"]
LEARNER_BOUND_IDLE = 0.10


def cell_overrides(cell: str, cfg) -> list[str]:
    """The config changes of one cell (see the module docstring)."""
    if cell == "base":
        return []
    axis, _, value = cell.partition("=")
    n = int(value)
    if axis == "actors":
        actor_cores = cfg.actors.count * cfg.actors.threads
        return [f"actors.count={n}", f"actors.threads={max(1, actor_cores // n)}"]
    if axis == "tokens":
        return [f"actors.max_new_tokens={n}"]
    if axis == "batch":
        return [f"train.batch_groups={n}"]
    raise SystemExit(f"cost_grid: unknown cell {cell!r} (base, actors=N, tokens=N or batch=N)")


def run_cell(config: Path, run_dir: Path, overrides: list[str], steps: int, timeout_s: float) -> None:
    status = RunDir(run_dir).status()
    if status and status["exit_code"] == 0 and (run_dir / "final").is_dir():
        print(f"{run_dir.name}: already finished, reused", flush=True)
        return
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(config), f"run_dir={run_dir}",
           f"train.max_steps={steps}", *SHORT_RUN, *overrides]
    print(f"{run_dir.name}: {' '.join(overrides) or '(the config)'}", flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"cost_grid: {run_dir.name} failed (exit {proc.returncode}); see {log.name}")


def mean_response(run_dir: Path) -> float:
    steps, _ = RunDir(run_dir).steps_and_evals()
    return statistics.mean(s["train/response_len_mean"] for s in steps)


def peak_gib(run_dir: Path, key: str) -> float:
    steps, _ = RunDir(run_dir).steps_and_evals()
    return max(s.get(key, 0.0) for s in steps)


def predict(base_dir: Path, cell: str, cell_dir: Path, prompt_tokens: float, cores: float) -> float:
    """Samples/s the simulator predicts for `cell` from the base run's rates."""
    p, _ = measure_run(base_dir)
    p = stationary(p)
    axis, _, value = cell.partition("=")
    if axis == "actors":
        p = with_actors(p, int(value), cores)
    elif axis == "tokens":
        base_len, cell_len = mean_response(base_dir), mean_response(cell_dir)
        g = p.group_size
        p = replace(p, gen_seconds_per_group=[s * cell_len / base_len for s in p.gen_seconds_per_group],
                    step_seconds=p.step_seconds * (prompt_tokens + g * cell_len) / (prompt_tokens + g * base_len))
    elif axis == "batch":
        p = replace(p, step_seconds=p.step_seconds * int(value) / p.batch_groups, batch_groups=int(value))
    return simulate(p, seeds=3)["samples_per_s"]


def mean_prompt_tokens(cfg, n: int = 64) -> float:
    from async_rl.tasks import task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for

    task, fmt = task_from_config(cfg.task, cfg.seed), prompt_format_for(cfg.model.path, cfg.task)
    return statistics.mean(len(fmt.encode(task.train_prompt(i))) for i in range(n))


def report(out: Path, cells: list[str], cfg, cores: float) -> str:
    base_dir = out / "base"
    prompt_tokens = mean_prompt_tokens(cfg)
    rows = ["| cell | samples/s | predicted | learner idle | bound by | response tokens | learner GiB | actor GiB |",
            "|---|---|---|---|---|---|---|---|"]
    for cell in cells:
        run_dir = out / cell
        if not (run_dir / "final").is_dir():
            rows.append(f"| {cell} | not run | | | | | | |")
            continue
        measured = calibrate(run_dir, seeds=3)
        idle = measured["measured_idle_frac"]
        predicted = predict(base_dir, cell, run_dir, prompt_tokens, cores) if (base_dir / "final").is_dir() else None
        rows.append(f"| {cell} | {measured['measured_samples_per_s']:.2f} | "
                    f"{'—' if predicted is None else f'{predicted:.2f}'} | {idle:.0%} | "
                    f"{'learner' if idle < LEARNER_BOUND_IDLE else 'actors'} | {mean_response(run_dir):.1f} | "
                    f"{peak_gib(run_dir, 'memory/learner_peak_rss_gb'):.2f} | "
                    f"{peak_gib(run_dir, 'memory/actor_peak_rss_gb'):.2f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/cost-grid"))
    ap.add_argument("--steps", type=int, default=6, help="training steps per cell")
    ap.add_argument("--cells", nargs="+", default=DEFAULT_CELLS)
    ap.add_argument("--cores", type=float, default=2.0, help="CPU cores the processes share (for the prediction)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per cell")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for every cell")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    cells = ["base", *[c for c in args.cells if c != "base"]]  # every prediction starts from the base
    if not args.report_only:
        for cell in cells:
            run_cell(args.config, args.out / cell, [*args.set, *cell_overrides(cell, cfg)], args.steps, args.timeout)
    table = report(args.out, cells, cfg, args.cores)
    (args.out / "cost_grid.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
