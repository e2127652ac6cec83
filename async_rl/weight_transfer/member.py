"""A member's side of the weight sync across epochs, whatever its transport.

The actor calls `receive(...)` once per SyncOrder. The member connects to rank 0's
store (once per learner), opens its transport's end, takes part in the handshake of
every new epoch (handshake.py), then lets the end receive the version. A failure
drops the end's group, so the next order joins afresh.
"""
from __future__ import annotations

import datetime
import traceback
from typing import Any, Callable

import torch.distributed as dist

from async_rl.weight_transfer import handshake
from async_rl.weight_transfer.abandon import member_gives_up
from async_rl.weight_transfer.base import ReceiverEnd, ReceiverSide


class Member:
    """Subclasses say which end to open and how a version lands (`open_end`, `deliver`).
    `intact`: the weights hold one complete version (False while a sync writes them in place).
    `transport`: the name of the transport it receives by, once known."""

    transport: str | None = None

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.intact = True
        self._store: dist.TCPStore | None = None
        self._end: ReceiverEnd | None = None
        self._epoch = -1
        # For `deliver`: whether rank 0 has abandoned the epoch being received (abandon.py).
        self.give_up: Callable[[], str | None] = lambda: None

    @property
    def group(self) -> Any:
        """The current epoch's communication group, None when there is none (not joined,
        dropped after a failure, or a transport without one)."""
        return None if self._end is None else self._end.group

    def receive(self, *, epoch: int, rank: int, world_size: int, store_host: str, store_port: int) -> None:
        """Receive one version, joining `epoch` first if this member is not in it yet.
        `world_size` is the coordinator's; the group's own comes from rank 0's decision."""
        try:
            if self._store is None or (self._store.host, self._store.port) != (store_host, store_port):
                store = dist.TCPStore(store_host, store_port, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.timeout_s))
                self._end, self._epoch = self.open_end(ReceiverSide(store, store_host, self.timeout_s)), -1
                self._store = store
            if epoch != self._epoch:
                self._end.leave()
                group = handshake.join(self._store, epoch, rank, self._end.arrival(), self.timeout_s)
                self._end.join(epoch, rank, group)
                self._epoch = epoch
            self.give_up = member_gives_up(self._store, epoch)
            self.deliver(self._end)
        except Exception as err:
            # The group may be broken (a member gone, a collective half done): never reuse
            # it. Dropping it also closes its connections, releasing peers still waiting,
            # but only once nothing else holds it: the frames in the traceback of an
            # exception the caller keeps would (with the pending transfers).
            if self._end is not None:
                self._end.leave()
            self._epoch = -1
            traceback.clear_frames(err.__traceback__)
            raise

    def reopen(self) -> None:
        """Open the store connection and the transport's end afresh at the next receive
        (an end whose old receive may still be writing must not be reused)."""
        if self._end is not None:
            self._end.leave()
        self._store = self._end = None
        self._epoch = -1

    def open_end(self, side: ReceiverSide) -> ReceiverEnd:
        raise NotImplementedError

    def deliver(self, end: ReceiverEnd) -> None:
        raise NotImplementedError
