"""Staleness admission control (AReaL-style, made exact for out-of-order arrival).

Admission index i counts prompt groups in the order they are granted. The learner
consumes groups strictly in admission order, so the bound of async_rl/staleness.py
(i < admission_limit(eta, v, B)) keeps every group's staleness <= eta. The actor's
*own* version is used, not the learner's, because actors may lag the learner between
weight syncs.

A slot whose prompt is skipped (longer than the prompt limit) is never generated nor
consumed, so it does not count: i above is the slot's rank among the slots that are
not skipped. Counting skipped slots would shrink the window until, with enough long
prompts in a row, no batch could ever fill.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from async_rl.staleness import admission_limit


@dataclass
class Admission:
    max_staleness: int
    batch_groups: int
    admitted: int = 0  # slots handed out so far == next admission index
    skipped: list[int] = field(default_factory=list)  # sorted slots whose prompt was skipped

    def _limit(self, actor_version: int) -> int:
        return admission_limit(self.max_staleness, actor_version, self.batch_groups)

    def allows(self, index: int, actor_version: int) -> bool:
        """May slot `index` be generated with weights of `actor_version`? (re-issues)"""
        return index - bisect_left(self.skipped, index) < self._limit(actor_version)

    def capacity(self, actor_version: int) -> int:
        """How many more groups an actor at `actor_version` may be granted now."""
        return max(0, self._limit(actor_version) - (self.admitted - len(self.skipped)))

    def skip(self, index: int) -> None:
        """Slot `index` (admitted) will never be generated."""
        insort(self.skipped, index)

    def admit(self, actor_version: int, wanted: int) -> range:
        """Grant up to `wanted` groups; returns their admission indices."""
        n = min(wanted, self.capacity(actor_version))
        start = self.admitted
        self.admitted += n
        return range(start, start + n)
