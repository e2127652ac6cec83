"""The coordinator's registry of live actors, by id.

Ids are never reused, also across a resume: an actor's sampling stream is seeded by
its id, so a new actor never replays an old one's.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from async_rl.wire import Hello


@dataclass
class ActorInfo:
    actor_id: int
    name: str
    pid: int
    host: str
    identity: bytes
    last_seen: float
    version: int = 0
    peak_rss_mb: float = 0.0
    synced: tuple[int, int] = (-1, -1)  # (epoch, version) of the last broadcast it completed
    outstanding: set[int] = field(default_factory=set)  # admission indices granted, not yet delivered
    # Joins weight broadcasts only from its first work request on, i.e. once its model
    # is loaded: members of a new epoch's group would otherwise wait for the load.
    ready: bool = False
    fd: int = -1  # the hub's file descriptor of its request connection (see Hub)


class ActorRegistry(Mapping[int, ActorInfo]):
    def __init__(self) -> None:
        self._actors: dict[int, ActorInfo] = {}
        self.next_id = 0

    def __getitem__(self, actor_id: int) -> ActorInfo:
        return self._actors[actor_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._actors)

    def __len__(self) -> int:
        return len(self._actors)

    def add(self, hello: Hello, identity: bytes, fd: int, now: float) -> ActorInfo:
        actor = ActorInfo(self.next_id, hello.actor_name, hello.pid, hello.host, identity, now, fd=fd)
        self._actors[actor.actor_id] = actor
        self.next_id += 1
        return actor

    def pop(self, actor_id: int) -> ActorInfo | None:
        return self._actors.pop(actor_id, None)

    def connected_through(self, fd: int) -> list[ActorInfo]:
        """The actors whose requests came through connection `fd`. A new connection may
        reuse the number before its old one's close is seen: a live actor named here
        registers again on its next request (rejoin)."""
        return [a for a in self.values() if a.fd == fd]

    def silent(self, now: float, timeout_s: float) -> list[ActorInfo]:
        return [a for a in self.values() if now - a.last_seen > timeout_s]

    def ready_ids(self) -> list[int]:
        """The actors that take part in weight broadcasts."""
        return [a.actor_id for a in self.values() if a.ready]

    def ready_versions(self) -> set[int]:
        return {a.version for a in self.values() if a.ready}

    def peak_rss_mb(self) -> float:
        return max((a.peak_rss_mb for a in self.values()), default=0.0)

    def describe(self) -> list[dict]:
        """Who is where, for endpoints.json."""
        return [{"id": a.actor_id, "pid": a.pid, "name": a.name, "host": a.host} for a in self.values()]
