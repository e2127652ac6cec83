"""What a run's final/ scores in each precision, and why: arms x seeds of short real runs.

    python benchmarks/precision_experiment.py CONFIG --start MODEL [--arms base ...]
        [--arm NAME:KEY=VALUE,...] [--seeds 0] [--steps 7] [--out runs/precision] [--set key=value ...]
        [--dtypes bfloat16 float32] [--report-only]

Each arm is `async-rl train CONFIG model.path=START train.max_steps=STEPS` with its
overrides (ARMS below), one factor moved from the config's own settings: the actors'
dtype, the learner's precision, the attention kernel, the correction, the learning
rate and Adam's epsilon, the number of steps, and the start model itself (`start=bf16`:
the start rounded to bfloat16 and written so, as a model published in bf16 is;
`start=dither`: the same bf16 values with float32 weights spread inside their bf16
interval). After each run its final/ (and final-master/, the float32 master weights,
which every run here writes) is scored on the config's held-out prompts with
`async-rl eval` in each of --dtypes, and the master also after rounding it to bfloat16.

Weights are compared with the start: the share of them the run moved, the share whose
bfloat16 value moved (what bf16 actors and a bf16 learner can see of the update), and
the largest move. Results: OUT/results.jsonl (a line per run) and OUT/experiment.md
(a row per run); a finished run directory is scored again, not rerun.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from staleness_sweep import run_one

from async_rl.run.directory import RunDir
from async_rl.run.model_card import final_dtype

ROOT = Path(__file__).resolve().parents[1]
# Every arm but the start's own moves one factor from the config's settings, from the
# start written in bf16 (as `async-rl sft` once wrote its model, and as models are published).
BF16_START = ["start=bf16"]
ARMS: dict[str, list[str]] = {
    "base": BF16_START,
    "start-float32": [],
    "start-dither": ["start=dither"],
    "actors-float32": [*BF16_START, "actors.engine.dtype=float32"],
    "actors-float16": [*BF16_START, "actors.engine.dtype=float16"],
    "learner-fp32": [*BF16_START, "learner.precision=fp32"],
    "all-fp32": [*BF16_START, "learner.precision=fp32", "actors.engine.dtype=float32"],
    "sdpa": [*BF16_START, "learner.attention=sdpa", "actors.engine.attention=sdpa"],
    "correction-none": [*BF16_START, "train.correction=none"],
    "correction-token": [*BF16_START, "train.correction=token"],
    "lr-5e-6": [*BF16_START, "train.lr=5e-6"],
    "lr-1e-5": [*BF16_START, "train.lr=1e-5"],
    "eps-1e-6": [*BF16_START, "train.adam_eps=1e-6"],
}


def start_model(start: Path, kind: str, out: Path) -> Path:
    """START as given, or a copy of it rounded to bfloat16 (`bf16`) or with its float32
    weights spread uniformly inside the bf16 interval of each (`dither`): the same bf16
    model, no longer on bf16's grid."""
    if kind == "as-given":
        return start
    made = out / f"start-{kind}"
    if (made / "model.safetensors").exists():
        return made
    from safetensors.torch import load_file, save_file

    from async_rl.learner.precision import dither_to_grid

    shutil.copytree(start, made, dirs_exist_ok=True)
    state = load_file(start / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    if kind == "bf16":
        state = {name: t.to(torch.bfloat16) for name, t in state.items()}
    else:
        state = {name: dither_to_grid(t.float().to(torch.bfloat16).float(), torch.bfloat16, generator)
                 for name, t in state.items()}
    save_file({name: t.contiguous() for name, t in state.items()}, made / "model.safetensors",
              metadata={"format": "pt"})
    return made


def update_stats(start: Path, final: Path) -> dict[str, float]:
    """How the run moved the weights, over every parameter of `final`'s safetensors."""
    from safetensors import safe_open

    moved = moved_bf16 = total = 0
    largest = 0.0
    with safe_open(start / "model.safetensors", "pt") as a, safe_open(final / "model.safetensors", "pt") as b:
        for name in b.keys():
            before, after = a.get_tensor(name).float(), b.get_tensor(name).float()
            delta = after - before
            total += delta.numel()
            moved += int((delta != 0).sum())
            moved_bf16 += int((after.to(torch.bfloat16) != before.to(torch.bfloat16)).sum())
            largest = max(largest, float(delta.abs().max()))
    return {"moved": moved / total, "moved_bf16": moved_bf16 / total, "largest_move": largest}


def rounded_copy(model: Path) -> Path:
    """`model` rounded to bfloat16 and written in float32 beside it."""
    from safetensors.torch import load_file, save_file

    out = model.with_name(model.name + "-bf16-rounded")
    if not (out / "model.safetensors").exists():
        shutil.copytree(model, out, dirs_exist_ok=True)
        state = load_file(model / "model.safetensors")
        save_file({n: t.to(torch.bfloat16).float().contiguous() for n, t in state.items()}, out / "model.safetensors",
                  metadata={"format": "pt"})
    return out


def score(config: Path, model: Path, dtype: str, overrides: list[str]) -> float:
    """Held-out accuracy of `model` with the torch engine in `dtype` (async-rl eval)."""
    cmd = [sys.executable, "-m", "async_rl.cli", "eval", str(config), str(model), *overrides,
           f"actors.engine.dtype={dtype}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[0])["eval/accuracy"]


def in_run(run_dir: Path) -> dict[str, float]:
    steps, evals = RunDir(run_dir).steps_and_evals()
    last = steps[-1] if steps else {}
    evals = sorted(evals, key=lambda e: e["step"])
    return {"last_eval": evals[-1]["eval/accuracy"] if evals else float("nan"),
            "evals": {e["step"]: e["eval/accuracy"] for e in evals},
            "mismatch_kl_max": max((s.get("is/mismatch_kl", 0.0) for s in steps), default=float("nan")),
            "entropy_last": last.get("policy/entropy", float("nan")),
            "reward_last": last.get("train/reward_mean", float("nan"))}


def finished(run_dir: Path) -> bool:
    return (run_dir / "final-master" / "model.safetensors").exists()


def run_arm(args, arm: str, seed: int) -> dict:
    overrides = [o for o in ARMS[arm] if not o.startswith("start=")]
    kind = next((o.split("=", 1)[1] for o in ARMS[arm] if o.startswith("start=")), "as-given")
    start = start_model(args.start.resolve(), kind, args.out.resolve())
    name = f"{arm}-{args.steps}steps-seed{seed}"
    run_dir = (args.out / name).resolve()
    settings = [*args.set, *overrides]  # an arm's own overrides win
    if not finished(run_dir):
        if run_dir.exists():
            shutil.rmtree(run_dir)  # the launcher refuses a run_dir that holds a run
        cmd = [sys.executable, "-m", "async_rl.cli", "train", str(args.config), f"run_dir={run_dir}",
               f"model.path={start}", f"seed={seed}", f"train.max_steps={args.steps}", "eval.every=0",
               "checkpoint.final_master=true", *settings]
        started = time.monotonic()
        code = run_one(cmd, args.out / "logs" / f"{name}.log", args.timeout)
        print(f"{name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            return {}
    final, master = run_dir / "final", run_dir / "final-master"
    row = {"arm": arm, "seed": seed, "steps": args.steps, "settings": settings, "start": kind, **in_run(run_dir),
           **update_stats(start, master)}
    for dtype in args.dtypes:
        row[f"final_{dtype}"] = score(args.config, final, dtype, settings)
        row[f"master_{dtype}"] = score(args.config, master, dtype, settings)
    # final/ in bf16 is the master rounded already: its float32 score is the rounded one.
    if "float32" in args.dtypes:
        row["master_rounded_float32"] = row["final_float32"] if final_dtype(final) == "bfloat16" else \
            score(args.config, rounded_copy(master), "float32", settings)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def mean_cell(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if key in r]
    if not values:
        return ""
    mean = sum(values) / len(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ({min(values):.2f}–{max(values):.2f})"


def report(out: Path, header: str) -> str:
    """OUT/experiment.md: a row per run, then with several seeds the mean per arm."""
    rows = [json.loads(line) for line in open(out / "results.jsonl")] if (out / "results.jsonl").exists() else []
    scored = [k for k in ("final_bfloat16", "final_float32", "master_bfloat16", "master_float32",
                          "master_rounded_float32") if any(k in r for r in rows)]
    names = {"final_bfloat16": "final/ bf16", "final_float32": "final/ fp32", "master_bfloat16": "master bf16",
             "master_float32": "master fp32", "master_rounded_float32": "master bf16-rounded, fp32"}
    lines = [header, "",
             "Held-out accuracy, greedy: the run's own evaluations (the actors' engine, by step), then final/ and "
             "the float32 master scored by `async-rl eval` in bf16 and fp32; the share of weights the run moved, "
             "in float32 and as bfloat16 sees them; the largest is/mismatch_kl of a step; the policy's entropy at "
             "the last step.", "",
             "| arm | seed | steps | in the run | " + " | ".join(names[k] for k in scored)
             + " | moved | moved in bf16 | mismatch KL max | entropy at the end |",
             "|---|---|---|---|" + "---|" * (len(scored) + 4)]
    for r in rows:
        curve = " → ".join(f"{v:.2f}" for _, v in sorted((int(k), v) for k, v in r["evals"].items())) \
            if "evals" in r else f"{r['last_eval']:.2f}"
        lines.append(f"| {r['arm']} | {r['seed']} | {r['steps']} | {curve} | "
                     + " | ".join(f"{r[k]:.2f}" if k in r else "" for k in scored)
                     + f" | {r['moved']:.1%} | {r['moved_bf16']:.1%} | {r['mismatch_kl_max']:.4f} "
                     f"| {r['entropy_last']:.4f} |")
    arms = {}
    for r in rows:
        arms.setdefault((r["arm"], r["steps"]), []).append(r)
    if any(len(runs) > 1 for runs in arms.values()):
        lines += ["", "Mean over seeds (min–max):", "",
                  "| arm | steps | seeds | last in-run | " + " | ".join(names[k] for k in scored) + " |",
                  "|---|---|---|---|" + "---|" * len(scored)]
        for (arm, steps), runs in arms.items():
            lines.append(f"| {arm} | {steps} | {len(runs)} | {mean_cell(runs, 'last_eval')} | "
                         + " | ".join(mean_cell(runs, k) for k in scored) + " |")
    table = "\n".join(lines) + "\n"
    (out / "experiment.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--start", type=Path, required=True,
                        help="the model every run starts from (float32: arms round or dither it)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=[])
    parser.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="an arm of your own: its overrides (start=bf16 or start=dither for the start's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=7, help="train.max_steps of every run")
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"],
                        help="the dtypes each model is scored in (none: the in-run evaluations alone)")
    parser.add_argument("--out", type=Path, default=Path("runs/precision"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--report-only", action="store_true", help="run nothing; rebuild OUT/experiment.md")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "benchmarks/precision_experiment.py", *(sys.argv[1:] if argv is None else argv)])
    header = f"Precision experiment: `{command}`."
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    for spec in args.arm:
        name, _, overrides = spec.partition(":")
        ARMS[name] = [o for o in overrides.split(",") if o]
        args.arms.append(name)
    if not args.report_only:
        for seed in args.seeds:
            for arm in args.arms:
                run_arm(args, arm, seed)
    print(report(args.out, header), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
