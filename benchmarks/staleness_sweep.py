"""Staleness sweep: held-out accuracy of the CPU demo against max_staleness, per loss
or off-policy correction.

    python benchmarks/staleness_sweep.py [--staleness 0 1 2 4 8] [--losses decoupled naive opmd]
                                       [--steps 600] [--out runs/staleness-sweep] [--set key=value ...]

Runs `async-rl train configs/demo.yaml` once per (loss, max_staleness), one after
another as real subprocesses, all from the same warm-started base model and seed:

    decoupled   train.loss=ppo train.loss.decoupled=true   (proximal policy + capped IS weight)
    naive       train.loss=ppo train.loss.decoupled=false  (PPO ratio against the behavior policy)
    opmd        train.loss=opmd                           (off-policy mirror descent squared loss)
    geometric_mask, m2po, icepop, sequence_is
                decoupled PPO with that train.correction instead of the token-level one

Each run goes to OUT/<loss>-s<max_staleness>; a run directory that already holds a
finished run is skipped, so an interrupted sweep continues where it stopped. The
results come from each run's metrics.jsonl alone: OUT/sweep.md (a markdown table,
also printed) and OUT/sweep.png (eval accuracy vs step). --report-only rebuilds
both from the run directories present without running anything.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rl.run.directory import RunDir, is_eval, is_step

ROOT = Path(__file__).resolve().parents[1]
LOSSES = {
    "decoupled": ["train.loss=ppo", "train.loss.decoupled=true"],
    "naive": ["train.loss=ppo", "train.loss.decoupled=false"],
    "opmd": ["train.loss=opmd"],
    **{correction: ["train.loss=ppo", f"train.correction={correction}"]
       for correction in ("geometric_mask", "m2po", "icepop", "sequence_is")},
}
RUN_NAME = re.compile(r"^(" + "|".join(LOSSES) + r")-s(\d+)$")


def read_run(run_dir: Path, target: float) -> dict | None:
    """The sweep's figures for one run, from metrics.jsonl; None before its first evaluation."""
    lines = RunDir(run_dir).metrics()
    steps = [line for line in lines if is_step(line)]
    evals = [line for line in lines if is_eval(line)]
    if not evals:
        return None
    return {
        "curve": [(e["step"], e["eval/accuracy"]) for e in evals],
        "final": evals[-1]["eval/accuracy"],
        "to_target": next((e["step"] for e in evals if e["eval/accuracy"] >= target), None),
        "wall": lines[-1]["time"],
        "staleness": sum(s["staleness/mean"] for s in steps) / len(steps) if steps else float("nan"),
        "last_step": steps[-1]["step"] if steps else 0,
    }


def finished(run_dir: Path) -> bool:
    # An interrupted run writes final/ too, so also ask for its last step.
    run = RunDir(run_dir)
    if not run.final_dir.is_dir() or not run.config_path.exists():
        return False
    max_steps = run.config()["train"]["max_steps"]
    result = read_run(run_dir, target=1.0)
    return result is not None and result["last_step"] >= max_steps


def base_model(args: argparse.Namespace) -> Path:
    """The model every run starts from: --model, or the demo model built once, as the launcher would."""
    if args.model:
        return args.model.resolve()
    from async_rl.config import load_config
    from async_rl.models.demo import INFO_FILE, build_demo_model
    from async_rl.tasks import task_from_config

    cfg = load_config(args.config, [f"seed={args.seed}", *args.set])
    if cfg.model.path != "demo":
        return Path(cfg.model.path).resolve()
    target = (args.out / "base_model").resolve()
    if not (target / INFO_FILE).exists():  # written last: a half-written directory is rebuilt
        print(f"building the demo base model in {target} ...", flush=True)
        build_demo_model(target, seed=cfg.seed, task=task_from_config(cfg.task, cfg.seed),
                         target_accuracy=cfg.model.warm_start_accuracy)
    return target


def run_one(cmd: list[str], log_path: Path, timeout: float) -> int:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: the launcher then stops the learner and actors it
            # started in their own sessions, which a kill would leave behind.
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            print(f"  timed out after {timeout:.0f} s", flush=True)
            return 124
        except KeyboardInterrupt:
            proc.wait()  # the launcher got the Ctrl-C too and is shutting its run down
            raise


def sweep(args: argparse.Namespace) -> set[str]:
    """Run every missing (loss, max_staleness) pair; returns the names of failed runs."""
    model = base_model(args)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    failed = set()
    for eta in args.staleness:
        for loss in args.losses:
            name, run_dir = f"{loss}-s{eta}", (args.out / f"{loss}-s{eta}").resolve()
            if finished(run_dir):
                r = read_run(run_dir, args.target)
                print(f"{name}: already finished, skipped (final accuracy {r['final']:.3f})", flush=True)
                continue
            if run_dir.exists():
                shutil.rmtree(run_dir)  # the launcher refuses a run_dir that holds a run
            cmd = [sys.executable, "-m", "async_rl.cli", "train", str(args.config), f"run_dir={run_dir}",
                   f"model.path={model}", f"seed={args.seed}", f"max_staleness={eta}",
                   f"train.max_steps={args.steps}", "sync.every=1", *LOSSES[loss], *args.set]
            start = time.monotonic()
            code = run_one(cmd, args.out / "logs" / f"{name}.log", args.timeout or 300 + args.steps)
            wall = time.monotonic() - start
            r = read_run(run_dir, args.target)
            if code != 0:
                failed.add(name)
                print(f"{name}: FAILED (exit {code}) after {wall:.0f} s; log in {args.out / 'logs' / name}.log",
                      flush=True)
            else:
                print(f"{name}: {wall:.0f} s, final accuracy {r['final']:.3f}" if r else f"{name}: {wall:.0f} s, "
                      "no evaluation in metrics.jsonl", flush=True)
    return failed


def cell(run_dir: Path, name: str, failed: set[str], target: float) -> str:
    if name in failed:
        return "failed"
    if not run_dir.exists():
        return "—"
    r = read_run(run_dir, target)
    if r is None or not finished(run_dir):
        return "incomplete"
    to_target = f"{r['to_target']} steps" if r["to_target"] is not None else "—"
    return f"{r['final']:.3f} · {to_target} · {r['wall']:.0f} s"


def report(out: Path, etas: list[int], losses: list[str], failed: set[str], target: float, header: str) -> str:
    runs = {(loss, eta): out / f"{loss}-s{eta}" for eta in etas for loss in losses}
    results = {k: read_run(d, target) for k, d in runs.items()}
    lines = [header, "",
             f"Cells: final eval accuracy · steps to eval accuracy >= {target} · wall time. "
             f"Last column: mean measured staleness per run ({' / '.join(losses)}).", "",
             "| max_staleness | " + " | ".join(losses) + " | mean staleness |",
             "|---|" + "---|" * (len(losses) + 1)]
    for eta in etas:
        cells = [cell(runs[loss, eta], f"{loss}-s{eta}", failed, target) for loss in losses]
        stale = " / ".join(f"{r['staleness']:.2f}" if (r := results[loss, eta]) else "—" for loss in losses)
        lines.append(f"| {eta} | " + " | ".join(cells) + f" | {stale} |")
    table = "\n".join(lines) + "\n"
    (out / "sweep.md").write_text(table)
    try:
        plot(out / "sweep.png", etas, losses, results, target)
    except ImportError:  # matplotlib is the optional `analysis` extra; the table does not need it
        print("matplotlib is not installed (pip install -e '.[analysis]'): no sweep.png", file=sys.stderr)
    return table


def plot(path: Path, etas: list[int], losses: list[str], results: dict, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the machines this runs on
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(losses), figsize=(4.5 * len(losses), 3.8), sharey=True, squeeze=False)
    for ax, loss in zip(axes[0], losses):
        for eta in etas:
            if (r := results[loss, eta]) is not None:
                steps, acc = zip(*r["curve"])
                ax.plot(steps, acc, marker=".", label=f"{eta}")
        ax.axhline(target, linestyle=":", color="gray")
        ax.set(title=loss, xlabel="step", ylim=(0, 1))
        ax.grid(alpha=0.3)
        if ax.lines[1:]:  # the target line alone needs no legend
            ax.legend(title="max_staleness", fontsize="small")
    axes[0][0].set_ylabel("held-out eval accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8], help="max_staleness values")
    parser.add_argument("--losses", nargs="+", choices=list(LOSSES), default=["decoupled", "naive", "opmd"],
                        help="loss or correction variants")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (and of the demo base model)")
    # ~0.17 s/step async, ~0.25 s/step at max_staleness 0, ~15 s startup: 15 runs of 600 steps take ~35 min on 2 cores.
    parser.add_argument("--steps", type=int, default=600, help="train.max_steps of every run")
    parser.add_argument("--out", type=Path, default=Path("runs/staleness-sweep"), help="sweep directory")
    parser.add_argument("--config", type=Path, default=ROOT / "configs/demo.yaml", help="base config of every run")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory to start from "
                             "(default: build the demo model once into OUT/base_model)")
    parser.add_argument("--target", type=float, default=0.9, help="eval accuracy threshold for 'steps to target'")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override passed to every run (repeatable), e.g. train.batch_groups=8")
    parser.add_argument("--report-only", action="store_true", help="run nothing; rebuild sweep.md and sweep.png")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 300 + steps)")
    args = parser.parse_args(argv)
    meta_path = args.out / "sweep.json"

    if args.report_only:
        # Rows and columns are whatever run directories exist; the header is the one of the sweep that made them.
        found = [m.groups() for d in sorted(args.out.glob("*-s*")) if (m := RUN_NAME.match(d.name))]
        if not found:
            print(f"no run directories (<loss>-s<max_staleness>) in {args.out}", file=sys.stderr)
            return 1
        etas = sorted({int(eta) for _, eta in found})
        losses = [loss for loss in LOSSES if loss in {line for line, _ in found}]
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        header = meta.get("header", f"Staleness sweep in `{args.out}`.")
        print(report(args.out, etas, losses, set(meta.get("failed", [])), args.target, header), end="")
        return 0

    command = shlex.join(["python", "benchmarks/staleness_sweep.py", *(sys.argv[1:] if argv is None else argv)])
    header = (f"Staleness sweep: `{command}` — {args.steps} steps per run, seed {args.seed}, "
              f"{len(args.losses) * len(args.staleness)} runs.")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        failed = sweep(args)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    meta_path.write_text(json.dumps({"header": header, "failed": sorted(failed)}, indent=2) + "\n")
    print()
    print(report(args.out, args.staleness, args.losses, failed, args.target, header), end="")
    print(f"\nwrote {args.out / 'sweep.md'} and {args.out / 'sweep.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
