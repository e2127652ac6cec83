"""Discrete-event model of the actor-learner pipeline: samples/s, learner idle fraction
and the staleness distribution, from component rates.

    python benchmarks/simulate.py --calibrate RUN     # one JSON line: predicted vs measured
    python benchmarks/simulate.py --sweep [--calibrate RUN] --actors 1..16 --staleness 0 1 2 4 --png sweep.png
    python benchmarks/simulate.py --gen-seconds-per-group 0.002 --step-seconds 0.03 --actors 2 --max-staleness 4

The model, and the window over which runs and simulations are measured alike:
benchmarks/pipeline_model.py.

--calibrate RUN reads config.yaml and metrics.jsonl: per step the learner's busy time
(interval - wait - sync/seconds, interval = B*G / throughput/samples_per_s), sync/seconds
and actors/gen_seconds_per_group. These rates are in situ: they contain the run's own CPU
contention (actors and learner share 2 cores), so no contention term is added. They are
replayed step by step (learner: busy time of step k; actors: generation time per group of
the batches made with weights of version v), since on a shared machine load comes in
bursts, and a slowed actor drains the buffer for several steps, which means hide; the
prediction from means alone ("stationary_*", what the sweep uses) is reported too. With
RUN/trace.json, also: `overhead` = actor time outside the generate, wait-for-admission and
sync spans per group (scoring, encoding, pushing, round trips); `log_seconds` = learner
time from a step's sync to the next wait-for-data; `broadcast_seconds` = per version the
shortest of the actors' sync spans (the last to join: the transfer), replayed; the
generation time per group from the actors' generate spans (the engine's clock, which
metrics.jsonl reports, leaves out the prompts' and results' handling: the per-version
series is rescaled to the spans' mean); `delivery_seconds` = from the push that
completes a batch to the end of the learner's wait for it. Without it, overhead,
log_seconds and delivery_seconds are 0 and the transfer time is fitted to make the
model's sync/broadcast_seconds (joins + transfer) the measured.

Assumptions and limits:
- Generation time is linear in a batch's groups (measured at the run's groups_per_request).
- Not modelled: actor start-up, failures and joins, network limits, and the learner
  process's own threads (coordinator, broadcaster) competing with training for the GIL
  and CPU: under load a transfer or a grant then takes tens of ms. Such rare stalls make
  the real mean staleness lower than the model's. Without a trace, actors' time outside
  generation is missing (they look faster) and the learner's logging is counted before
  the publish instead of after it (the actors wait for it).
- Near balance (actors barely faster than the learner) staleness is a random walk between
  0 and eta: its mean swings with a few percent of rate error or one load burst.
- What-ifs and the sweep keep the rates fixed as actors are added (each actor on its own
  device); --cores C instead scales CPU times by max(1, (actors + ranks) / C) relative to
  the calibration run: a crude bound (other tenants of a shared machine and the learner's
  own threads slow training even with one actor, where this predicts none).
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from pipeline_model import Params, default_skip, simulate, stationary, window_summary, with_actors

from async_rl.run.directory import load_run, step_staleness_counts


# -- calibration from a run directory ---------------------------------------------------------
def _cv(xs: list[float]) -> float:
    mean = statistics.mean(xs) if xs else 0.0
    return min(3.0, max(0.05, statistics.pstdev(xs) / mean)) if len(xs) > 1 and mean > 0 else 0.2


def _outside_generate(spans, name: str) -> list:
    """The `name` spans of one track that are not nested in a `generate` span (with
    sync.in_flight, syncs happen inside generation and its time is already counted)."""
    gens = sorted((s.start_s, s.start_s + s.dur_s) for s in spans if s.name == "generate")
    starts = [a for a, _ in gens]
    out = []
    for s in spans:
        if s.name != name:
            continue
        i = bisect.bisect_right(starts, s.start_s) - 1  # the last generate starting before it
        if i < 0 or s.start_s + s.dur_s > gens[i][1]:
            out.append(s)
    return out


def trace_rates(run, skip: int) -> dict:
    """From trace.json, over the window: actor seconds per group outside generate,
    wait-for-admission and sync spans; learner seconds from a step's sync to the next
    wait-for-data; the transfer: per version the shortest of the actors' sync spans (its
    mean, cv and per-version values); delivery_seconds; the generate spans' seconds per
    group (for measure_run to rescale generation with). {} without a trace."""
    learner = sorted(run.spans("learner"), key=lambda s: s.start_s)
    steps = [s for s in learner if s.name == "train-step"]
    syncs = [s for s in run.spans("actor") if s.name == "sync"]
    if len(steps) <= skip + 1 or not syncs:
        return {}
    lo, hi = steps[skip].start_s, steps[-1].start_s + steps[-1].dur_s
    gaps = [b.start_s - a.start_s - a.dur_s for a, b in zip(learner, learner[1:])
            if a.start_s >= lo and b.name == "wait-for-data" and a.name in ("train-step", "sync")]
    other = groups = generating = 0.0
    for track in {s.track for s in syncs}:
        spans = [s for s in run.spans(track) if s.start_s >= lo and s.start_s + s.dur_s <= hi]
        if spans:
            other += max(s.start_s + s.dur_s for s in spans) - min(s.start_s for s in spans) - \
                sum(s.dur_s for s in spans if s.name in ("generate", "wait-for-admission")) - \
                sum(s.dur_s for s in _outside_generate(spans, "sync"))
            groups += sum(s.args.get("groups", 0) for s in spans if s.name == "generate")
            generating += sum(s.dur_s for s in spans if s.name == "generate")
    # The members of a broadcast finish together (coupled, pipeline_model.py): an earlier
    # joiner's span holds its wait for the last, whose own span is the transfer alone.
    by_version: dict[int, list[float]] = {}
    for s in syncs:
        by_version.setdefault(s.args.get("version"), []).append(s.dur_s)
    transfer = {v: min(d) for v, d in by_version.items()}
    in_window = {s.args.get("version") for s in syncs if lo <= s.start_s <= hi}
    durations = [transfer[v] for v in in_window] or list(transfer.values())
    return {"overhead_seconds_per_group": max(0.0, other / groups) if groups else 0.0,
            "log_seconds": max(0.0, statistics.mean(gaps)) if gaps else 0.0,
            "broadcast_seconds": statistics.mean(durations), "broadcast_cv": _cv(durations),
            "sync_replay": transfer, "delivery_seconds": delivery_seconds(run, skip) or 0.0,
            "generate_span_seconds_per_group": generating / groups if groups else None}


def delivery_seconds(run, skip: int) -> float | None:
    """Median time from the push that completes a batch to the learner's end of waiting
    for it (the hub's receive, the buffer and the learner thread's wake-up; the median:
    a wait that a push ends only by chance, such as an evaluation's, is far longer). None
    without a trace or a wait in the window."""
    learner = sorted(run.spans("learner"), key=lambda s: s.start_s)
    steps = [s for s in learner if s.name == "train-step"]
    # From the push's start: its span can end after the learner has woken (the sending
    # thread shares the GIL with generation).
    pushed = sorted(s.start_s for s in run.spans("actor") if s.name == "push")
    if len(steps) <= skip + 1 or not pushed:
        return None
    gaps = []
    for wait in (s for s in learner if s.name == "wait-for-data" and s.start_s >= steps[skip].start_s):
        end = wait.start_s + wait.dur_s
        last = bisect.bisect_right(pushed, end) - 1  # the last push begun before the learner woke
        if last >= 0 and pushed[last] >= wait.start_s:
            gaps.append(end - pushed[last])
    return statistics.median(gaps) if gaps else None


def measure_run(run_dir: Path, skip: int | None = None, use_trace: bool = True) -> tuple[Params, dict]:
    """(Params with the run's rates and replay series, the run's measured window summary)."""
    run = load_run(run_dir)
    cfg, steps = run.cfg, run.steps
    B, G, K = cfg["train"]["batch_groups"], cfg["train"]["group_size"], steps[-1]["step"]
    skip = default_skip(K) if skip is None else skip
    ev, ck = cfg["eval"]["every"], cfg["checkpoint"]["every"]
    paused = {v for v in range(1, K) if (ev and v % ev == 0) or (ck and v % ck == 0)}
    traced = trace_rates(run, skip) if use_trace else {}
    span_gen = traced.pop("generate_span_seconds_per_group", None)
    log, busy, gen_at = [], {}, {}
    for s in steps:
        interval = B * G / s["throughput/samples_per_s"]
        waited = s["learner/idle_frac"] * interval
        counts = step_staleness_counts(s)
        log.append({"step": s["step"], "time": s["time"], "waited": waited, "counts": counts})
        busy[s["step"]] = interval - waited - s["sync/seconds"] - traced.get("log_seconds", 0.0)
        for k, c in counts.items():  # this batch's groups were made with weights of version step - 1 - k
            gen_at.setdefault(s["step"] - 1 - k, []).append((s["actors/gen_seconds_per_group"], c))
    win = [s for s in steps if s["step"] > skip]
    normal = [busy[s["step"]] for s in win if s["step"] - 1 not in paused]
    step_s, gen = statistics.mean(normal), [s["actors/gen_seconds_per_group"] for s in win]
    step_time = {s["step"]: s["time"] for s in steps}
    evals = [e["time"] - step_time[e["step"]] for e in run.evals if e["step"] in step_time and skip < e["step"] < K]
    eval_s = statistics.mean(evals) if evals else 0.0
    ck_extra = [busy[v + 1] - step_s - (eval_s if ev and v % ev == 0 else 0.0) for v in paused
                if ck and v % ck == 0 and v > skip and v + 1 in busy]
    bcast = [s["sync/broadcast_seconds"] for s in win if s["sync/broadcast_seconds"] > 0]
    p = Params(actors=cfg["actors"]["count"], batch_groups=B, group_size=G,
               groups_per_request=cfg["actors"]["groups_per_request"], max_staleness=cfg["max_staleness"],
               sync_every=cfg["sync"]["every"], steps=K, gen_seconds_per_group=[statistics.mean(gen)],
               step_seconds=step_s, sync_seconds=statistics.mean(s["sync/seconds"] for s in win),
               broadcast_seconds=min(bcast, default=0.0),
               eval_every=ev, eval_seconds=eval_s, checkpoint_every=ck,
               checkpoint_seconds=max(0.0, statistics.mean(ck_extra)) if ck_extra else 0.0,
               learner_ranks=cfg["learner"]["ranks"], gen_cv=_cv(gen), step_cv=_cv(normal),
               step_replay=[step_s if v in paused else busy.get(v + 1, step_s) for v in range(K)],
               gen_replay=[sum(g * c for g, c in gen_at[v]) / sum(c for _, c in gen_at[v]) if v in gen_at
                           else statistics.mean(gen) for v in range(max(gen_at, default=0) + 1)])
    if span_gen:  # the engine's own clock leaves out the span's prompt and result handling: rescale
        scale = span_gen / statistics.mean(gen)
        p = replace(p, gen_seconds_per_group=[g * scale for g in p.gen_seconds_per_group],
                    gen_replay=[g * scale for g in p.gen_replay])
    p = replace(p, **traced)
    measured = window_summary(log, skip, B * G)
    measured.update(broadcast_seconds_mean=statistics.mean(bcast) if bcast else 0.0, from_trace=bool(traced))
    return p, measured


def calibrate(run_dir: Path, *, skip: int | None = None, seeds: int = 5, use_trace: bool = True) -> dict:
    p, measured = measure_run(run_dir, skip, use_trace)
    replay, flat = replace(p, gen_cv=0.1, step_cv=0.1), stationary(p)  # replayed series carry their variation
    for q in (replay, flat) if not measured["from_trace"] and measured["broadcast_seconds_mean"] else ():
        for _ in range(5):  # the transfer time that makes the model's broadcast time the measured one
            gap = measured["broadcast_seconds_mean"] - simulate(q, 2, skip)["broadcast_seconds_mean"]
            q.broadcast_seconds = max(0.0, q.broadcast_seconds + gap)
    pred, mean = simulate(replay, seeds, skip), simulate(flat, seeds, skip)
    out = {"run": str(run_dir)}
    for key in ("samples_per_s", "staleness_mean", "idle_frac"):
        out |= {f"predicted_{key}": round(pred[key], 4), f"measured_{key}": round(measured[key], 4),
                f"stationary_{key}": round(mean[key], 4)}
    return out | {
        "predicted_staleness_dist": {str(k): round(f, 4) for k, f in pred["staleness_dist"].items()},
        "measured_staleness_dist": {str(k): round(f, 4) for k, f in measured["staleness_dist"].items()},
        "predicted_broadcast_seconds_mean": round(pred["broadcast_seconds_mean"], 5),
        "measured_broadcast_seconds_mean": round(measured["broadcast_seconds_mean"], 5),
        "window_steps": measured["window_steps"], "window_seconds": round(measured["window_seconds"], 3),
        "from_trace": measured["from_trace"], "rates": rates(flat)}


def rates(p: Params) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(p).items() if "replay" not in k}


# -- sweep ----------------------------------------------------------------------------------
def sweep(p: Params, actors: list[int], staleness: list[int], *, target: float = 0.95, seeds: int = 3,
          cores: float | None = None, png: Path | None = None) -> str:
    util, rate = {}, {}
    for eta in staleness:
        for n in actors:
            q = replace(with_actors(stationary(p), n, cores), max_staleness=eta, sync_every=min(p.sync_every, eta + 1))
            out = simulate(q, seeds=seeds)
            util[eta, n], rate[eta, n] = 1 - out["idle_frac"], out["samples_per_s"]
    lines = [f"Learner utilization (1 - idle fraction) · samples/s. Learner step {p.step_seconds * 1e3:.1f} ms "
             f"+ sync {p.sync_seconds * 1e3:.1f} ms; generation {p.gen_seconds_per_group[0] * 1e3:.2f} "
             f"+ {p.overhead_seconds_per_group * 1e3:.2f} ms per group; B={p.batch_groups}, G={p.group_size}, "
             f"{p.groups_per_request} groups per request, sync every {p.sync_every}; "
             + (f"CPU times scaled for {cores:g} shared cores." if cores else "each actor on its own device."), "",
             "| actors | " + " | ".join(f"max_staleness {e}" for e in staleness) + " |",
             "|---|" + "---|" * len(staleness)]
    lines += [f"| {n} | " + " | ".join(f"{util[e, n]:.1%} · {rate[e, n]:.0f}" for e in staleness) + " |"
              for n in actors] + [""]
    for e in staleness:
        enough = [n for n in actors if util[e, n] >= target]
        lines.append(f"- max_staleness {e}: " + (f"{enough[0]} actor(s) per learner for {target:.0%} utilization"
                                                if enough else f"{target:.0%} not reached with {max(actors)} actors"))
    if png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for e in staleness:
            ax.plot(actors, [util[e, n] for n in actors], marker="o", label=f"max_staleness {e}")
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set(xlabel="actors per learner", ylabel="learner utilization", ylim=(0, 1.02), title="simulated pipeline")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
    return "\n".join(lines)


def parse_range(items: list[str]) -> list[int]:
    out: list[int] = []
    for item in items:
        lo, _, hi = item.partition("..")
        out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", metavar="RUN", type=Path, help="rates from this run directory")
    ap.add_argument("--no-trace", action="store_true", help="ignore RUN/trace.json (metrics.jsonl + config only)")
    ap.add_argument("--sweep", action="store_true", help="markdown table of utilization, --actors x --staleness")
    ap.add_argument("--actors", nargs="+", help="count; for --sweep counts and ranges (1..16)")
    ap.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2, 4], help="--sweep: max_staleness values")
    ap.add_argument("--png", type=Path, default=Path("simulate_sweep.png"), help="--sweep: plot file")
    ap.add_argument("--target", type=float, default=0.95, help="--sweep: utilization target")
    ap.add_argument("--cores", type=float, help="CPU cores shared by actors and learner ranks (contention)")
    ap.add_argument("--skip", type=int, help="steps left out at the start of the window")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gen-seconds-per-group", type=float, nargs="+", help="one per actor, cycled")
    ap.add_argument("--broadcast-coupled", action="store_true", default=None)
    for name in ("overhead-seconds-per-group", "step-seconds", "log-seconds", "sync-seconds", "broadcast-seconds",
                 "request-seconds", "eval-seconds", "checkpoint-seconds", "gen-cv", "step-cv"):
        ap.add_argument(f"--{name}", type=float)
    for name in ("batch-groups", "group-size", "groups-per-request", "max-staleness", "sync-every", "steps",
                 "eval-every", "checkpoint-every", "learner-ranks"):
        ap.add_argument(f"--{name}", type=int)
    args = ap.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None and k in Params.__dataclass_fields__}
    if args.calibrate and not args.sweep and not given:
        print(json.dumps(calibrate(args.calibrate, skip=args.skip, seeds=args.seeds, use_trace=not args.no_trace)))
        return 0
    p = stationary(measure_run(args.calibrate, args.skip, not args.no_trace)[0]) if args.calibrate else Params()
    p = replace(p, **{k: v for k, v in given.items() if k != "actors"})  # explicit values override the run's
    if args.sweep:
        p.steps = args.steps or 400
        print(sweep(p, parse_range(args.actors or ["1..16"]), args.staleness, target=args.target,
                    seeds=min(args.seeds, 3), cores=args.cores, png=args.png))
        print(f"\nplot: {args.png}")
        return 0
    p = with_actors(p, parse_range(args.actors)[0] if args.actors else p.actors, args.cores)
    out = simulate(p, seeds=args.seeds, skip=args.skip)
    print(json.dumps({f"predicted_{k}": round(out[k], 4) for k in ("samples_per_s", "idle_frac", "staleness_mean")}
                     | {"predicted_staleness_dist": {str(k): round(f, 4) for k, f in out["staleness_dist"].items()},
                        "rates": rates(p)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
