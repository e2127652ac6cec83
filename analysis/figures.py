"""What the multi-run analysis scripts share besides reading runs (async_rl.run.directory):
their command line, legend labels, smoothing, and writing figures without a display.

    from figures import add_run_arguments, pyplot, save_figure   # analysis scripts import their sibling module
"""
from __future__ import annotations

import sys
from pathlib import Path

from async_rl.run.directory import Run, load_run


def add_run_arguments(parser) -> None:
    """The arguments every multi-run analysis script takes: RUN [RUN ...], --out, --smooth."""
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory of the comparison figure (default: the first run's analysis/)")
    parser.add_argument("--smooth", type=int, default=None,
                        help="rolling-mean window in steps for the curves (default: steps / 50, at least 1)")


def load_runs(paths: list[Path]) -> list[Run] | None:
    """The runs the command line named, or None (after one line on stderr) when one of
    them has no training step to analyse."""
    runs = [load_run(p) for p in paths]
    for run in runs:
        if not run.steps:
            print(f"{run.path}: no training steps in metrics.jsonl", file=sys.stderr)
            return None
    return runs


def labels(runs: list[Run]) -> list[str]:
    """Run names for legends and tables; the parent directory is added where names collide."""
    names = [r.name for r in runs]
    return [f"{r.path.parent.name}/{r.name}" if names.count(r.name) > 1 else r.name for r in runs]


def rolling(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(n: int, smooth: int | None) -> int:
    """`smooth` points when given, else a window that shows about 50 points' worth of detail."""
    return max(1, smooth if smooth else n // 50)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on the machines this runs on
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(make_plots) -> None:
    """Run `make_plots()` (it returns the paths it wrote) and list them; without
    matplotlib (the optional `analysis` extra) say so instead: the tables do not need it."""
    try:
        written = make_plots()
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[analysis]'): no plots", file=sys.stderr)
        return
    print("plots: " + ", ".join(str(p) for p in written))
