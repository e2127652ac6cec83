"""Throughput and where the time goes, for one or more run directories (e.g. the
synchronous baseline max_staleness=0 next to an asynchronous run).

    python analysis/throughput.py RUN_DIR [RUN_DIR ...] [--out DIR] [--smooth N]

From metrics.jsonl (always):
    throughput.png   samples/s, generated tokens/s and the learner's idle fraction
                     (learner/idle_frac) per step against wall time, into RUN_DIR/analysis/
From trace.json (when the run has one; otherwise the script says so and skips these):
    time_shares.png  per track (learner, actor-<id>): the share of its wall time in each span
                     (generate, score, push, wait-for-admission, sync / wait-for-data,
                     train-step, sync, eval, checkpoint), and its idle share over time
    timeline.png     the spans of every track over a window of about 8 learner steps from
                     the middle of the run
With several runs, one more figure puts them side by side:
    throughput_compare.png   samples/s and tokens/s against wall time, and bars of samples/s,
                             learner idle and actor idle per run
It goes to --out when given, otherwise into the FIRST run's analysis/ directory.

On stdout, markdown tables:
  * Throughput, one row per run. Rates are measured from the end of the first step to the
    end of the last (the first step also waits for the actors to start): samples/s is the
    samples trained in steps 2..N over that time; tokens/s the same for generated response
    tokens (a step's tokens = its throughput/gen_tokens_per_s x its samples /
    its throughput/samples_per_s); learner idle is the learner's waiting time over those
    steps' time (each step's learner/idle_frac weighted by its duration, samples /
    samples_per_s); actor idle (trace) is the mean over actors of the wait-for-admission
    share of the actor's wall time; sync s/step is the mean of sync/seconds; the last
    column is samples/s relative to the first run with max_staleness=0, if any.
  * Time shares (trace), one row per run and role (learner, actor): the share of the
    role's wall time in each kind of span, summed over the role's tracks. A track's wall
    time runs from its first span's start to its last span's end, except that a learner
    track starts at its first train-step (before it: the initial evaluation and the wait
    for the actors to start, left out like step 1 above; --include-startup keeps them). Time inside nested or
    overlapping spans counts once, for the innermost (latest started) span; time in no
    span is "untracked". "wait" is wait-for-data on the learner and wait-for-admission on
    actors. An actor's shares are its main thread's: with reward.in_flight > 0 its score
    and push spans run in its scorer thread, beside the next generate, and are left out
    of the tables and figures (trace.json keeps them).
  * Actor idle (trace), one row per actor track: its wall time and wait-for-admission share.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import sys
from pathlib import Path

from figures import add_run_arguments, labels, load_runs, pyplot, rolling, save_figure, smoothing_window, write_plots

from async_rl.run.directory import Run, TraceSpan, track_role

COLUMNS = ("generate", "score", "push", "train-step", "eval", "checkpoint", "sync", "wait")
WAITS = {"learner": "wait-for-data", "actor": "wait-for-admission"}
COLORS = {"generate": "tab:blue", "score": "tab:cyan", "push": "tab:purple", "train-step": "tab:green",
          "eval": "tab:olive", "checkpoint": "tab:brown", "sync": "tab:orange", "wait-for-data": "tab:red",
          "wait-for-admission": "tab:red", "wait": "tab:red", "other": "tab:pink", "untracked": "lightgray"}


# -- metrics ----------------------------------------------------------------------------
def step_increments(steps: list[dict]) -> list[dict]:
    """Per step after the first: samples, generated tokens, duration and learner wait
    (durations and tokens recovered exactly from the per-step rates)."""
    out = []
    for prev, cur in zip(steps, steps[1:]):
        samples = cur["train/samples"] - prev["train/samples"]
        rate = cur["throughput/samples_per_s"]
        duration = samples / rate if rate > 0 else cur["time"] - prev["time"]
        tokens = cur["throughput/gen_tokens_per_s"] * duration
        out.append({"samples": samples, "tokens": tokens, "duration": duration,
                    "waited": cur["learner/idle_frac"] * duration})
    return out


def metrics_row(run: Run) -> dict:
    steps = run.steps
    row = {"run": run.name, "max_staleness": run.cfg.get("max_staleness", "?"), "steps": steps[-1]["step"],
           "wall_s": steps[-1]["time"], "sync_s": sum(s.get("sync/seconds", 0.0) for s in steps) / len(steps)}
    inc = step_increments(steps)
    if inc:
        elapsed = max(steps[-1]["time"] - steps[0]["time"], 1e-9)
        row["samples_per_s"] = sum(i["samples"] for i in inc) / elapsed
        row["tokens_per_s"] = sum(i["tokens"] for i in inc) / elapsed
        row["learner_idle"] = sum(i["waited"] for i in inc) / max(sum(i["duration"] for i in inc), 1e-12)
    else:  # a single step: its own rates
        row["samples_per_s"] = steps[0]["throughput/samples_per_s"]
        row["tokens_per_s"] = steps[0]["throughput/gen_tokens_per_s"]
        row["learner_idle"] = steps[0]["learner/idle_frac"]
    return row


# -- trace ------------------------------------------------------------------------------
def self_times(spans: list[TraceSpan]) -> dict[str, float]:
    """Seconds per span name on one track, each instant counted once, for the innermost
    (latest started; on a tie, shortest) span covering it."""
    bounds = sorted({t for s in spans for t in (s.start_s, s.start_s + s.dur_s)})
    order = sorted(spans, key=lambda s: s.start_s)
    heap: list[tuple[float, float, int]] = []  # (-start, end, index into order)
    out: dict[str, float] = {}
    nxt = 0
    for left, right in zip(bounds, bounds[1:]):
        while nxt < len(order) and order[nxt].start_s <= left:
            s = order[nxt]
            heapq.heappush(heap, (-s.start_s, s.start_s + s.dur_s, nxt))
            nxt += 1
        while heap and heap[0][1] <= left:
            heapq.heappop(heap)  # ended; ended spans below the top go when they reach it
        if heap:
            name = order[heap[0][2]].name
            out[name] = out.get(name, 0.0) + (right - left)
    return out


def without_startup(spans: list[TraceSpan]) -> list[TraceSpan]:
    """A learner track from its first train-step on: before it, the learner evaluates the
    initial policy and waits for the actors to start (step 1 of the metrics)."""
    first = min((s.start_s for s in spans if s.name == "train-step"), default=None)
    if first is None:
        return spans
    return [s if s.start_s >= first else TraceSpan(s.track, s.name, first, s.start_s + s.dur_s - first, s.args)
            for s in spans if s.start_s + s.dur_s > first]


def track_shares(spans: list[TraceSpan], startup: bool = False) -> dict[str, dict]:
    """Per track: {"wall": seconds, "seconds": {span name: self seconds}}; learner tracks
    without their start-up unless `startup`."""
    tracks: dict[str, list[TraceSpan]] = {}
    for s in spans:
        tracks.setdefault(s.track, []).append(s)
    out = {}
    for track, ss in sorted(tracks.items()):
        if track_role(track) == "learner" and not startup:
            ss = without_startup(ss)
        wall = max(s.start_s + s.dur_s for s in ss) - min(s.start_s for s in ss)
        out[track] = {"wall": wall, "seconds": self_times(ss)}
    return out


def column_of(name: str) -> str:
    if name in WAITS.values():
        return "wait"
    return name if name in COLUMNS else "other"


def role_shares(spans: list[TraceSpan], startup: bool = False) -> dict[str, dict]:
    """Per role: {"tracks": n, "wall": summed wall seconds, "shares": {column: fraction},
    "names": span names seen}; columns are COLUMNS + other + untracked."""
    out: dict[str, dict] = {}
    for track, t in track_shares(spans, startup).items():
        r = out.setdefault(track_role(track), {"tracks": 0, "wall": 0.0, "seconds": {}, "names": set()})
        r["tracks"] += 1
        r["wall"] += t["wall"]
        for name, sec in t["seconds"].items():
            col = column_of(name)
            r["seconds"][col] = r["seconds"].get(col, 0.0) + sec
            r["names"].add(col)
    for r in out.values():
        wall = max(r["wall"], 1e-12)
        r["shares"] = {col: sec / wall for col, sec in r["seconds"].items()}
        r["shares"]["untracked"] = max(0.0, 1.0 - sum(r["shares"].values()))
    return out


def actor_idle(spans: list[TraceSpan]) -> dict[str, dict]:
    """Per actor track: wall seconds and wait-for-admission share."""
    return {track: {"wall": t["wall"], "idle": t["seconds"].get("wait-for-admission", 0.0) / max(t["wall"], 1e-12)}
            for track, t in track_shares(spans).items() if track_role(track) == "actor"}


# -- tables -----------------------------------------------------------------------------
def pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def throughput_table(runs: list[Run]) -> str:
    rows = [metrics_row(r) for r in runs]
    base = next((r for r in rows if r["max_staleness"] == 0), None)
    head = ["run", "max_staleness", "steps", "wall s", "samples/s", "gen tokens/s", "learner idle",
            "actor idle (trace)", "sync s/step", "samples/s vs max_staleness=0"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, r in zip(runs, rows):
        idle = actor_idle(run.trace) if run.trace else {}
        a_idle = sum(a["idle"] for a in idle.values()) / len(idle) if idle else None
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base and base["samples_per_s"] else "—"
        lines.append("| " + " | ".join([
            r["run"], str(r["max_staleness"]), str(r["steps"]), f"{r['wall_s']:.1f}", f"{r['samples_per_s']:.1f}",
            f"{r['tokens_per_s']:.1f}", pct(r["learner_idle"]), pct(a_idle), f"{r['sync_s']:.4f}", ratio]) + " |")
    return "\n".join(lines) + "\n"


def shares_table(runs: list[Run], startup: bool = False) -> str:
    head = ["run", "role", "tracks", "wall s", *COLUMNS, "other", "untracked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        for role, r in sorted(role_shares(run.trace, startup).items()):
            cells = [pct(r["shares"][c]) if c in r["names"] else "—" for c in (*COLUMNS, "other")]
            lines.append("| " + " | ".join([run.name, role, str(r["tracks"]), f"{r['wall']:.2f}", *cells,
                                            pct(r["shares"]["untracked"])]) + " |")
    return "\n".join(lines) + "\n"


def actor_table(runs: list[Run]) -> str:
    lines = ["| run | actor | wall s | idle (wait-for-admission) |", "|---|---|---|---|"]
    for run in runs:
        for track, a in actor_idle(run.trace).items():
            lines.append(f"| {run.name} | {track} | {a['wall']:.2f} | {pct(a['idle'])} |")
    return "\n".join(lines) + "\n"


# -- plots ------------------------------------------------------------------------------
def curve(ax, x, y, w: int, label: str, color=None):
    if w > 1:
        ax.plot(x, y, alpha=0.25, color=color)
        ax.plot(x, rolling(y, w), color=color, label=f"{label} ({w}-step mean)")
    else:
        ax.plot(x, y, marker="." if len(y) < 50 else None, color=color, label=label)


def plot_metrics(run: Run, smooth: int | None) -> Path:
    plt = pyplot()
    steps = run.steps[1:] or run.steps  # the first step's rates include the actors' start-up
    t = [s["time"] for s in steps]
    w = smoothing_window(len(steps), smooth)
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.5), sharex=True)
    curve(axes[0], t, [s["throughput/samples_per_s"] for s in steps], w, "samples/s", "tab:blue")
    curve(axes[1], t, [s["throughput/gen_tokens_per_s"] for s in steps], w, "generated tokens/s", "tab:purple")
    curve(axes[2], t, [s["learner/idle_frac"] for s in steps], w, "learner/idle_frac", "tab:red")
    axes[0].set(title=f"{run.name} (max_staleness={run.cfg.get('max_staleness', '?')}): throughput per step",
                ylabel="samples/s")
    axes[1].set(ylabel="tokens/s")
    axes[2].set(ylabel="learner idle fraction", xlabel="wall time (s since start)", ylim=(0, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return save_figure(plt, fig, run.analysis_dir / "throughput.png")


def idle_over_time(track: list[TraceSpan], wait: str | None, t0: float, t1: float,
                   bins: int) -> tuple[list[float], list[float]]:
    """Share of each time bin that the track spends in its `wait` spans, over the part of
    the bin within the track's lifetime (NaN outside it)."""
    width = (t1 - t0) / bins
    life = (min(s.start_s for s in track), max(s.start_s + s.dur_s for s in track))
    waited = [0.0] * bins
    for s in track:
        if s.name != wait:
            continue
        a, b = s.start_s, s.start_s + s.dur_s
        for i in range(max(0, int((a - t0) / width)), min(bins, int((b - t0) / width) + 1)):
            lo, hi = t0 + i * width, t0 + (i + 1) * width
            waited[i] += max(0.0, min(b, hi) - max(a, lo))
    shares = []
    for i in range(bins):
        alive = min(life[1], t0 + (i + 1) * width) - max(life[0], t0 + i * width)
        shares.append(min(1.0, waited[i] / alive) if alive > 1e-3 * width else float("nan"))
    return [(i + 0.5) * width for i in range(bins)], shares


def plot_trace(run: Run, startup: bool = False) -> list[Path]:
    plt = pyplot()
    spans = run.trace
    shares = track_shares(spans, startup)
    tracks = list(shares)
    t0 = min(s.start_s for s in spans)
    t1 = max(s.start_s + s.dur_s for s in spans)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 0.6 * len(tracks) + 2.5))
    names = sorted({n for t in shares.values() for n in t["seconds"]},
                   key=lambda n: (list(COLORS).index(n) if n in COLORS else len(COLORS), n))
    for y, track in enumerate(tracks):
        left = 0.0
        wall = max(shares[track]["wall"], 1e-12)
        parts = [(n, shares[track]["seconds"].get(n, 0.0) / wall) for n in names]
        parts.append(("untracked", max(0.0, 1 - sum(p for _, p in parts))))
        for n, frac in parts:
            if frac > 0:
                ax.barh(y, frac, left=left, color=COLORS.get(n, "tab:pink"), edgecolor="white", linewidth=0.5,
                        label=n)
                if frac > 0.06:
                    ax.text(left + frac / 2, y, f"{frac:.0%}", ha="center", va="center", fontsize="x-small")
                left += frac
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.18),
              ncol=4)
    ax.set(yticks=range(len(tracks)), yticklabels=tracks, xlim=(0, 1), xlabel="share of the track's wall time",
           title=f"{run.name}: where the time goes")
    ax.invert_yaxis()
    bins = max(10, min(200, int((t1 - t0) / 0.25)))
    for track in tracks:
        wait = WAITS.get(track_role(track))
        x, y = idle_over_time([s for s in spans if s.track == track], wait, t0, t1, bins)
        ax2.plot(x, y, label=f"{track} ({wait})")
    ax2.set(title="idle share over time", xlabel="trace time (s)", ylabel="share of time bin", ylim=(0, 1.02))
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize="x-small")
    written = [save_figure(plt, fig, run.analysis_dir / "time_shares.png")]

    # Timeline: about 8 learner steps from the middle of the run.
    train = sorted((s for s in spans if s.name == "train-step" and track_role(s.track) == "learner"),
                   key=lambda s: s.start_s)
    if len(train) >= 2:
        mid = max(0, len(train) // 2 - 4)
        lo, hi = train[mid].start_s, train[min(len(train) - 1, mid + 8)].start_s
        lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
    else:
        lo, hi = t0, min(t1, t0 + 2.0)
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(tracks) + 1.8))
    seen = set()
    for y, track in enumerate(tracks):
        for s in spans:
            if s.track == track and s.start_s + s.dur_s >= lo and s.start_s <= hi:
                ax.barh(y, s.dur_s, left=s.start_s - t0, height=0.6, color=COLORS.get(s.name, "tab:pink"),
                        edgecolor="black", linewidth=0.2, label=None if s.name in seen else s.name)
                seen.add(s.name)
    ax.set(yticks=range(len(tracks)), yticklabels=tracks, xlim=(lo - t0, hi - t0), xlabel="trace time (s)",
           title=f"{run.name}: timeline")
    ax.invert_yaxis()
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    written.append(save_figure(plt, fig, run.analysis_dir / "timeline.png"))
    return written


def plot_compare(runs: list[Run], path: Path, smooth: int | None) -> Path:
    plt = pyplot()
    names = labels(runs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for run, name in zip(runs, names):
        steps = run.steps[1:] or run.steps
        w = smoothing_window(len(steps), smooth)
        t = [s["time"] - run.steps[0]["time"] for s in steps]  # start-up times differ between runs
        axes[0].plot(t, rolling([s["throughput/samples_per_s"] for s in steps], w), label=name)
        axes[1].plot(t, rolling([s["throughput/gen_tokens_per_s"] for s in steps], w), label=name)
    axes[0].set(title="samples/s (rolling mean)", xlabel="s since the end of step 1", ylabel="samples/s")
    axes[1].set(title="generated tokens/s (rolling mean)", xlabel="s since the end of step 1", ylabel="tokens/s")
    rows = [metrics_row(r) for r in runs]
    idle = [actor_idle(r.trace) if r.trace else {} for r in runs]
    a_idle = [sum(a["idle"] for a in i.values()) / len(i) if i else 0.0 for i in idle]  # no bar without a trace
    x = range(len(runs))
    ax = axes[2]
    top = max(r["samples_per_s"] for r in rows) or 1.0
    ax.bar([i - 0.27 for i in x], [r["samples_per_s"] / top for r in rows], width=0.27, label="samples/s (rel.)")
    ax.bar(list(x), [r["learner_idle"] for r in rows], width=0.27, label="learner idle", color="tab:red")
    ax.bar([i + 0.27 for i in x], a_idle, width=0.27, label="actor idle (trace)", color="tab:orange")
    for i, r in enumerate(rows):
        if not idle[i]:
            ax.annotate("no trace", (i + 0.27, 0), ha="center", va="bottom", fontsize="x-small", rotation=90)
        ax.annotate(f"{r['samples_per_s']:.0f}/s", (i - 0.27, r["samples_per_s"] / top), ha="center", va="bottom",
                    fontsize="x-small")
    ax.set(title="per run", xticks=list(x), ylim=(0, 1.12),
           xticklabels=[f"{n}\nmax_staleness={r['max_staleness']}" for n, r in zip(names, rows)])
    for a in axes:
        a.grid(alpha=0.3)
        a.legend(fontsize="small")
    return save_figure(plt, fig, path)


SCORER_SPANS = ("score", "push")  # an actor's scorer thread's, when it scores off the generation path


def main_threads(run: Run) -> Run:
    """`run` with only its actors' main-thread spans: with reward.in_flight > 0 (its
    default; runs from before the setting scored on the path) score and push overlap the
    next generate in another thread."""
    in_flight = (run.cfg.get("reward") or {}).get("in_flight", 0)
    if not run.trace or not in_flight:
        return run
    return dataclasses.replace(run, trace=[s for s in run.trace
                                           if not (track_role(s.track) == "actor" and s.name in SCORER_SPANS)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--include-startup", action="store_true",
                        help="time shares: count the learner's time before its first train-step")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if runs is None:
        return 1
    runs = [main_threads(run) for run in runs]
    print("## Throughput\n")
    print(throughput_table(runs))
    traced = [r for r in runs if r.trace]
    for run in runs:
        if not run.trace:
            print(f"{run.name}: no trace.json (or no spans in it): actor idle, time shares and timeline skipped\n")
    if traced:
        print("## Time shares (trace)\n")
        print(shares_table(traced, args.include_startup))
        print("## Actor idle (trace)\n")
        print(actor_table(traced))

    def plots():
        written = []
        for run in runs:
            written.append(plot_metrics(run, args.smooth))
            if run.trace:
                written += plot_trace(run, args.include_startup)
        if len(runs) > 1:
            written.append(plot_compare(runs, (args.out or runs[0].analysis_dir) / "throughput_compare.png",
                                        args.smooth))
        return written

    write_plots(plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
