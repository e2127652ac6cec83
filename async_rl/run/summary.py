"""The one-screen summary `async-rl train` prints when a run ends, from metrics.jsonl
alone (so it is also right for a resumed run, whose file holds every step once)."""
from __future__ import annotations

from pathlib import Path

from async_rl.run.directory import RunDir, staleness_counts
from async_rl.run.model_card import FINAL_SCORE, MASTER_DIR, final_dtype


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_lines(run_dir: Path) -> list[str]:
    run = RunDir(run_dir)
    steps, evals = run.steps_and_evals()
    # Evaluation lines arrive when the actors finish a round, possibly after later steps.
    evals = sorted(evals, key=lambda line: line["step"])
    if not steps:
        return []
    last = steps[-1]
    wall = max(last["time"], 1e-9)
    counts = staleness_counts(steps)
    total = sum(counts.values()) or 1
    histogram = " ".join(f"{k}:{100 * n / total:.0f}%" for k, n in counts.items())
    ess = [s["is/ess"] for s in steps if s.get("is/ess") is not None]
    gen = [s["actors/gen_tokens_per_s"] for s in steps if s.get("actors/gen_tokens_per_s")]
    trained = _mean([s["throughput/gen_tokens_per_s"] for s in steps])
    rows = [
        ("steps", f"{last['step']} in {wall:.0f} s ({last['step'] / wall:.2f} steps/s), {last['train/samples']} "
                  f"samples ({last['train/samples'] / wall:.0f}/s), {trained:.0f} response tokens/s trained"
                  + (f"; an actor generates {_mean(gen):.0f} tokens/s while generating" if gen else "")),
        ("learner", f"idle {100 * _mean([s['learner/idle_frac'] for s in steps]):.1f}% waiting for data, "
                    f"sync {_mean([s['sync/seconds'] for s in steps]) * 1e3:.1f} ms/step, "
                    f"skipped steps {last.get('learner/skipped_steps', 0)}"),
        ("staleness", f"mean {_mean([s['staleness/mean'] for s in steps]):.2f}, max "
                      f"{max(s['staleness/max'] for s in steps)}, dropped {last['staleness/dropped']}"
                      + (f"; samples by staleness {histogram}" if counts else "")),
        ("off-policy", f"IS-weight ESS mean {_mean(ess):.3f}, min {min(ess):.3f}" if ess else "IS-weight ESS n/a"),
        ("actors", f"{last['actors/live']} live at step {last['step']}; {last['data/prompts_admitted']} prompts "
                   f"admitted, {last['data/prompts_consumed']} consumed; {last['wire/rejected']} messages rejected"),
    ]
    if last.get("memory/learner_peak_rss_gb"):
        actor = max(s.get("memory/actor_peak_rss_gb", 0) for s in steps)
        rows.append(("memory", f"peak resident {last['memory/learner_peak_rss_gb']:.2f} GiB per learner rank "
                               f"(largest), {actor:.2f} GiB per actor"))
    if last.get("data/prompts_skipped"):
        rows.append(("skipped", f"{last['data/prompts_skipped']} prompts over the prompt limit "
                                "(task.max_prompt_tokens)"))
    # reward.on_failure=exclude shows in the steps as unscorable samples; fallback as none.
    excluded = any(s.get("reward/unscorable_frac") for s in steps)
    fate = "their samples left out of training (unscorable)" if excluded else "scored reward.fallback"
    for prefix, what in (("reward", "reward"), ("env", "environment")):
        if last.get(f"{prefix}/errors"):
            by_reason = ", ".join(f"{k.removeprefix(f'{prefix}/errors_')} {v}" for k, v in last.items()
                                  if k.startswith(f"{prefix}/errors_"))
            rows.append((what, f"{last[f'{prefix}/errors']} {what} calls failed ({by_reason}), {fate}"))
    dropped = sum(s.get("reward/groups_dropped", 0) for s in steps)
    if dropped:
        rows.append(("dropped", f"{dropped} groups left with fewer than 2 scorable samples, not trained on"))
    cut = sum(s.get("env/observations_cut", 0) for s in steps)
    if cut:
        rows.append(("env cuts", f"{cut} episodes ended truncated by an environment answer longer than they "
                                 "could take (env/observations_cut)"))
    if evals:
        rows.append(("eval", f"accuracy {evals[0]['eval/accuracy']:.3f} (step {evals[0]['step']}) -> "
                             f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']})"))
    final = run.final_model()
    model = f"model {final}" if final else "no final model (the learner did not get to write it)"
    if final and final_dtype(final):
        model += f" ({final_dtype(final)}, as the actors ran it" + \
            (f"; float32 master weights in {MASTER_DIR}/)" if (run.path / MASTER_DIR).exists() else ")")
    rows.append(("outputs", f"{model}; tensorboard --logdir {run.tensorboard_dir}"))
    scores = {key.removeprefix(FINAL_SCORE): value for record in run.metrics() for key, value in record.items()
              if key.startswith(FINAL_SCORE)}
    if final and scores:
        rows.insert(-1, ("final", "accuracy " + ", ".join(f"{accuracy:.3f} in {dtype}" for dtype, accuracy
                                                          in scores.items()) + " (final/ scored as the run ended)"))
    width = max(len(name) for name, _ in rows)
    return [f"async-rl: {name:<{width}}  {text}" for name, text in rows]
