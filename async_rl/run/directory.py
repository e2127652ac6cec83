"""A run directory: its layout, and the one reader of the files a run leaves there.

    run = RunDir("runs/demo-...")
    run.config()["max_staleness"], run.steps()[-1]["loss/total"], run.evals(), run.status()
    run.endpoints()["hub"], run.trace(), run.checkpoints(), run.final_model()

    RUN_DIR/
      config.yaml      the fully resolved config
      metrics.jsonl    one JSON object per learner step and per evaluation
      samples.jsonl    whole samples as trained, with metrics.samples_every (run/samples.py)
      status.json      how the learner ended: {"exit_code": int, "reason": str}
      endpoints.json   the hub's addresses and the pids of the learner and live actors
      trace.json       the timeline, Chrome trace format (run/tracing.py)
      checkpoints/     resumable checkpoints (learner/checkpoint.py)
      final/           the trained model as the actors held it (their dtype), a Hugging Face
                       directory with a README.md card (LoRA: a peft adapter)
      final-master/    the learner's float32 master weights (checkpoint.final_master)
      logs/ tb/        process logs; TensorBoard events
      base_model/      the demo model a run with model.path=demo starts from
      analysis/        figures written by the analysis scripts
      evaluator/       versions for the evaluator and its results (evaluator/versions.py)
      reserved-room    64 KiB set aside while the learner runs, for the last words of a
                       run that fills its disk (run/disk.py)
      actors_not_restarted.json   the last local actor not restarted (run/status.py)

Every reader is a snapshot of a directory a live run may still be writing: the files
written by rename (status, endpoints, trace) are whole or absent, and metrics.jsonl may
end in a line half written when its writer was killed; that line is skipped.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from async_rl.run.checkpoints import complete_checkpoints

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
ENDPOINTS_FILE = "endpoints.json"
TRACE_FILE = "trace.json"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
FINAL_WEIGHTS = ("model.safetensors", "adapter_model.safetensors")  # a whole model, or a LoRA adapter
LOGS_DIR = "logs"
TENSORBOARD_DIR = "tb"
BASE_MODEL_DIR = "base_model"
ANALYSIS_DIR = "analysis"

# What tells the two kinds of metrics.jsonl line apart (docs/observability.md: step lines carry
# loss/total, evaluation lines eval/accuracy).
STEP_MARK = "loss/total"
EVAL_MARK = "eval/accuracy"
STALENESS_COUNT = "staleness/count_"  # + k: a step's samples of staleness k
TAIL_BYTES = 65536  # last_step() reads this much of the end of metrics.jsonl


def is_step(record: dict) -> bool:
    return STEP_MARK in record


def is_eval(record: dict) -> bool:
    return EVAL_MARK in record


def step_staleness_counts(step: dict) -> dict[int, int]:
    """One step line's samples per staleness value k, by k."""
    return dict(sorted((int(key[len(STALENESS_COUNT):]), int(value)) for key, value in step.items()
                       if key.startswith(STALENESS_COUNT)))


def staleness_counts(steps: list[dict]) -> dict[int, int]:
    """Samples per staleness value k over `steps`, by k."""
    counts: dict[int, int] = {}
    for step in steps:
        for k, n in step_staleness_counts(step).items():
            counts[k] = counts.get(k, 0) + n
    return dict(sorted(counts.items()))


def parse_jsonl(text: str, *, strict: bool = False, where: str = "") -> list[tuple[str, dict]]:
    """(line, object) for each JSON object line of `text`. A blank line, or one that is
    not a whole object (the one a killed writer left half written), is skipped, or with
    `strict` raised as ValueError naming `where` and its line number."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() and not strict:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            out.append((line, record))
        elif strict:
            raise ValueError(f"{where}:{number}: not a JSON object: {line[:80]!r}")
    return out


@dataclass
class TraceSpan:
    """One complete event of trace.json."""
    track: str  # the process track: "learner", "actor-0", ...
    name: str  # generate, score, push, wait-for-admission, train-step, sync, wait-for-data, ...
    start_s: float  # seconds since the epoch
    dur_s: float
    args: dict = field(default_factory=dict)


def track_role(track: str) -> str:
    """The role of a trace track: learner, learner-1 -> learner; actor-0 -> actor."""
    return re.sub(r"-\d+$", "", track)


def read_trace(path: Path) -> list[TraceSpan] | None:
    """Chrome trace format: complete events ("ph": "X", microseconds) and the
    "process_name" metadata events that name each pid's track. None without the file."""
    path = Path(path)
    if not path.exists():
        return None
    events = json.loads(path.read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [TraceSpan(names.get(e["pid"], str(e["pid"])), e["name"], e["ts"] / 1e6, e["dur"] / 1e6, e.get("args", {}))
            for e in events if e.get("ph") == "X"]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class RunDir:
    """Paths and readers of one run directory; every call reads the files afresh."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    # -- layout ---------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def endpoints_path(self) -> Path:
        return self.path / ENDPOINTS_FILE

    @property
    def trace_path(self) -> Path:
        return self.path / TRACE_FILE

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def final_dir(self) -> Path:
        return self.path / FINAL_DIR

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS_DIR

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / TENSORBOARD_DIR

    @property
    def base_model_dir(self) -> Path:
        return self.path / BASE_MODEL_DIR

    @property
    def analysis_dir(self) -> Path:
        return self.path / ANALYSIS_DIR

    # -- readers ----------------------------------------------------------------------------
    def config(self) -> dict:
        """config.yaml as plain data; {} when there is none."""
        return (yaml.safe_load(self.config_path.read_text()) or {}) if self.config_path.exists() else {}

    def metrics(self, *, strict: bool = False) -> list[dict]:
        """Every line of metrics.jsonl in file order ([] before the first). `strict`: the
        file must exist and hold only whole JSON objects (a finished run's)."""
        if not strict and not self.metrics_path.exists():
            return []
        return [record for _, record in parse_jsonl(self.metrics_path.read_text(), strict=strict,
                                                    where=str(self.metrics_path))]

    def steps(self, *, strict: bool = False) -> list[dict]:
        """The step lines, in file order."""
        return [r for r in self.metrics(strict=strict) if is_step(r)]

    def evals(self, *, strict: bool = False) -> list[dict]:
        """The evaluation lines, in file order (a round may end after later steps)."""
        return [r for r in self.metrics(strict=strict) if is_eval(r)]

    def steps_and_evals(self, *, strict: bool = False) -> tuple[list[dict], list[dict]]:
        """(step lines, evaluation lines) from one read of the file."""
        records = self.metrics(strict=strict)
        return [r for r in records if is_step(r)], [r for r in records if is_eval(r)]

    def last_step(self) -> int:
        """The newest step line's step, 0 before the first. Reads only the end of the file:
        cheap enough to poll while the run trains."""
        if not self.metrics_path.exists():
            return 0
        with open(self.metrics_path, "rb") as f:
            f.seek(max(0, self.metrics_path.stat().st_size - TAIL_BYTES))
            tail = f.read().decode(errors="replace")
        # The tail's first line may be cut by the seek: parse_jsonl skips it.
        records = [record for _, record in parse_jsonl(tail)]
        return next((r["step"] for r in reversed(records) if is_step(r)), 0)

    def status(self) -> dict | None:
        """{"exit_code": int, "reason": str} once the learner has ended; else None."""
        return _read_json(self.status_path)

    def endpoints(self) -> dict | None:
        """{"hub": ..., "experience": ..., "learner_pid": ..., "actors": [{"id", "pid", ...}]}
        once the coordinator has published them; else None."""
        return _read_json(self.endpoints_path)

    def wait_for_hub(self, timeout_s: float, give_up: Callable[[], str | None] = lambda: None) -> str:
        """The hub's address, once the coordinator has published endpoints.json (a launch
        removes the previous run's first). RuntimeError after `timeout_s`, or as soon as
        `give_up()` returns a reason."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (reason := give_up()) is not None:
                raise RuntimeError(reason)
            endpoints = self.endpoints()
            if endpoints is not None:
                return endpoints["hub"]
            time.sleep(0.1)
        raise RuntimeError(f"the learner's hub did not come up within {timeout_s:.0f}s")

    def trace(self) -> list[TraceSpan] | None:
        """The timeline's spans; None when the run wrote no trace.json."""
        return read_trace(self.trace_path)

    def checkpoints(self) -> list[Path]:
        """Committed checkpoints, oldest first, unverified (checkpoint_integrity.complete_checkpoints)."""
        return complete_checkpoints(self.checkpoints_dir)

    def final_model(self) -> Path | None:
        """final/ once the learner has written its weights there; else None."""
        return self.final_dir if any((self.final_dir / name).exists() for name in FINAL_WEIGHTS) else None

    def load(self) -> Run:
        """Everything the analysis scripts read, at once."""
        steps, evals = self.steps_and_evals()
        return Run(self.path, self.config(), steps, evals, self.trace())

    # -- resume --------------------------------------------------------------------------
    def truncate_metrics(self, step: int) -> None:
        """Keep the lines a run resumed at `step` will not write again: step lines up to
        `step`, evaluation lines before it (the resumed run evaluates at `step` first).
        The half-written line of a killed run goes too."""
        if not self.metrics_path.exists():
            return
        kept = [line + "\n" for line, record in parse_jsonl(self.metrics_path.read_text())
                if record.get("step", 0) <= (step if is_step(record) else step - 1)]
        tmp = self.metrics_path.with_name(METRICS_FILE + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.metrics_path)


@dataclass
class Run:
    """A run directory read at once, as the analysis scripts use it."""
    path: Path
    cfg: dict
    steps: list[dict]  # metrics.jsonl lines with loss/total
    evals: list[dict]  # metrics.jsonl lines with eval/accuracy
    trace: list[TraceSpan] | None  # None when the run has no trace.json

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def analysis_dir(self) -> Path:
        return RunDir(self.path).analysis_dir

    def spans(self, track_prefix: str = "") -> list[TraceSpan]:
        """Spans of the tracks whose name starts with `track_prefix` ([] without a trace)."""
        return [s for s in self.trace or [] if s.track.startswith(track_prefix)]

    def staleness_counts(self) -> dict[int, int]:
        """Samples per staleness value over the whole run."""
        return staleness_counts(self.steps)


def run_dir_for_tool(path: str | Path) -> RunDir:
    """A run directory for a command-line tool: one that has no metrics.jsonl ends the
    program with a one-line message."""
    run = RunDir(path)
    if not run.metrics_path.exists():
        raise SystemExit(f"{run.path}: not a run directory (no {METRICS_FILE})")
    return run


def load_run(path: str | Path) -> Run:
    """run_dir_for_tool, loaded."""
    return run_dir_for_tool(path).load()
