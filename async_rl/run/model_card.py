"""final/README.md: which weights a run handed out, the precision they were measured in,
and what they scored, so that whoever takes the model knows what was measured.

The learner writes it with final/ (`card_text`); `async-rl train` adds the scores of
eval.final_dtypes when the run ends (`add_scores`); the summary reads both back.
"""
from __future__ import annotations

import json
from pathlib import Path

CARD_FILE = "README.md"
MASTER_DIR = "final-master"  # beside final/: the float32 master weights, on request
SCORES_MARK = "Scored again when the run ended"


def card_text(*, dtype: str, step: int, last_eval: dict | None, engine: str, master: bool) -> str:
    """The card of a final/ written in `dtype` at `step`; `last_eval`: the run's last
    evaluation line (its policy version is `last_eval["step"]`)."""
    if last_eval is not None and last_eval.get("step") == step:
        measured = (f"Held-out accuracy in the run: **{last_eval['eval/accuracy']:.3f}** at step {step} "
                    f"({last_eval.get('eval/prompts', 0):.0f} prompts), scored by the run's {engine} actors "
                    f"in {dtype} with these very weights.")
    else:
        measured = f"No evaluation of step {step}'s weights finished in the run."
    where = (f"The learner's float32 master weights are in ../{MASTER_DIR}/: they differ from these below "
             "16-bit resolution, and nothing in the run sampled or scored them.") if master and dtype != "float32" \
        else ""
    return "\n\n".join(filter(None, [
        "# A policy trained with async-rl",
        f"Weights: **{dtype}**, as the run's actors held them at step {step}: the policy they sampled with "
        "and were evaluated in.",
        measured, where,
        "Score it again with `async-rl eval RUN_DIR/config.yaml RUN_DIR/final` (add "
        "`actors.engine.dtype=float32` for another precision).",
    ])) + "\n"


def add_scores(final_dir: Path, scores: dict[str, float]) -> None:
    """Append the end-of-run scores ({dtype: accuracy}) to final/'s card."""
    text = ", ".join(f"{accuracy:.3f} in {dtype}" for dtype, accuracy in scores.items())
    with open(final_dir / CARD_FILE, "a") as card:
        card.write(f"\n{SCORES_MARK} (`async-rl eval`, the torch engine): {text}.\n")


def final_dtype(final_dir: Path) -> str | None:
    """The dtype final/'s weights were written in (its config.json), None if unknown."""
    try:
        config = json.loads((final_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return str(dtype) if dtype else None


FINAL_SCORE = "final/accuracy_"  # + dtype: a metrics.jsonl line of the end-of-run scores


def score_final(run_dir: Path, step: int, dtypes: list[str], threads: int, timeout_s: float,
                stopping=lambda: False) -> dict[str, float] | str:
    """Score RUN_DIR/final with `async-rl eval` in each of `dtypes` (a process each, as a
    user would, on as many threads as an actor evaluates with), append the scores to its
    card and to metrics.jsonl; returns them ({dtype: accuracy}) or why they could not be
    had, in one line. `stopping()` true (a stop signal) ends a scoring at once."""
    import subprocess
    import sys
    import time

    final, scores = run_dir / "final", {}
    for dtype in dtypes:
        cmd = [sys.executable, "-m", "async_rl.cli", "eval", str(run_dir / "config.yaml"), str(final),
               f"actors.engine.dtype={dtype}", "--threads", str(threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # a Ctrl-C is the launcher's to act on
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and not stopping() and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            return "scoring final/ was stopped" if stopping() else \
                f"scoring final/ in {dtype} took over {timeout_s:.0f} s (learner.timeout_s); given up"
        out, err = proc.communicate()
        try:
            scores[dtype] = json.loads(out.splitlines()[0])["eval/accuracy"]
        except (IndexError, ValueError, KeyError):
            last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            return f"scoring final/ in {dtype} failed: {last}"
    add_scores(final, scores)
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": step, **{f"{FINAL_SCORE}{dtype}": accuracy
                                                   for dtype, accuracy in scores.items()}}) + "\n")
    return scores
