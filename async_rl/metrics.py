"""Run metrics: one flat JSON object per line in metrics.jsonl, the same scalars in
TensorBoard (RUN_DIR/tb), and a console progress bar. Only learner rank 0 writes."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

# Keys every step line carries (DESIGN.md contract); tests check them against this list.
STEP_KEYS = (
    "step", "version", "time", "train/reward_mean", "train/samples", "loss/total",
    "staleness/mean", "staleness/max", "staleness/dropped", "is/ess", "is/clip_frac",
    "throughput/samples_per_s", "throughput/gen_tokens_per_s", "learner/idle_frac",
    "sync/seconds", "wire/rejected", "actors/live", "data/prompts_admitted",
    "data/prompts_consumed",
)
EVAL_KEYS = ("step", "version", "time", "eval/accuracy", "eval/reward_mean")


def truncate_after(path: Path, step: int) -> None:
    """Keep the lines a run resumed at `step` will not write again: step lines up to
    `step`, evaluation lines before it (the resumed run evaluates at `step` first)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # the line a killed run was writing
        limit = step if "loss/total" in record else step - 1
        if record.get("step", 0) <= limit:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, *, resume_step: int = 0, elapsed: float = 0.0):
        """`resume_step`/`elapsed`: where a resumed run continues; later lines of the
        stopped run are dropped, so every step appears once."""
        from torch.utils.tensorboard import SummaryWriter  # import late: slow, rank 0 only

        self.start = time.time() - elapsed
        if resume_step:
            truncate_after(run_dir / "metrics.jsonl", resume_step)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        # purge_step hides the stopped run's TensorBoard events after the checkpoint.
        self._tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)
        # Redraw often on a terminal, rarely in a log file.
        interactive = sys.stderr.isatty()
        self._bar = tqdm(total=total_steps, initial=resume_step, desc="train", unit="step", dynamic_ncols=True,
                         mininterval=0.2 if interactive else 15.0)
        self._last_eval: float | None = None

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": round(self.elapsed(), 3), **record}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = int(record["step"])
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and value is not None:
                self._tb.add_scalar(key, value, step)
        if "eval/accuracy" in record:
            self._last_eval = record["eval/accuracy"]
            self._bar.write(f"step {step:4d}  eval accuracy {record['eval/accuracy']:.3f}")
        if "loss/total" in record:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(
                f"reward {record['train/reward_mean']:.2f} eval {self._last_eval if self._last_eval is not None else float('nan'):.2f} "
                f"stale {record['staleness/mean']:.2f}/{record['staleness/max']} "
                f"{record['throughput/samples_per_s']:.0f} samples/s", refresh=False)

    def close(self) -> None:
        self._bar.close()
        self._tb.flush()
        self._tb.close()
        self._file.close()
