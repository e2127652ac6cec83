"""A run directory as the analysis scripts see it: the resolved config, the step and
evaluation lines of metrics.jsonl, and the spans of trace.json when there is one.

    from rundata import load_run        # analysis scripts import their sibling module
    run = load_run(Path("runs/demo-..."))
    run.cfg["max_staleness"], run.steps[-1]["throughput/samples_per_s"], run.spans("actor")
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class Span:
    track: str  # the process track: "learner", "actor-0", ...
    name: str  # generate, score, push, wait-for-admission, train-step, sync, wait-for-data, ...
    start_s: float  # seconds since the epoch
    dur_s: float
    args: dict = field(default_factory=dict)


@dataclass
class Run:
    path: Path
    cfg: dict
    steps: list[dict]  # metrics.jsonl lines with "loss/total"
    evals: list[dict]  # metrics.jsonl lines with "eval/accuracy"
    trace: list[Span] | None  # None when the run has no trace.json

    @property
    def name(self) -> str:
        return self.path.name

    def spans(self, track_prefix: str = "") -> list[Span]:
        """Spans of the tracks whose name starts with `track_prefix` ([] without a trace)."""
        return [s for s in self.trace or [] if s.track.startswith(track_prefix)]

    def staleness_counts(self) -> dict[int, int]:
        """Samples per staleness value over the whole run (from the staleness/count_k keys)."""
        counts: dict[int, int] = {}
        for step in self.steps:
            for key, value in step.items():
                if key.startswith("staleness/count_"):
                    k = int(key.rsplit("_", 1)[1])
                    counts[k] = counts.get(k, 0) + int(value)
        return dict(sorted(counts.items()))


def add_run_arguments(parser) -> None:
    """The arguments every multi-run analysis script takes: RUN [RUN ...], --out, --smooth."""
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory of the comparison figure (default: the first run's analysis/)")
    parser.add_argument("--smooth", type=int, default=None,
                        help="rolling-mean window in steps for the curves (default: steps / 50, at least 1)")


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


def read_trace(path: Path) -> list[Span] | None:
    """Chrome trace format: complete events ("ph": "X", microseconds) and the
    "process_name" metadata events that name each pid's track."""
    if not path.exists():
        return None
    events = json.loads(path.read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [Span(names.get(e["pid"], str(e["pid"])), e["name"], e["ts"] / 1e6, e["dur"] / 1e6, e.get("args", {}))
            for e in events if e.get("ph") == "X"]


def load_run(path: Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        raise SystemExit(f"{path}: not a run directory (no metrics.jsonl)")
    lines = []
    for line in metrics.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            pass  # the line a killed run was writing
    cfg = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").exists() else {}
    return Run(path, cfg, [l for l in lines if "loss/total" in l], [l for l in lines if "eval/accuracy" in l],
               read_trace(path / "trace.json"))
