"""What benchmarks/chaos.py watches while its run is under way, and the verdicts and tables
it prints once the run has ended. Everything is read from outside, as a user would: the
run directory's files (RunDir), /proc and psutil.

    Watch(run, memory_path, roots)   a thread: when each learner step appeared, the
                                     learner's USS and RSS every few seconds (JSONL), and
                                     every process of the run seen
    checks(...)                      the whole-run checks, one dict each
    memory_trend(samples)            least-squares slope of the learner's memory per 1000 steps
    baseline_figures(run, step)      an undisturbed run's accuracy and spread at a step
    markdown(faults, checks, memory) the tables
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from fault_drill import config_value, consumed_once  # sibling script: consumption read from the run's files

from async_rl.run.directory import RunDir, staleness_counts
from async_rl.run.processes import process_tree

POLL_S = 0.1  # how often the step counter is read: the resolution of every pause reported
TREE_EVERY_S = 1.0
EVAL_WINDOW = 5  # evaluations of the baseline whose range is its spread
MEMORY_WARMUP_STEPS = 100  # a learner's first steps (allocator, first checkpoint) are not its trend


class Watch(threading.Thread):
    """Polls the run until stopped. `roots()`: the pids whose process trees are the run
    now (the launcher, an actor started by hand)."""

    def __init__(self, run: RunDir, memory_path: Path, roots: Callable[[], list[int]], memory_every_s: float):
        super().__init__(daemon=True, name="chaos-watch")
        self.run_dir, self.memory_path, self.roots, self.memory_every_s = run, memory_path, roots, memory_every_s
        self.advances: list[tuple[float, int]] = []  # (wall time first seen, step), increases only
        self.memory: list[dict] = []
        self.processes: dict[tuple[int, float], psutil.Process] = {}
        self.start_time = time.time()
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)

    def run(self) -> None:
        last_step, next_tree, next_memory = None, 0.0, 0.0
        with open(self.memory_path, "a") as out:
            while not self._stopping.wait(POLL_S):
                now = time.time()
                # The files are rewritten under us (a resume truncates metrics.jsonl): a read
                # that fails is retried at the next poll.
                with contextlib.suppress(OSError, ValueError):
                    step = self.run_dir.last_step()
                    if last_step is not None and step > last_step:
                        with self._lock:
                            self.advances.append((now, step))
                    last_step = step  # a resume moves it back to its checkpoint's step
                if now >= next_tree:
                    next_tree = now + TREE_EVERY_S
                    self._track_processes()
                if now >= next_memory:
                    next_memory = now + self.memory_every_s
                    sample = self._sample_memory(now, last_step or 0)
                    if sample:
                        self.memory.append(sample)
                        out.write(json.dumps(sample) + "\n")
                        out.flush()

    def _track_processes(self) -> None:
        for root in self.roots():
            for pid in process_tree(root):
                with contextlib.suppress(psutil.Error):
                    process = psutil.Process(pid)
                    self.processes.setdefault((pid, process.create_time()), process)

    def _sample_memory(self, now: float, step: int) -> dict | None:
        with contextlib.suppress(psutil.Error, OSError, ValueError, TypeError, KeyError):
            pid = self.run_dir.endpoints()["learner_pid"]
            info = psutil.Process(pid).memory_full_info()
            if info.rss == 0:  # killed and not yet reaped: a zombie holds no memory
                return None
            return {"time_s": round(now - self.start_time, 1), "step": step, "pid": pid,
                    "uss_mb": round(info.uss / 2**20, 2), "rss_mb": round(info.rss / 2**20, 2)}
        return None

    def steps_between(self, start: float, end: float) -> list[tuple[float, int]]:
        with self._lock:
            return [(t, s) for t, s in self.advances if start <= t <= end]

    def first_advance_after(self, since: float) -> tuple[float, int] | None:
        with self._lock:
            return next(((t, s) for t, s in self.advances if t > since), None)

    def longest_pause(self, start: float, end: float) -> float:
        """The longest time between two learner steps from the last step before `start`
        up to `end`."""
        with self._lock:
            before = [t for t, _ in self.advances if t < start][-1:]
            times = before + [t for t, _ in self.advances if start <= t <= end]
        return round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 2)


def longest_pause_outside(advances: list[tuple[float, int]], windows: list[tuple[float, float]]) -> float:
    """The longest time between two learner steps that overlaps no fault's window: a
    stall nothing injected explains."""
    times = [t for t, _ in advances]
    gaps = [b - a for a, b in zip(times, times[1:]) if not any(start <= b and a <= end for start, end in windows)]
    return round(max(gaps, default=0.0), 2)


# -- the whole-run checks --------------------------------------------------------------
def steps_and_prompts_check(run: RunDir) -> dict:
    consumed = consumed_once(run)
    return {"check": "each step once, each prompt consumed once", **consumed,
            "passed": consumed["each_step_once"] and consumed["prompts_consumed"] == consumed["prompts_expected"]
            and consumed["prompts_expected"] > 0}


def staleness_check(run: RunDir) -> dict:
    steps, bound = run.steps(), config_value(run, "max_staleness")
    worst = max((s["staleness/max"] for s in steps), default=0)
    counted = max(staleness_counts(steps), default=0)
    dropped = steps[-1]["staleness/dropped"] if steps else 0
    return {"check": "staleness within max_staleness", "max_staleness": bound, "staleness_max": max(worst, counted),
            "dropped": dropped, "passed": bool(steps) and max(worst, counted) <= bound and dropped == 0}


def baseline_figures(run: RunDir, step: int, source: str) -> dict | None:
    """An undisturbed run's held-out accuracy at `step` and its spread: the range of its
    last EVAL_WINDOW evaluations up to there (one run wiggles from round to round),
    widened by two binomial standard errors of task.eval_size prompts; given as the
    middle of that range and half its width."""
    late = step + config_value(run, "max_staleness") + 1  # a round is scored with weights up to this much newer
    window = [e["eval/accuracy"] for e in run.evals() if e["step"] <= late][-EVAL_WINDOW:]
    if not window:
        return None
    mean = statistics.fmean(window)
    error = 2 * math.sqrt(mean * (1 - mean) / config_value(run, "task.eval_size"))
    low, high = max(0.0, min(window) - error), min(1.0, max(window) + error)
    return {"baseline": source, "step": step, "accuracy": round((low + high) / 2, 4),
            "spread": round((high - low) / 2, 4), "evaluations": window}


def accuracy_check(run: RunDir, baseline: dict | None) -> dict:
    evals, given = run.evals(), baseline or {}
    final = evals[-1] if evals else {}
    accuracy = final.get("eval/accuracy")
    return {"check": "final accuracy within the baseline's spread", "final_step": final.get("step"),
            "final_accuracy": accuracy, "baseline_accuracy": given.get("accuracy"),
            "baseline_spread": given.get("spread"), "baseline": given.get("baseline"),
            "passed": accuracy is not None and bool(given)
            and abs(accuracy - given["accuracy"]) <= given["spread"] + 1e-9}


def orphan_check(processes: dict[tuple[int, float], psutil.Process], run_path: Path, timeout_s: float) -> dict:
    """Every process of the run seen while it ran must be gone, and no process may name
    the run directory on its command line (an actor the watch never saw)."""
    tracked = list(processes.values())
    deadline = time.monotonic() + timeout_s  # a killed process's children take a moment to follow it
    while (alive := [p for p in tracked if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    named = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.info["pid"] not in ours and str(run_path) in " ".join(process.info["cmdline"] or []):
            named.append(process)
    left = {p.pid: " ".join(_cmdline(p))[:160] for p in alive + named}
    return {"check": "no process left after the end", "processes_seen": len(tracked), "left": left,
            "passed": not left}


def _running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return ["?"]


def memory_trend(samples: list[dict], key: str) -> dict:
    """The slope of one least-squares line through every learner process's samples (each
    process its own intercept: a resumed learner starts afresh), in MB per 1000 steps,
    and the standard deviation of the change from one sample to the next."""
    by_process: dict[int, list[tuple[int, float]]] = {}
    samples = [sample for sample in samples if sample[key] > 0]  # none of a zombie's (older lines)
    for sample in samples:
        by_process.setdefault(sample["pid"], []).append((sample["step"], sample[key]))
    covariance = variance = 0.0
    changes = []
    used = 0
    for points in by_process.values():
        points = [(x, y) for x, y in points if x >= points[0][0] + MEMORY_WARMUP_STEPS]
        if len(points) < 3:
            continue
        used += len(points)
        mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
        covariance += sum((x - mean_x) * (y - mean_y) for x, y in points)
        variance += sum((x - mean_x) ** 2 for x, _ in points)
        changes += [b - a for (_, a), (_, b) in zip(points, points[1:])]
    values = [s[key] for s in samples]
    return {"slope_mb_per_1000_steps": round(1000 * covariance / variance, 3) if variance else None,
            "sample_spread_mb": round(statistics.pstdev(changes), 3) if len(changes) > 1 else None,
            "samples_fitted": used, "learner_processes": len(by_process),
            "min_mb": min(values, default=None), "max_mb": max(values, default=None)}


# -- the tables --------------------------------------------------------------------------
FAULT_COLUMNS = ("#", "fault", "at step", "at (s)", "what", "steps lost", "training resumed after (s)",
                 "longest pause between steps (s)", "ok")


def _cell(value) -> str:
    return "–" if value is None else str(value).replace("|", "\\|")


def markdown(faults: list[dict], checks: list[dict], memory: dict) -> str:
    lines = ["| " + " | ".join(FAULT_COLUMNS) + " |", "|" + "---|" * len(FAULT_COLUMNS)]
    for number, fault in enumerate(faults, 1):
        row = (number, fault["fault"], fault.get("at_step"), fault.get("at_s"), fault.get("what"),
               fault.get("steps_lost"), fault.get("resumed_after_s"), fault.get("longest_pause_s"),
               "yes" if fault["passed"] else "**no**: " + fault.get("problem", ""))
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    lines += ["", "| check | result | figures |", "|---|---|---|"]
    for check in checks:
        figures = ", ".join(f"{k} {v}" for k, v in check.items() if k not in ("check", "passed"))
        lines.append(f"| {check['check']} | {'pass' if check['passed'] else '**FAIL**'} | {_cell(figures)} |")
    lines += ["", "| learner memory | slope (MB / 1000 steps) | sample-to-sample spread (MB) | range (MB) |",
              "|---|---|---|---|"]
    for key, trend in memory.items():
        lines.append(f"| {key} | {_cell(trend['slope_mb_per_1000_steps'])} | {_cell(trend['sample_spread_mb'])} | "
                     f"{_cell(trend['min_mb'])}–{_cell(trend['max_mb'])} |")
    return "\n".join(lines)
