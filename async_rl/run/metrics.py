"""Run metrics: one flat JSON object per line in metrics.jsonl, the same scalars in
TensorBoard (RUN_DIR/tb), and a console progress bar. Only learner rank 0 writes.

TensorBoard also gets what does not fit a flat line: per-step histograms (staleness
per sample, importance weights, response lengths, rewards), a few sample generations
as text, and a custom-scalars layout (the "Custom Scalars" tab) that groups related
curves on one chart."""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from async_rl.run.directory import RunDir
from async_rl.run.disk import quiet_disk_full_in_threads, writing
from async_rl.run.samples import SAMPLES_FILE, truncate_samples

# Keys every step line carries (the run directory contract, docs/observability.md); tests check them against this list.
STEP_KEYS = (
    "step", "version", "time", "train/reward_mean", "train/samples", "loss/total",
    "staleness/mean", "staleness/max", "staleness/dropped", "is/ess", "is/clip_frac",
    "throughput/samples_per_s", "throughput/gen_tokens_per_s", "learner/idle_frac",
    "sync/seconds", "wire/rejected", "actors/live", "data/prompts_admitted",
    "data/prompts_consumed",
)
EVAL_KEYS = ("step", "version", "time", "eval/accuracy", "eval/reward_mean")

# Histogram tags, one value per sample (per response token for the weights). Distinct
# from the scalar tags: TensorBoard keeps one plugin per tag.
HISTOGRAM_TAGS = ("staleness/per_sample", "is/weight", "is/seq_log_ratio", "train/response_len", "train/reward")
GENERATIONS_TAG = "samples/generations"
GENERATION_ROWS = 4

# "Custom Scalars" tab: category -> chart -> ["Multiline", tag regexes].
CUSTOM_SCALARS = {
    "staleness": {
        "staleness (versions)": ["Multiline", [r"^staleness/mean$", r"^staleness/max$",
                                               r"^actors/token_staleness_mean$"]],
        "samples spanning versions (sync.in_flight)": ["Multiline", [r"^actors/mixed_version_frac$"]],
        "samples per staleness value": ["Multiline", [r"^staleness/count_\d+$"]],
        "dropped as too stale": ["Multiline", [r"^staleness/dropped$"]],
    },
    "throughput": {
        "samples/s": ["Multiline", [r"^throughput/samples_per_s$"]],
        "tokens/s (learner consumed, one actor generating)": ["Multiline", [r"^throughput/gen_tokens_per_s$",
                                                                             r"^actors/gen_tokens_per_s$"]],
        "learner idle fraction": ["Multiline", [r"^learner/idle_frac$"]],
        "actor generation seconds per group": ["Multiline", [r"^actors/gen_seconds_per_group$"]],
    },
    "off-policy": {
        "mismatch KL(behavior || proximal), k3 and k1": ["Multiline", [r"^is/mismatch_kl$", r"^is/mismatch_k1$"]],
        "token ratio: min, q01, q50, q99, max": ["Multiline", [r"^is/ratio_(min|q01|q50|q99|max)$"]],
        "sequence log-ratio: min, q01, q50, q99, max": ["Multiline", [r"^is/seq_log_ratio_"]],
        "masked and truncated shares": ["Multiline", [r"^is/masked_frac$", r"^is/masked_seq_frac$",
                                                      r"^is/truncated_frac$"]],
        "effective sample size": ["Multiline", [r"^is/ess$"]],
    },
    "losses": {
        "losses": ["Multiline", [r"^loss/"]],
        "gradient norm": ["Multiline", [r"^learner/grad_norm$", r"^critic/grad_norm$"]],
    },
    "sync": {
        "weight sync seconds": ["Multiline", [r"^sync/seconds$", r"^sync/broadcast_seconds$"]],
        "live actors": ["Multiline", [r"^actors/live$"]],
    },
    "memory": {
        "peak resident memory (GiB)": ["Multiline", [r"^memory/"]],
    },
}


def batch_histograms(groups: Sequence[Any], staleness: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-sample distributions of one batch (ExperienceGroup messages and each group's
    staleness); the learner adds the importance weights after its step."""
    per_group = [len(g.response_lengths) for g in groups]
    return {"staleness/per_sample": np.repeat(np.asarray(staleness, dtype=np.int64), per_group),
            "train/response_len": np.concatenate([g.response_lengths for g in groups]),
            "train/reward": np.concatenate([g.rewards for g in groups])}


def version_mix(groups: Sequence[Any], learner_version: int) -> dict[str, float]:
    """What in-flight weight updates (sync.in_flight) did to one batch of ExperienceGroups:
    the fraction of samples whose tokens came from more than one policy version, and the
    staleness of each sample's tokens (each counted from its own version), averaged
    within the sample, then over samples. A sample's staleness (`staleness/*`) counts
    from its oldest token, so `staleness/mean` is never below the token figure, and is
    above it whenever some sample spans versions."""
    # Flat over the batch: the groups' responses end to end, cut at their starts.
    versions = np.concatenate([g.token_versions for g in groups]).astype(np.int64)
    lengths = np.concatenate([g.response_lengths for g in groups]).astype(np.int64)
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]  # a response without tokens has no token staleness
    if not starts.size:
        return {"actors/mixed_version_frac": 0.0, "actors/token_staleness_mean": 0.0}
    mixed = np.maximum.reduceat(versions, starts) > np.minimum.reduceat(versions, starts)
    token_staleness = learner_version - np.add.reduceat(versions, starts) / lengths[lengths > 0]
    return {"actors/mixed_version_frac": float(mixed.sum()) / len(lengths),
            "actors/token_staleness_mean": float(token_staleness.mean())}


def _cell(text: str) -> str:
    """Markdown table cell: TensorBoard renders text summaries as markdown."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ") or " "


def generations_table(groups: Sequence[Any], prompt_format, rows: int = GENERATION_ROWS) -> str:
    """The first response of the batch's first `rows` groups, as a markdown table; the
    text as the model saw and wrote it (special tokens kept, a cut response marked)."""
    lines = ["| prompt | response | reward | version |", "|---|---|---|---|"]
    for g in groups[:rows]:
        prompt = prompt_format.display(np.asarray(g.prompt_tokens).tolist(), truncated=False)
        response = prompt_format.display(g.responses()[0].tokens.tolist(), truncated=bool(g.truncated[0]))
        lines.append(f"| {_cell(prompt)} | {_cell(response)} | {float(g.rewards[0]):.3g} | {g.version} |")
    return "\n".join(lines)


PROGRESS_EVERY_S = 15.0  # the progress line's period when the console is not a terminal


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, *, resume_step: int = 0, elapsed: float = 0.0):
        """`resume_step`/`elapsed`: where a resumed run continues; later lines of the
        stopped run are dropped, so every step appears once."""
        from torch.utils.tensorboard import SummaryWriter  # import late: slow, rank 0 only

        self.start = time.time() - elapsed
        if resume_step:
            RunDir(run_dir).truncate_metrics(resume_step)
            truncate_samples(run_dir, resume_step)
        self._samples_path = Path(run_dir) / SAMPLES_FILE
        self._metrics_path, self._tb_dir = RunDir(run_dir).metrics_path, Path(run_dir) / "tb"
        quiet_disk_full_in_threads()  # TensorBoard's writer thread: its error comes back through our calls
        with writing("metrics", self._metrics_path):
            self._file = open(self._metrics_path, "a", buffering=1)
        with writing("TensorBoard events in", self._tb_dir):
            # purge_step hides the stopped run's TensorBoard events after the checkpoint.
            self._tb = SummaryWriter(log_dir=str(self._tb_dir), purge_step=resume_step + 1 if resume_step else None)
            self._tb.add_custom_scalars(CUSTOM_SCALARS)
        # A bar on a terminal; in a log file, where a bar's redraws run into one line with
        # whatever else is written, a plain line every PROGRESS_EVERY_S instead.
        self._bar = tqdm(total=total_steps, initial=resume_step, desc="train", unit="step", dynamic_ncols=True,
                         mininterval=0.2, disable=not sys.stderr.isatty())
        self._total, self._last_line = total_steps, time.monotonic()
        # Log lines go through tqdm while the bar is shown, each on a line of its own.
        self._logging = logging_redirect_tqdm()
        self._logging.__enter__()
        self._last_eval: float | None = None

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, record: dict[str, Any], *, histograms: dict[str, Any] | None = None,
            texts: dict[str, str] | None = None, samples: list[dict[str, Any]] | None = None) -> None:
        """`record`: one metrics.jsonl line (its numbers also go to TensorBoard);
        `histograms` (tag -> values) and `texts` (tag -> markdown): TensorBoard only;
        `samples`: lines of samples.jsonl (run/samples.py)."""
        if samples:
            with writing("samples", self._samples_path), open(self._samples_path, "a") as out:
                out.write("".join(json.dumps(sample) + "\n" for sample in samples))
        record = {"time": round(self.elapsed(), 3), **record}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with writing("metrics", self._metrics_path):
            self._file.write(json.dumps(clean) + "\n")
        step = int(record["step"])
        with writing("TensorBoard events in", self._tb_dir):
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and value is not None:
                    self._tb.add_scalar(key, value, step)
            for tag, values in (histograms or {}).items():
                values = np.asarray(values, dtype=np.float64).reshape(-1)
                if values.size:  # TensorBoard refuses an empty histogram
                    self._tb.add_histogram(tag, values, step)
            for tag, text in (texts or {}).items():
                self._tb.add_text(tag, text, step)
        if "eval/accuracy" in record:
            self._last_eval = record["eval/accuracy"]
            self._bar.write(f"step {step:4d}  eval accuracy {record['eval/accuracy']:.3f}")
        if "loss/total" in record:
            last_eval = self._last_eval if self._last_eval is not None else float("nan")
            status = (f"reward {record['train/reward_mean']:.2f} eval {last_eval:.2f} "
                      f"stale {record['staleness/mean']:.2f}/{record['staleness/max']} "
                      f"{record['throughput/samples_per_s']:.0f} samples/s")
            if not self._bar.disable:
                self._bar.update(step - self._bar.n)
                self._bar.set_postfix_str(status, refresh=False)
            elif time.monotonic() - self._last_line >= PROGRESS_EVERY_S or step == self._total:
                self._last_line = time.monotonic()
                print(f"train: step {step}/{self._total}  {status}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._logging.__exit__(None, None, None)
        self._bar.close()
        try:
            with writing("TensorBoard events in", self._tb_dir):
                self._tb.flush()
                self._tb.close()
        finally:
            with writing("metrics", self._metrics_path):
                self._file.close()
