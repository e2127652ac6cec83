"""Dynamic batching: rows of many requests, per component, scored together.

A component's queue is scored when it holds `max_batch` rows or `max_tokens` tokens, or
when its oldest row has waited `max_wait_s`; a batch takes rows first come, first
served, up to either limit (a row longer than `max_tokens` goes alone). Rows whose
caller has stopped waiting are dropped, not scored. The same policy as a serving
engine's continuous batching, at the granularity of whole forward passes (vLLM's and
TGI's max_num_seqs / max_batch_total_tokens / waiting_served_ratio).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Row:
    request: object  # whatever the server keys a request by
    index: int  # the row's place in its request
    tokens: int
    arrived: float
    expires: float  # the caller stops waiting (time.monotonic())


class Batcher:
    def __init__(self, max_batch: int, max_tokens: int, max_wait_s: float) -> None:
        self.max_batch, self.max_tokens, self.max_wait_s = max_batch, max_tokens, max_wait_s
        self.queues: dict[str, deque[Row]] = {}
        self.dropped = 0

    def add(self, component: str, rows: list[Row]) -> None:
        self.queues.setdefault(component, deque()).extend(rows)

    def _ready(self, queue: deque[Row], now: float) -> bool:
        return (len(queue) >= self.max_batch or sum(r.tokens for r in queue) >= self.max_tokens
                or now - queue[0].arrived >= self.max_wait_s)

    def next_batch(self, now: float) -> tuple[str, list[Row]] | None:
        """The component and rows to score now, the longest-waiting ready queue first; None
        when no queue is ready."""
        for queue in self.queues.values():
            while queue and queue[0].expires <= now:
                queue.popleft()
                self.dropped += 1
        ready = [(q[0].arrived, name) for name, q in self.queues.items() if q and self._ready(q, now)]
        if not ready:
            return None
        name = min(ready)[1]
        queue, batch, tokens = self.queues[name], [], 0
        while queue and len(batch) < self.max_batch and (not batch or tokens + queue[0].tokens <= self.max_tokens):
            row = queue.popleft()
            if row.expires <= now:
                self.dropped += 1
                continue
            batch.append(row)
            tokens += row.tokens
        return (name, batch) if batch else None

    def wait_s(self, now: float) -> float | None:
        """Seconds until a queue is due by its oldest row's wait (0 when one is ready);
        None when all are empty."""
        waits = [0.0 if self._ready(q, now) else q[0].arrived + self.max_wait_s - now
                 for q in self.queues.values() if q]
        return max(0.0, min(waits)) if waits else None
