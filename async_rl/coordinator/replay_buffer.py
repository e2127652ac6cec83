"""FIFO replay buffer of whole prompt groups, ordered by admission index.

Groups may arrive out of order (actors run at different speeds); the learner takes
them in admission order so that the admission bound holds exactly (see admission.py).
The staleness filter is a safety net: a group older than the bound when taken is
dropped and counted; in a correct run `dropped` stays 0. A slot whose prompt is not
generated at all (longer than the run's prompt limit) is marked `skip`ped, so the
slots after it are not held up.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from async_rl.staleness import staleness

T = TypeVar("T")
_SKIPPED = object()  # the slot's prompt was skipped, nothing will arrive for it


@dataclass
class Taken(Generic[T]):
    groups: list[T]
    indices: list[int]
    versions: list[int]
    waited_s: float
    dropped_indices: list[int] = field(default_factory=list)


class ReplayBuffer(Generic[T]):
    def __init__(self, max_staleness: int, capacity: int):
        self.max_staleness = max_staleness
        self.capacity = capacity  # admission bounds occupancy; this is a hard cap on top
        self._slots: dict[int, tuple[int, T]] = {}
        self._next = 0  # next admission index to pull from the slots
        self._ready: list[tuple[int, int, T]] = []  # pulled in order, not yet taken
        self._cond = threading.Condition()
        self.dropped = 0
        self.consumed = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._slots) + len(self._ready)

    @property
    def next_index(self) -> int:
        return self._next

    def put(self, index: int, version: int, item: T) -> bool:
        """Store the group for admission slot `index`; False for a duplicate/old slot or when full."""
        with self._cond:
            if index < self._next or index in self._slots or len(self._slots) + len(self._ready) >= self.capacity:
                return False
            self._slots[index] = (version, item)
            self._cond.notify_all()
            return True

    def skip(self, index: int) -> None:
        """Nothing will be stored for slot `index`: take() passes over it."""
        with self._cond:
            if index >= self._next and index not in self._slots:
                self._slots[index] = (0, _SKIPPED)  # type: ignore[assignment]
                self._cond.notify_all()

    def contents(self) -> list[tuple[int, int, T]]:
        """(admission index, version, group) of every stored group, in admission order."""
        with self._cond:
            slots = [(i, v, g) for i, (v, g) in sorted(self._slots.items()) if g is not _SKIPPED]
            return [*self._ready, *slots]

    def restore(self, next_index: int, items: list[tuple[int, int, T]], *, consumed: int, dropped: int,
                skipped: list[int] = ()) -> None:
        """Reload a `contents()` snapshot taken when `next_index` was the next slot to
        pull; `skipped`: the slots at or after it marked with skip()."""
        with self._cond:
            self._next, self.consumed, self.dropped = next_index, consumed, dropped
            self._ready = [(i, v, g) for i, v, g in items if i < next_index]
            self._slots = {i: (v, g) for i, v, g in items if i >= next_index}
            self._slots.update({i: (0, _SKIPPED) for i in skipped})  # type: ignore[misc]

    def take(self, n: int, learner_version: int, timeout: float | None = None,
             stop: threading.Event | None = None) -> Taken[T] | None:
        """Block until the next `n` admission slots are filled; None on timeout/stop.

        Groups already pulled in order stay in `_ready` across a timeout, so nothing
        is lost and the order is kept.
        """
        start = time.monotonic()
        dropped: list[int] = []
        with self._cond:
            while True:
                while self._next in self._slots and len(self._ready) < n:
                    version, item = self._slots.pop(self._next)
                    index, self._next = self._next, self._next + 1
                    if item is _SKIPPED:
                        continue
                    if staleness(learner_version, version) > self.max_staleness:
                        self.dropped += 1
                        dropped.append(index)
                        continue
                    self._ready.append((index, version, item))
                if len(self._ready) >= n:
                    break
                remaining = None if timeout is None else timeout - (time.monotonic() - start)
                if (remaining is not None and remaining <= 0) or (stop is not None and stop.is_set()):
                    return None
                self._cond.wait(timeout=0.05 if remaining is None else min(0.05, remaining))
            batch, self._ready = self._ready[:n], self._ready[n:]
            self.consumed += n
        return Taken([g for _, _, g in batch], [i for i, _, _ in batch], [v for _, v, _ in batch],
                     time.monotonic() - start, dropped)
