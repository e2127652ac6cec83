"""How an actor follows the learner's weights: it joins the broadcast each SyncOrder
names (`Syncer`), between generation batches, or with sync.in_flight also between two
decode steps (`InFlight`, the engine's step hook), so a response may span versions:
each token records its own, the group's version is its oldest token's."""
from __future__ import annotations

import logging
import time

from async_rl.actor.hub_client import HubClient
from async_rl.run.tracing import SpanRecorder
from async_rl.weight_transfer.errors import SyncAbandoned, WeightMismatch, describe
from async_rl.wire import Goodbye, SyncDone, SyncOrder, Wait, WeightsRejected, WorkRequest, send
from async_rl.wire.messages import MAX_FAILURE_NOTE

log = logging.getLogger("async_rl.actor")

# Weights that fail their check this many syncs in a row: something on this actor's side
# (its memory, its link) corrupts them, and a fresh process is the remedy.
MAX_REJECTED_IN_A_ROW = 3


class Syncer:
    """Carries out the hub's sync orders and remembers the last epoch whose broadcast
    broke off here (rank 0 fails or abandons that epoch too, so joining it again would
    only wait for a group that never forms)."""

    def __init__(self, hub: HubClient, receiver, engine, state: dict, spans: SpanRecorder):
        self.hub, self.receiver, self.engine, self.state, self.spans = hub, receiver, engine, state, spans
        self.failed_epoch = -1
        self.completed = 0  # syncs completed
        self.rejected_in_a_row = 0  # syncs whose weights failed their check, since the last that passed

    def follow(self, order: SyncOrder) -> bool:
        """Join the broadcast `order` names; False if the epoch had already failed here
        (the hub has not seen it yet), without trying again. LeaveNow after
        MAX_REJECTED_IN_A_ROW rejected syncs in a row."""
        if order.epoch <= self.failed_epoch:
            return False
        outcome = _sync(self.hub, self.receiver, self.engine, order, self.state, self.spans)
        if outcome == "done":
            self.completed += 1
            self.rejected_in_a_row = 0
            return True
        self.failed_epoch = order.epoch
        if self.receiver.broken is not None:
            raise LeaveNow(1, f"its weights can no longer be updated: {self.receiver.broken}")
        if outcome == "rejected":
            self.rejected_in_a_row += 1
            if self.rejected_in_a_row >= MAX_REJECTED_IN_A_ROW:
                raise LeaveNow(1, f"the weights it received failed their check {self.rejected_in_a_row} syncs in a "
                                  "row; a restarted actor starts from fresh memory")
        return True


class LeaveNow(Exception):
    """From the in-flight hook, out of the middle of generation: the hub said goodbye
    (exit code 0) or stopped answering (1)."""

    def __init__(self, code: int, why: str, rejoin: bool = False):
        super().__init__(why)
        self.code, self.why, self.rejoin = code, why, rejoin


class InFlight:
    """The engine's step hook with sync.in_flight: between two decode steps, at most every
    `poll_s`, ask the hub for no prompts (`WorkRequest(max_groups=0)`; the hub answers a
    request during an outstanding grant like any other: `SyncOrder` or `Wait`) and join a
    waiting broadcast at once, so unfinished responses continue on the new weights.

    A broadcast that breaks off half-way leaves a staged receiver (sync.stage_on_actors)
    on its last complete weights, and decoding goes on with them. An unstaged one is
    left half-updated (`receiver.intact` False): no further token may come from it. The
    generation then waits here, asking the hub like the main loop does, until a
    broadcast completes, and continues on complete weights. Its tokens so far came from
    intact weights before the sync began, so nothing is discarded, and the grant stays
    this actor's: no prompt is lost or generated twice, and if the actor dies meanwhile
    the hub re-issues it. Every member of the broken group is in the same state, so
    handing the prompts back would not get them generated any sooner.
    """

    def __init__(self, syncer: Syncer, *, timeout_s: float, poll_s: float):
        self.syncer, self.timeout_s, self.poll_s = syncer, timeout_s, poll_s
        self.updates = 0  # in-flight syncs completed (weights changed mid-generation)
        self._next_poll = 0.0

    def __call__(self) -> None:
        if time.monotonic() < self._next_poll:
            return
        s = self.syncer
        while True:
            try:
                reply = s.hub.request(WorkRequest(actor_id=s.state["actor_id"], version=s.engine.version, max_groups=0))
            except TimeoutError:
                raise LeaveNow(1, f"the hub did not answer for {self.timeout_s:.0f}s") from None
            if isinstance(reply, Goodbye):
                raise LeaveNow(0, reply.reason, rejoin=reply.rejoin)
            if isinstance(reply, SyncOrder):
                completed = s.completed
                s.follow(reply)
                self.updates += s.completed - completed
            if s.receiver.intact:  # old or new weights, but one whole version: decode on
                break
            time.sleep(reply.seconds if isinstance(reply, Wait) else 0.05)
        self._next_poll = time.monotonic() + self.poll_s


def _sync(hub: HubClient, receiver, engine, order: SyncOrder, state: dict,
          spans: SpanRecorder) -> str:
    """Take part in the broadcast `order` names. A broadcast that breaks off (a peer
    killed, a timeout, rank 0 abandoning the epoch) costs one log line, not the actor.
    Weights that did not arrive as sent are not used, and the hub is told, so that
    rank 0 sends them again in a new epoch. Returns "done", "failed" or "rejected"."""
    actor_id = state["actor_id"]
    try:
        with spans.span("sync", version=order.version):
            receiver.receive(epoch=order.epoch, rank=order.rank, world_size=order.world_size,
                             store_host=order.store_host, store_port=order.store_port, version=order.version)
    except WeightMismatch as err:
        kept = f"keeping version {state['version']}" if receiver.intact else "generating nothing until a sync"
        log.error("actor %d: rejected the weights of version %d (epoch %d): %s; %s", actor_id, order.version,
                  order.epoch, err, kept)
        send(hub.sock, WeightsRejected(actor_id=actor_id, epoch=order.epoch, version=order.version,
                                       reason=str(err)[:MAX_FAILURE_NOTE]))
        return "rejected"
    except Exception as err:
        level = logging.INFO if isinstance(err, SyncAbandoned) else logging.WARNING
        log.log(level, "actor %d: weight sync of version %d (epoch %d) failed (%s); %s", actor_id, order.version,
                order.epoch, describe(err),
                "weights unchanged" if receiver.intact else "weights half-updated, generating nothing until a sync")
        return "failed"
    engine.set_version(order.version)
    state["version"] = order.version
    send(hub.sock, SyncDone(actor_id=actor_id, epoch=order.epoch, version=order.version))
    # Once per membership epoch at INFO: joins and recoveries show in the log, routine syncs do not.
    level = logging.INFO if order.epoch != state["epoch"] else logging.DEBUG
    state["epoch"] = order.epoch
    log.log(level, "actor %d synced to version %d (epoch %d, %s)", actor_id, order.version, order.epoch,
            receiver.transport)
    return "done"
