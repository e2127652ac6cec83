"""Leaving a broadcast that a member holds up, at both ends of the group.

A gloo transfer to a member that stopped answering (its link cut, the process stopped)
waits out the group's timeout, and nothing interrupts it: a short `wait` timeout breaks
the pair, and neither the group's `abort()` nor dropping it releases a waiting thread
(torch 2.13). So the waiting itself is moved to a thread of its own (`run_abandonable`)
and the caller polls: rank 0 gives up as soon as the coordinator has dropped a member of
the epoch, writes the epoch's abandon record, and forms the next epoch with fresh
groups; every member polls that record while it waits, and gives up too. The threads
left behind hold their old groups until gloo's timeout releases them; what they still
write goes nowhere that a later sync reads (rank 0's members are in a new group, and a
member that gave up receives into fresh buffers from then on).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch.distributed as dist

from async_rl.weight_transfer.errors import SyncAbandoned

POLL_S = 0.05  # how often a waiting end asks whether to give up (a store round trip for a member)


def abandoned_key(epoch: int) -> str:
    return f"abandoned/{epoch}"


def mark_abandoned(store: dist.Store, epoch: int, reason: str) -> None:
    store.set(abandoned_key(epoch), reason[:1000].encode())


def run_abandonable(work: Callable[[], None], give_up: Callable[[], str | None], name: str,
                    left_behind: list[threading.Thread]) -> None:
    """Run `work` in a thread of its own and wait for it; raise what it raised, or
    SyncAbandoned as soon as `give_up()` names a reason (the thread is then appended to
    `left_behind`, still waiting on its transfers)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as err:  # re-raised in the caller, unless it gave up
            failure.append(err)

    # Named after its caller too, so that logs and tests can tell whose transfer it is.
    thread = threading.Thread(target=target, name=f"{threading.current_thread().name}:{name}", daemon=True)
    thread.start()
    pause = 0.0005
    while True:
        thread.join(timeout=pause)
        if not thread.is_alive():
            break
        reason = give_up()
        if reason is not None:
            left_behind.append(thread)
            left_behind[:] = [t for t in left_behind if t.is_alive()]
            raise SyncAbandoned(reason)
        pause = min(2 * pause, POLL_S)
    if failure:
        raise failure[0]


def member_gives_up(store: dist.Store, epoch: int) -> Callable[[], str | None]:
    """A member's `give_up`: rank 0's abandon record for `epoch`, once written."""
    key = abandoned_key(epoch)

    def check() -> str | None:
        if store.check([key]):
            return f"rank 0 abandoned epoch {epoch}: {store.get(key).decode(errors='replace')}"
        return None
    return check
