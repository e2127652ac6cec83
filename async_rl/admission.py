"""Staleness admission control (AReaL-style, made exact for out-of-order arrival).

Admission index i counts prompt groups in the order they are granted. The learner
consumes groups strictly in admission order, `batch_groups` (B) per step, so group i
is consumed at learner version floor(i / B). A group is admitted to an actor holding
weights of version v only while i < (eta + v + 1) * B; hence
floor(i / B) - v <= eta: no sample can be consumed more than eta versions after the
weights that generated it. The actor's *own* version is used, not the learner's,
because actors may lag the learner between weight syncs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    max_staleness: int
    batch_groups: int
    admitted: int = 0  # groups granted so far == next admission index

    def allows(self, index: int, actor_version: int) -> bool:
        """May slot `index` be generated with weights of `actor_version`? (re-issues)"""
        return index < (self.max_staleness + actor_version + 1) * self.batch_groups

    def capacity(self, actor_version: int) -> int:
        """How many more groups an actor at `actor_version` may be granted now."""
        limit = (self.max_staleness + actor_version + 1) * self.batch_groups
        return max(0, limit - self.admitted)

    def admit(self, actor_version: int, wanted: int) -> range:
        """Grant up to `wanted` groups; returns their admission indices."""
        n = min(wanted, self.capacity(actor_version))
        start = self.admitted
        self.admitted += n
        return range(start, start + n)

    @staticmethod
    def consumed_at(index: int, batch_groups: int) -> int:
        """Learner version at which the group with this admission index is consumed."""
        return index // batch_groups
