"""The handshake that opens every membership epoch, whatever the transport.

1. arrival: every member writes `arrived/<epoch>/<rank>`, an `Arrival` naming how it
   will receive;
2. decision: once all have arrived, rank 0 alone writes `decision/<epoch>`: `Go`,
   naming for each transport the members it serves, in group order, or `Abandon`;
3. group formation: each transport forms its group from the decision (a member's rank
   in it is 1 + its index in the transport's `Group.ranks`).

Why not let a transport's own rendezvous gather the members: gloo's (and NCCL's)
cannot be interrupted, so a member that died would hold everyone for the full
`sync.timeout_s`. Here rank 0 writes `Abandon` as soon as the membership changes (the
dead actor reaped, a new one joined), which releases the waiting members at once.
Rank 0 alone decides, so all members agree on who is in which group.
"""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist

from async_rl.weight_transfer.errors import EpochRejected, SyncAbandoned
from async_rl.weight_transfer.records import Abandon, Arrival, Decision, Go, Group, arrived_key, decision_key, decode, encode


def poll_store(store: dist.Store, keys: list[str], timeout_s: float,
               give_up: Callable[[], str | None] = lambda: None, max_pause_s: float = 0.02) -> str | None:
    """Wait until all `keys` exist (None), or until `give_up()` names a reason (returned).
    Polled rather than `store.wait`, which cannot be interrupted and logs a warning on
    timeout; raises TimeoutError after `timeout_s`. The pause between polls starts at
    0.5 ms and doubles up to `max_pause_s`: a key that comes within milliseconds (a
    CUDA-IPC copy) is seen soon after, a long wait costs few round trips."""
    deadline = time.monotonic() + timeout_s
    pause = min(0.0005, max_pause_s)
    while not store.check(keys):
        reason = give_up()
        if reason is not None:
            return reason
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {len(keys)} store key(s) appeared within {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(2 * pause, max_pause_s)
    return None


# -- rank 0 ------------------------------------------------------------------------

def gather_arrivals(store: dist.Store, epoch: int, members: int, timeout_s: float,
                    give_up: Callable[[], str | None]) -> dict[int, bytes]:
    """Every member's arrival as written (ranks 1..members). Abandons the epoch and
    raises SyncAbandoned as soon as `give_up()` names a reason, TimeoutError once
    `timeout_s` passed."""
    keys = [arrived_key(epoch, rank) for rank in range(1, members + 1)]
    try:
        reason = poll_store(store, keys, timeout_s, give_up)
    except TimeoutError:
        missing = sum(not store.check([key]) for key in keys)
        reason = f"{missing} of {len(keys)} member(s) did not join within {timeout_s:.0f}s"
        abandon(store, epoch, reason)
        raise TimeoutError(reason) from None
    if reason is not None:
        abandon(store, epoch, reason)
        raise SyncAbandoned(reason)
    return {rank: store.get(key) for rank, key in enumerate(keys, 1)}


def decode_arrival(rank: int, raw: bytes) -> Arrival:
    """A member's arrival (network input: strict), or EpochRejected."""
    try:
        return decode(Arrival, raw, "arrival")
    except ValueError:
        raise EpochRejected(f"rank {rank} announced itself as {raw[:40]!r}") from None


def go(store: dist.Store, epoch: int, groups: dict[str, Group]) -> None:
    store.set(decision_key(epoch), encode(Go(groups)))


def abandon(store: dist.Store, epoch: int, reason: str) -> None:
    store.set(decision_key(epoch), encode(Abandon(reason[:1000])))


# -- a member ------------------------------------------------------------------------

def join(store: dist.Store, epoch: int, rank: int, arrival: Arrival, timeout_s: float) -> Group:
    """Arrive, wait for rank 0's decision, and return the group of this member's transport.
    SyncAbandoned if rank 0 abandoned the epoch; ValueError for a malformed decision."""
    store.set(arrived_key(epoch, rank), encode(arrival))
    # Rank 0 decides within its own timeout, which started before this member arrived.
    poll_store(store, [decision_key(epoch)], timeout_s)
    decision = decode(Decision, store.get(decision_key(epoch)), "sync decision")
    if isinstance(decision, Abandon):
        raise SyncAbandoned(f"rank 0 abandoned epoch {epoch}: {decision.reason}")
    group = decision.groups.get(arrival.transport)
    if group is None or rank not in group.ranks:
        raise RuntimeError(f"rank 0's decision for epoch {epoch} leaves this member (rank {rank}) out")
    return group
