"""Rank 0's membership epochs: who takes part in a broadcast, and by which transport.

The coordinator names the members (`WeightBroadcaster.set_members`); every change, and
every failed sync, starts a new epoch, so its groups are formed afresh among those who
are there. `form_epoch` runs rank 0's half of the handshake (handshake.py): it gathers
the arrivals, assigns each member to the transport it announced (`plan_epoch`), lets
each of those transports prepare, writes "go", and has each form its group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from async_rl.weight_transfer import handshake
from async_rl.weight_transfer.base import SenderEnd
from async_rl.weight_transfer.bucket_sets import BucketSet
from async_rl.weight_transfer.errors import EpochRejected, describe
from async_rl.weight_transfer.records import Arrival, Group


@dataclass(frozen=True)
class SyncJob:
    """One broadcast the thread is running: the epoch, the version, the members."""
    epoch: int
    version: int
    members: tuple[int, ...]  # actor ids; actor k has rank members.index(k) + 1 in the epoch

    def rank_of(self, actor_id: int) -> int:
        return self.members.index(actor_id) + 1


@dataclass(frozen=True)
class EpochPlan:
    """Who receives how in one epoch, as rank 0 decided it from the arrivals: per
    transport, in the order a sync goes out, its members' ranks and arrivals."""
    members: dict[str, dict[int, Arrival]]


def plan_epoch(arrivals: dict[int, Arrival], *, served: tuple[str, ...], engine: str) -> EpochPlan:
    """Each member to the transport it announced; EpochRejected for a member this learner
    cannot serve. `engine` is the run's actors.engine, which fixed the learner's bucket
    layout and so the transports it serves (`served`)."""
    members: dict[str, dict[int, Arrival]] = {name: {} for name in served}
    refused: dict[str, list[int]] = {}
    for rank in sorted(arrivals):
        transport = arrivals[rank].transport
        if transport in members:
            members[transport][rank] = arrivals[rank]
        else:
            refused.setdefault(transport, []).append(rank)
    torch_ranks = sorted(rank for transport, ranks in refused.items() if transport != "vllm" for rank in ranks)
    if engine == "vllm" and torch_ranks:
        raise EpochRejected(f"rank(s) {torch_ranks} run the torch engine, but this learner sends vLLM's packed "
                            "layout (actors.engine=vllm); one run uses one engine for all actors")
    if "vllm" in refused:
        raise EpochRejected(f"rank(s) {refused['vllm']} run vLLM, but this learner was built for "
                            f"actors.engine={engine} (WeightBroadcaster(engine=...)); one run uses one engine "
                            "for all actors")
    if refused:
        raise EpochRejected(f"rank(s) {torch_ranks} receive by {', '.join(refused)}, which this learner does "
                            f"not serve ({', '.join(served)})")
    return EpochPlan({name: ranks for name, ranks in members.items() if ranks})


class Epoch:
    """The epoch the broadcast thread last formed, and the transports serving it."""

    def __init__(self, number: int = 0, senders: tuple[SenderEnd, ...] = ()):
        self.number, self.senders = number, senders

    @property
    def group(self) -> Any:
        """The first transport's communication group (analysis/bench_sync.py times
        reference broadcasts on it); None where it has none."""
        return self.senders[0].group if self.senders else None

    def send(self, source: BucketSet) -> None:
        for sender in self.senders:
            sender.send(source)

    def close(self) -> None:
        """Drop every group: closing their connections releases members still waiting."""
        for sender in self.senders:
            sender.disconnect()


def form_epoch(store: dist.Store, job: SyncJob, senders: dict[str, SenderEnd], *, engine: str, timeout_s: float,
               give_up: Callable[[], str | None]) -> Epoch:
    """Decide (rank 0 alone) and form the epoch's groups. Any failure before "go" writes
    "abandon", which releases the members at once."""
    raw = handshake.gather_arrivals(store, job.epoch, len(job.members), timeout_s, give_up)
    prepared: list[SenderEnd] = []
    try:
        arrivals = {rank: handshake.decode_arrival(rank, value) for rank, value in raw.items()}
        plan = plan_epoch(arrivals, served=tuple(senders), engine=engine)
        groups: dict[str, Group] = {}
        for name, members in plan.members.items():
            prepared.append(senders[name])
            groups[name] = senders[name].prepare(job.epoch, members)
    except BaseException as err:
        for sender in prepared:
            sender.disconnect()
        handshake.abandon(store, job.epoch, describe(err))
        raise
    epoch = Epoch(job.epoch, tuple(prepared))
    try:
        handshake.go(store, job.epoch, groups)
        for sender in prepared:
            sender.connect()
    except BaseException:
        epoch.close()
        raise
    return epoch
