"""The run's timeline: spans of every role in RUN_DIR/trace.json, in Chrome trace format.

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing: one process track per
role ("learner" for learner rank 0's main thread, "actor-<id>" per actor, id = the
hub's actor id), one complete event per span. Times are wall-clock microseconds since
the epoch (`time.time()`), so the tracks of processes on one machine line up; actors on
other machines bring their own clocks.

- Every role records spans with a `SpanRecorder`. Memory is bounded: beyond its
  capacity the oldest span is dropped and counted.
- Actors may run on machines that cannot see the run directory, so their heartbeat
  thread ships pending spans to the hub as `TraceSpans` wire messages (the message
  validates names against `ACTOR_SPANS` and numeric args against `SPAN_ARG_KEYS`).
- Learner rank 0 owns the `TraceWriter`: its own track and the actors', written to
  trace.json atomically at each checkpoint and at the end of the run, with the drop
  counts in "otherData".

async_rl/run/directory.py (`read_trace`) reads the file; the span names below are what the
analysis scripts look for, so they are a contract.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.run.disk import writing

log = logging.getLogger("async_rl.run.tracing")

# Span names, per role.
ACTOR_SPANS = frozenset({"generate", "score", "push", "wait-for-admission", "wait-for-rewards", "sync", "eval"})
LEARNER_SPANS = frozenset({"wait-for-data", "train-step", "sync", "eval", "checkpoint", "export"})
# The numeric args an actor's span may carry on the wire (-1 = not set): prompt groups,
# generated tokens, weight version.
SPAN_ARG_KEYS = ("groups", "tokens", "version")
# Spans kept per process track (and pending in an actor before shipping). A 1000-step
# demo records ~5k learner spans and ~20k per actor; a span costs ~200 bytes of JSON.
DEFAULT_CAPACITY = 100_000
# ts/dur stay below 2**53 so that JavaScript viewers read them exactly.
MAX_TRACE_US = 1 << 53


@dataclass(frozen=True, slots=True)
class Span:
    name: str
    start_us: int  # wall clock, microseconds since the epoch
    dur_us: int
    args: dict[str, Any] | None = None


def now_us() -> int:
    return time.time_ns() // 1000


class SpanRecorder:
    """The spans of one process track, oldest dropped first beyond `capacity`.
    Thread-safe: an actor records on its main thread and ships from its heartbeat thread."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, enabled: bool = True):
        self.enabled = enabled
        self._spans: deque[Span] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._dropped = 0  # since the last take()

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the body of the with-block; it may fill in more args (e.g. the token
        count once generation is done) through the dict it gets."""
        start = now_us()
        try:
            yield args
        finally:
            self.record(name, start, now_us() - start, args)

    def record(self, name: str, start_us: int, dur_us: int, args: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        with self._lock:
            if len(self._spans) == self._spans.maxlen:
                self._dropped += 1
            self._spans.append(Span(name, int(start_us), max(0, int(dur_us)), args or None))

    def extend(self, spans: Iterable[Span], dropped: int = 0) -> None:
        """Add spans recorded elsewhere (an actor's), and the count it dropped before sending."""
        with self._lock:
            self._dropped += dropped
            for span in spans:
                if len(self._spans) == self._spans.maxlen:
                    self._dropped += 1
                self._spans.append(span)

    def count_lost(self, n: int) -> None:
        """Spans that were taken but never arrived (a send that failed)."""
        with self._lock:
            self._dropped += n

    def take(self, most: int) -> tuple[list[Span], int]:
        """Remove and return up to `most` of the oldest spans, and the drop count since the last take."""
        with self._lock:
            spans = [self._spans.popleft() for _ in range(min(most, len(self._spans)))]
            dropped, self._dropped = self._dropped, 0
            return spans, dropped

    def snapshot(self) -> tuple[list[Span], int]:
        """A copy of the spans held, and the drops so far (nothing is removed)."""
        with self._lock:
            return list(self._spans), self._dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)


class WaitSpan:
    """One span over a run of consecutive waits: an actor told to wait polls the hub
    every few milliseconds, and one span per poll would flood the trace."""

    def __init__(self, recorder: SpanRecorder, name: str):
        self.recorder, self.name = recorder, name
        self._since: int | None = None

    def waiting(self, since_us: int) -> None:
        """Still waiting; the run of waits began at `since_us` if it begins now."""
        if self._since is None:
            self._since = since_us

    def done(self) -> None:
        if self._since is not None:
            self.recorder.record(self.name, self._since, now_us() - self._since)
            self._since = None


# -- on the wire: spans as parallel arrays (see transport.messages.TraceSpans) -----------
def spans_to_arrays(spans: list[Span]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """(names, start_us [n], dur_us [n], args [n, len(SPAN_ARG_KEYS)] with -1 = not set).
    Args outside SPAN_ARG_KEYS stay local."""
    args = np.full((len(spans), len(SPAN_ARG_KEYS)), -1, dtype=np.int64)
    for i, span in enumerate(spans):
        for j, key in enumerate(SPAN_ARG_KEYS):
            value = (span.args or {}).get(key)
            if value is not None:
                args[i, j] = int(value)
    return ([s.name for s in spans], np.array([s.start_us for s in spans], dtype=np.int64),
            np.array([s.dur_us for s in spans], dtype=np.int64), args)


def spans_from_arrays(names: list[str], start_us: np.ndarray, dur_us: np.ndarray, args: np.ndarray) -> list[Span]:
    out = []
    for i, name in enumerate(names):
        span_args = {key: int(v) for key, v in zip(SPAN_ARG_KEYS, args[i].tolist()) if v >= 0}
        out.append(Span(name, int(start_us[i]), int(dur_us[i]), span_args or None))
    return out


class TraceWriter:
    """Learner rank 0: every track of the run, written to `path` as Chrome trace JSON."""

    def __init__(self, path: Path, capacity: int = DEFAULT_CAPACITY, *, resume: bool = False):
        """`resume`: keep the spans of the trace a resumed run's checkpoint left behind."""
        self.path, self.capacity = Path(path), capacity
        self._lock = threading.Lock()
        self._tracks: dict[str, SpanRecorder] = {}
        self.learner = self.track("learner")
        if resume:
            self._load_existing()

    def track(self, name: str) -> SpanRecorder:
        """The recorder of a process track, made on first use (tracks are never removed,
        so an actor that left keeps its spans)."""
        with self._lock:
            if name not in self._tracks:
                self._tracks[name] = SpanRecorder(self.capacity)
            return self._tracks[name]

    def add_actor_spans(self, actor_id: int, names: list[str], start_us: np.ndarray, dur_us: np.ndarray,
                        args: np.ndarray, dropped: int = 0) -> None:
        """The arrays of a validated TraceSpans message."""
        self.track(f"actor-{actor_id}").extend(spans_from_arrays(names, start_us, dur_us, args), dropped)

    def document(self) -> dict[str, Any]:
        """The Chrome trace JSON object: metadata events name the tracks (pid = track
        order, learner first; tid = pid, one thread per role), then complete events."""
        with self._lock:
            tracks = list(self._tracks.items())
        meta: list[dict[str, Any]] = []
        spans: list[dict[str, Any]] = []
        dropped: dict[str, int] = {}
        for pid, (name, recorder) in enumerate(tracks, start=1):
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": pid, "args": {"name": name}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": pid, "args": {"sort_index": pid}})
            held, dropped[name] = recorder.snapshot()
            for s in held:
                event = {"ph": "X", "name": s.name, "pid": pid, "tid": pid, "ts": s.start_us, "dur": s.dur_us}
                if s.args:
                    event["args"] = s.args
                spans.append(event)
        return {"traceEvents": meta + spans, "displayTimeUnit": "ms", "otherData": {
            "clock": "wall clock (time.time), microseconds since the epoch",
            "max_spans_per_track": self.capacity, "dropped_spans": dropped}}

    def write(self) -> None:
        """Atomically (tmp + rename): a reader, or a run killed while writing, never
        sees half a file."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with writing("the trace", self.path):
            tmp.write_text(json.dumps(self.document(), separators=(",", ":")))
            os.replace(tmp, self.path)

    def _load_existing(self) -> None:
        try:
            doc = json.loads(self.path.read_text())
            events = doc["traceEvents"]
            names = {e["pid"]: e["args"]["name"] for e in events
                     if e.get("ph") == "M" and e.get("name") == "process_name"}
            by_track: dict[str, list[Span]] = {}
            for e in events:
                if e.get("ph") == "X" and e.get("pid") in names:
                    by_track.setdefault(names[e["pid"]], []).append(
                        Span(e["name"], int(e["ts"]), int(e["dur"]), e.get("args")))
            dropped = doc.get("otherData", {}).get("dropped_spans", {})
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            log.warning("%s: unreadable (%s); the resumed run's trace starts empty", self.path, err)
            return
        for name in sorted(set(by_track) | set(dropped), key=lambda n: (n != "learner", n)):
            self.track(name).extend(by_track.get(name, []), int(dropped.get(name, 0)))
