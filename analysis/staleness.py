"""Staleness and importance-weight diagnostics of one or more run directories.

    python analysis/staleness.py RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth N]

Per run, into RUN_DIR/analysis/:
    staleness_hist.png   fraction of trained samples per staleness value k (learner version
                         minus the version that generated the sample), with the max_staleness bound
    staleness_time.png   mean and max staleness per step, and the per-step distribution
                         (share of each k in the step's batch, stacked)
    is_ess.png           effective sample size of the behavior->proximal importance weights
                         per step, is/ess = (sum w)^2 / (N sum w^2), 1 = no correction needed

With several runs, one more figure overlays them for comparison:
    staleness_compare.png   histograms side by side, mean staleness and is/ess per step
It goes to --out when given, otherwise into the FIRST run's analysis/ directory.

On stdout, a markdown table with one row per run: steps, trained samples, mean and max
staleness (over samples), the share of samples at each staleness value, mean and min
ESS, and the groups dropped for exceeding the bound (cumulative, last step line).

Everything comes from metrics.jsonl (the staleness/count_k keys hold the samples of
staleness k in each step) and config.yaml; a run whose step lines predate the
staleness/count_k keys gets its mean and max from staleness/mean and staleness/max and
no histogram.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from figures import add_run_arguments, labels, load_runs, pyplot, rolling, save_figure, smoothing_window, write_plots

from async_rl.run.directory import Run, step_staleness_counts

PLOTS = ("staleness_hist.png", "staleness_time.png", "is_ess.png")
COMPARE = "staleness_compare.png"


def stats(run: Run) -> dict:
    """The summary figures of one run (the table row)."""
    steps = run.steps
    counts = run.staleness_counts()
    total = sum(counts.values())
    ess = [s["is/ess"] for s in steps if isinstance(s.get("is/ess"), (int, float)) and math.isfinite(s["is/ess"])]
    if total:
        mean = sum(k * n for k, n in counts.items()) / total
        max_k = max(k for k, n in counts.items() if n)
    else:  # step lines without staleness/count_k: every step trains the same number of samples
        mean = sum(s["staleness/mean"] for s in steps) / len(steps) if steps else float("nan")
        max_k = max((s["staleness/max"] for s in steps), default=None)
    return {
        "run": run.name,
        "max_staleness": run.cfg.get("max_staleness", "?"),
        "steps": steps[-1]["step"] if steps else 0,
        "samples": steps[-1].get("train/samples", total) if steps else 0,
        "mean": mean,
        "max": max_k,
        "fractions": {k: n / total for k, n in counts.items()} if total else {},
        "ess_mean": sum(ess) / len(ess) if ess else None,
        "ess_min": min(ess) if ess else None,
        "dropped": steps[-1].get("staleness/dropped", 0) if steps else 0,
    }


def table(rows: list[dict]) -> str:
    ks = sorted({k for r in rows for k in r["fractions"]})
    head = ["run", "max_staleness", "steps", "samples", "staleness mean", "staleness max",
            *[f"k={k}" for k in ks], "ESS mean", "ESS min", "dropped groups"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ess = (f"{r['ess_mean']:.4f}", f"{r['ess_min']:.4f}") if r["ess_mean"] is not None else ("—", "—")
        cells = [r["run"], str(r["max_staleness"]), str(r["steps"]), str(r["samples"]), f"{r['mean']:.3f}",
                 "—" if r["max"] is None else str(r["max"]),
                 *[f"{r['fractions'][k]:.1%}" if k in r["fractions"] else ("—" if not r["fractions"] else "0.0%")
                   for k in ks], *ess, str(r["dropped"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- plots ----------------------------------------------------------------------------
def plot_run(run: Run, smooth: int | None) -> list[Path]:
    plt = pyplot()
    out = run.analysis_dir
    bound = run.cfg.get("max_staleness")
    steps = [s["step"] for s in run.steps]
    written = []

    counts = run.staleness_counts()
    total = sum(counts.values())
    if total:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        ks = list(range(max(max(counts), bound if isinstance(bound, int) else 0) + 1))
        fracs = [counts.get(k, 0) / total for k in ks]
        bars = ax.bar(ks, fracs, color="tab:blue")
        for bar, k in zip(bars, ks):
            if counts.get(k):
                ax.annotate(f"{counts[k]}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize="small")
        if isinstance(bound, int):
            ax.axvline(bound + 0.5, linestyle=":", color="gray", label=f"max_staleness = {bound}")
            ax.legend(fontsize="small")
        ax.set(title=f"{run.name}: staleness of {total} trained samples", xlabel="staleness k (versions)",
               ylabel="fraction of samples", xticks=ks, ylim=(0, 1.08))
        ax.grid(alpha=0.3, axis="y")
        written.append(save_figure(plt, fig, out / "staleness_hist.png"))
    else:
        print(f"{run.name}: no staleness/count_k keys in metrics.jsonl: no staleness_hist.png", file=sys.stderr)

    if steps:
        per_step = [step_staleness_counts(s) for s in run.steps]
        have_dist = any(per_step)
        fig, axes = plt.subplots(2 if have_dist else 1, 1, figsize=(7, 5.5 if have_dist else 3.5), sharex=True,
                                 squeeze=False)
        ax = axes[0][0]
        mean = [s["staleness/mean"] for s in run.steps]
        ax.plot(steps, mean, color="tab:blue", alpha=0.35 if smoothing_window(len(steps), smooth) > 1 else 1,
                label="mean (per step)")
        if smoothing_window(len(steps), smooth) > 1:
            w = smoothing_window(len(steps), smooth)
            ax.plot(steps, rolling(mean, w), color="tab:blue", label=f"mean ({w}-step rolling)")
        ax.step(steps, [s["staleness/max"] for s in run.steps], where="mid", color="tab:red", label="max")
        if isinstance(bound, int):
            ax.axhline(bound, linestyle=":", color="gray", label="max_staleness")
        ax.set(title=f"{run.name}: staleness per step", ylabel="staleness (versions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        if have_dist:
            ax = axes[1][0]
            ks = sorted({k for c in per_step for k in c})
            totals = [sum(c.values()) or 1 for c in per_step]
            layers = [[c.get(k, 0) / t for c, t in zip(per_step, totals)] for k in ks]
            ax.stackplot(steps, layers, labels=[f"k={k}" for k in ks], step="mid" if len(steps) < 200 else None)
            ax.set(ylabel="share of the step's samples", ylim=(0, 1))
            ax.legend(fontsize="small", loc="lower right", ncol=min(len(ks), 5))
        axes[-1][0].set_xlabel("learner step")
        written.append(save_figure(plt, fig, out / "staleness_time.png"))

    ess = [(s["step"], s["is/ess"]) for s in run.steps if isinstance(s.get("is/ess"), (int, float))]
    if ess:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        x, y = zip(*ess)
        w = smoothing_window(len(y), smooth)
        ax.plot(x, y, color="tab:green", alpha=0.35 if w > 1 else 1, marker="." if len(y) < 50 else None,
                label="is/ess (per step)")
        if w > 1:
            ax.plot(x, rolling(list(y), w), color="tab:green", label=f"{w}-step rolling mean")
        ax.set(title=f"{run.name}: importance-weight ESS (behavior -> proximal)", xlabel="learner step",
               ylabel="ESS / N", ylim=(min(0.0, min(y)), 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        written.append(save_figure(plt, fig, out / "is_ess.png"))
    else:
        print(f"{run.name}: no is/ess in metrics.jsonl: no is_ess.png", file=sys.stderr)
    return written


def plot_compare(runs: list[Run], path: Path, smooth: int | None) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = labels(runs)
    all_ks = sorted({k for r in runs for k in r.staleness_counts()})
    width = 0.8 / len(runs)
    for i, (run, name) in enumerate(zip(runs, names)):
        counts = run.staleness_counts()
        total = sum(counts.values())
        if total:
            axes[0].bar([k - 0.4 + width * (i + 0.5) for k in all_ks], [counts.get(k, 0) / total for k in all_ks],
                        width=width, label=name)
        steps = [s["step"] for s in run.steps]
        w = smoothing_window(len(steps), smooth)
        line, = axes[1].plot(steps, rolling([s["staleness/mean"] for s in run.steps], w), label=name)
        axes[1].plot(steps, [s["staleness/max"] for s in run.steps], linestyle=":", color=line.get_color())
        ess = [(s["step"], s["is/ess"]) for s in run.steps if isinstance(s.get("is/ess"), (int, float))]
        if ess:
            x, y = zip(*ess)
            axes[2].plot(x, rolling(list(y), smoothing_window(len(y), smooth)), label=name)
    axes[0].set(title="staleness histogram", xlabel="staleness k", ylabel="fraction of samples", xticks=all_ks)
    if not all_ks:
        axes[0].text(0.5, 0.5, "no staleness/count_k keys\nin these runs", ha="center", va="center",
                     transform=axes[0].transAxes, color="gray")
    axes[1].set(title="staleness per step (solid: mean, dotted: max)", xlabel="learner step", ylabel="versions")
    axes[2].set(title="importance-weight ESS per step", xlabel="learner step", ylabel="ESS / N", ylim=(0, 1.05))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    return save_figure(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if runs is None:
        return 1
    print(table([stats(r) for r in runs]), end="")

    def plots():
        written = [p for run in runs for p in plot_run(run, args.smooth)]
        if len(runs) > 1:
            written.append(plot_compare(runs, (args.out or runs[0].analysis_dir) / COMPARE, args.smooth))
        return written

    print()
    write_plots(plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
