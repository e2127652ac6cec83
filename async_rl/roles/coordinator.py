"""Coordinator: runs as a thread on learner rank 0.

It owns the prompt cursor (admission index = prompt index), admission control, the
replay buffer, the actor registry, the weight-sync membership and the evaluation rounds
(evaluation.py). A prompt longer than the run's prompt limit is never granted: its
slot is marked skipped in the buffer, counted and logged. Actors talk to it
over a ROUTER socket (hello / work / heartbeat / sync-done / goodbye, one reply per
request; timeline spans come with the heartbeats and get no reply) and push experience
to a PULL socket. Every message is validated by the wire layer; anything inconsistent
with the coordinator's state is rejected and counted too. Valid spans go to the run's
trace writer (tracing.py).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..admission import Admission
from ..config import Config, to_yaml
from ..evaluation import EvalRounds, eval_prompt_ids
from ..replay_buffer import ReplayBuffer
from ..tasks.base import Task
from ..tasks.reward_guard import REASONS
from ..tracing import TraceWriter
from ..transport import (EvalResult, ExperienceGroup, Goodbye, Heartbeat, Hello, RejectCounter, SyncDone, SyncOrder,
                         TraceSpans, Wait, Welcome, WireLimits, WorkGrant, WorkRequest, claimed_group, read_frames, send)
from ..transport.security import CurveServer
from ..weight_sync import WeightBroadcaster

log = logging.getLogger("async_rl.coordinator")


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
    fd: int = -1  # the hub's file descriptor of its request connection (see _on_disconnects)


@dataclass
class Grant:
    actor_id: int
    version: int
    prompt_id: int


class Coordinator:
    def __init__(self, cfg: Config, task: Task, broadcaster: WeightBroadcaster, run_dir: Path,
                 trace: TraceWriter | None = None, prompt_length=None, prompt_limit: int | None = None):
        """`trace`: where the actors' timeline spans go (the learner's writer; by default
        one of our own that nobody writes out). `prompt_length(prompt)`: its length in
        tokens as the actors will encode it; prompts over `prompt_limit` are skipped."""
        self.cfg, self.task, self.broadcaster, self.run_dir = cfg, task, broadcaster, run_dir
        self.prompt_length, self.prompt_limit = prompt_length, prompt_limit
        self.skips_in_a_row = 0  # prompts skipped since the last one granted (all too long: a config error)
        self.evals = EvalRounds(eval_prompt_ids(task, cfg.eval.size), cfg.eval.batch_size)
        self._last_result = time.monotonic()
        self.trace = trace if trace is not None else TraceWriter(run_dir / "trace.json")
        self.admission = Admission(cfg.max_staleness, cfg.train.batch_groups)
        capacity = (cfg.max_staleness + 2) * cfg.train.batch_groups + cfg.actors.count * cfg.actors.groups_per_request
        self.buffer: ReplayBuffer[ExperienceGroup] = ReplayBuffer(cfg.max_staleness, capacity)
        self.limits = WireLimits()
        self.rejects = RejectCounter()
        self.reward_errors = dict.fromkeys(REASONS, 0)  # accepted groups' and eval results' failed reward calls
        self.version = 0  # learner version, set by the learner after each step
        self.actors: dict[int, ActorInfo] = {}
        self.granted: dict[int, Grant] = {}  # admission index -> who generates it
        self.reissue: deque[int] = deque()  # indices whose actor died before delivering
        self._next_actor_id = 0
        self._stopping = threading.Event()
        self._drain_s = 3.0
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()  # held while messages are handled; see snapshot()
        self.hub_addr = self.experience_addr = ""
        self._fd = -1  # connection of the hub message being handled (_drain)
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("coordinator failed to bind its sockets")

    def stop(self, drain_s: float = 3.0) -> None:
        """Tell every actor to leave (they get Goodbye on their next request), then close."""
        self._drain_s = drain_s
        self._stopping.set()
        self._thread.join(timeout=drain_s + 10)

    @property
    def live_actors(self) -> int:
        return len(self.actors)

    @property
    def actor_peak_rss_mb(self) -> float:
        return max((a.peak_rss_mb for a in self.actors.values()), default=0.0)

    def idle_s(self, since: float) -> float:
        """Seconds since the later of `since` (time.monotonic) and the last experience
        group or evaluation result accepted: how long the actors have given nothing."""
        return time.monotonic() - max(since, self._last_result)

    def reward_error_totals(self) -> dict[str, int]:
        """Failed reward calls per reason, summed over accepted groups and eval results."""
        with self._lock:
            return dict(self.reward_errors)

    def _count_reward_errors(self, counts: list[int]) -> None:
        for reason, n in zip(REASONS, counts):
            self.reward_errors[reason] += n

    def request_eval(self, version: int) -> None:
        with self._lock:
            self.evals.request(version)

    def eval_results(self) -> tuple[list[dict], int]:
        """(finished evaluation rounds' metrics lines, rounds still open or queued)."""
        with self._lock:
            return self.evals.take_done(), self.evals.pending

    # -- checkpoint state ---------------------------------------------------------
    def snapshot(self) -> tuple[dict, list[tuple[int, int, ExperienceGroup]]]:
        """A consistent copy of everything a resumed run needs (JSON state, buffered
        groups). Granted groups not yet delivered are recorded as pending: a resumed
        run re-issues them, so no admitted prompt is lost or counted twice."""
        with self._lock:
            state = {"admitted": self.admission.admitted, "next_actor_id": self._next_actor_id,
                     "pending": sorted({*self.granted, *self.reissue}), "buffer_next": self.buffer.next_index,
                     "consumed": self.buffer.consumed, "dropped": self.buffer.dropped,
                     "skipped": self.admission.skipped, "rejected": self.rejects.by_reason(),
                     "reward_errors": dict(self.reward_errors)}
            return state, self.buffer.contents()

    def restore(self, version: int, state: dict, groups: list[tuple[int, int, ExperienceGroup]]) -> None:
        """Load a snapshot; call before start(). Actor ids continue where they stopped,
        so a new actor never replays an old one's sampling stream (seeded by its id).
        Raises CheckpointError, changing nothing, unless every admitted slot is accounted for."""
        from ..checkpoint_integrity import check_partition

        check_partition(state, [index for index, _, _ in groups])
        self.version = version
        self.admission.admitted = state["admitted"]
        self.admission.skipped = list(state.get("skipped", []))
        self._next_actor_id = state["next_actor_id"]
        self.reissue.extend(state["pending"])
        self.buffer.restore(state["buffer_next"], groups, consumed=state["consumed"], dropped=state["dropped"],
                            skipped=[i for i in self.admission.skipped if i >= state["buffer_next"]])
        self.rejects.preload(state["rejected"])
        for reason, n in state.get("reward_errors", {}).items():  # absent before reward errors were counted
            if reason in self.reward_errors:
                self.reward_errors[reason] += int(n)

    # -- the loop -----------------------------------------------------------------
    def _bind(self, ctx: zmq.Context, kind: int, port: int, curve) -> tuple[zmq.Socket, str]:
        sock = ctx.socket(kind)
        if curve is not None:
            curve.secure(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.transport.hwm if kind == zmq.PULL else 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        sock.setsockopt(zmq.SNDTIMEO, int(self.cfg.transport.timeout_s * 1000))
        host = self.cfg.transport.host
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        return sock, f"tcp://{host}:{port}"

    def _run(self) -> None:
        ctx = zmq.Context()
        curve = CurveServer(ctx, self.cfg.security.keys_dir) if self.cfg.security.curve else None
        hub, self.hub_addr = self._bind(ctx, zmq.ROUTER, self.cfg.transport.hub_port, curve)
        hub.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A closed connection (the kernel closes a killed process's sockets) names its
        # file descriptor: the actor whose requests came through it is reaped at once,
        # not after actors.heartbeat_timeout_s. (ROUTER_NOTIFY, which would name the
        # peer, is a draft API that pyzmq's libzmq is not built with.)
        disconnects = hub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pull, self.experience_addr = self._bind(ctx, zmq.PULL, self.cfg.transport.experience_port, curve)
        self._write_endpoints()
        self._ready.set()
        poller = zmq.Poller()
        poller.register(hub, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(disconnects, zmq.POLLIN)
        stop_deadline = None
        try:
            while True:
                if self._stopping.is_set():
                    stop_deadline = stop_deadline or time.monotonic() + self._drain_s
                    if not self.actors or time.monotonic() > stop_deadline:
                        break
                events = dict(poller.poll(50))
                with self._lock:  # a checkpoint snapshot sees the state between messages
                    if hub in events:
                        for identity, msg in self._drain(hub, routed=True, most=64):
                            self._on_request(hub, identity, msg)
                    if disconnects in events:
                        self._on_disconnects(disconnects)
                    if pull in events:
                        for _, msg in self._drain(pull, routed=False, most=256, on_reject=self._on_rejected_group):
                            self._on_experience(msg)
                    self._reap_dead()
        finally:
            hub.disable_monitor()
            disconnects.close(0)
            hub.close(0)
            pull.close(0)
            if curve is not None:
                curve.stop()
            ctx.term()
            self._stopped.set()

    def _drain(self, sock: zmq.Socket, *, routed: bool, most: int, on_reject=None):
        """Up to `most` valid messages already queued (invalid ones are counted by
        read_frames). On the hub, `self._fd` is the connection the message came through."""
        for _ in range(most):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._fd = parts[0].get(zmq.SRCFD) if routed else -1
            identity, msg = read_frames(parts, self.limits, self.rejects, routed=routed, on_reject=on_reject)
            if msg is not None:
                yield identity, msg

    def _on_disconnects(self, monitor: zmq.Socket) -> None:
        while monitor.poll(0):
            fd = recv_monitor_message(monitor)["value"]
            # A new connection may reuse the number before we see this event: then a live
            # actor is removed, and registers again on its next request (rejoin).
            for actor in [a for a in self.actors.values() if a.fd == fd]:
                self._remove(actor.actor_id, "its connection closed")

    # -- requests -----------------------------------------------------------------
    def _reply(self, hub: zmq.Socket, identity: bytes, msg) -> None:
        try:
            send(hub, msg, identity=identity)
        except zmq.ZMQError as err:  # peer vanished (ROUTER_MANDATORY) or queue full
            log.warning("could not reply to an actor: %s", err)

    def _on_request(self, hub: zmq.Socket, identity: bytes, msg) -> None:
        now = time.monotonic()
        if isinstance(msg, Hello):
            self._register(hub, identity, msg, now)
            return
        actor = self.actors.get(getattr(msg, "actor_id", -1))
        if actor is None:
            if isinstance(msg, Goodbye):
                return  # an actor we already removed, leaving too: nothing to do
            self.rejects.reject("unknown_actor")
            if isinstance(msg, WorkRequest):  # e.g. stalled past the heartbeat timeout, now back
                self._reply(hub, identity, Goodbye(reason="unknown actor: register with hello first", rejoin=True))
            return
        if identity != actor.identity and not isinstance(msg, (Heartbeat, TraceSpans)):
            # Requests come from the socket that registered (heartbeats and the spans
            # shipped with them have their own):
            # a peer that guesses an actor id cannot take its grants or its place.
            self.rejects.reject("identity_mismatch")
            return
        actor.last_seen = now
        if identity == actor.identity:
            actor.fd = self._fd
        if isinstance(msg, Heartbeat):
            actor.version = max(actor.version, msg.version)
            actor.peak_rss_mb = msg.peak_rss_mb
        elif isinstance(msg, TraceSpans):  # validated by the wire layer; no reply
            self.trace.add_actor_spans(msg.actor_id, msg.names, msg.start_us, msg.dur_us, msg.args, msg.dropped)
        elif isinstance(msg, SyncDone):
            actor.version = max(actor.version, msg.version)
            actor.synced = (msg.epoch, msg.version)
        elif isinstance(msg, Goodbye):
            self._remove(actor.actor_id, "said goodbye", level=logging.INFO)
        elif isinstance(msg, WorkRequest):
            if msg.version > self.version:
                self.rejects.reject("future_version")
                self._reply(hub, identity, Wait(seconds=0.1))
                return
            actor.version = msg.version
            if not actor.ready:
                actor.ready = True
                self._membership_changed()
            self._reply(hub, identity, self._answer_work(actor, msg))
        else:
            self.rejects.reject("unexpected_kind")

    def _answer_work(self, actor: ActorInfo, req: WorkRequest):
        if self._stopping.is_set():
            return Goodbye(reason="run finished")
        if req.max_groups > 0:  # intact weights: evaluation first, also before a sync (see evaluation.py)
            grant = self.evals.grant(actor.actor_id, req.version, {a.version for a in self.actors.values() if a.ready})
            if grant is not None:
                return grant
        job = self.broadcaster.job()
        # Every member must join each broadcast, also one that already holds these
        # weights: a membership change needs the new epoch's group formed by all.
        if job is not None and actor.actor_id in job.members and actor.synced != (job.epoch, job.version):
            return SyncOrder(epoch=job.epoch, rank=job.rank_of(actor.actor_id), world_size=len(job.members) + 1,
                             store_host=self.broadcaster.host, store_port=self.broadcaster.port, version=job.version)
        indices, prompts = [], []
        for i in self._admit(req.version, req.max_groups):
            prompt = self.task.train_prompt(i)
            if self._too_long(prompt):
                self.admission.skip(i)
                self.buffer.skip(i)
                continue
            self.skips_in_a_row = 0
            indices.append(i)
            prompts.append(prompt)
            self.granted[i] = Grant(actor.actor_id, req.version, prompt.id)
            actor.outstanding.add(i)
        if not indices:
            return Wait(seconds=0.02)
        return WorkGrant(groups=indices, prompt_ids=[p.id for p in prompts])

    def _too_long(self, prompt) -> bool:
        if self.prompt_length is None or self.prompt_limit is None:
            return False
        length = self.prompt_length(prompt)
        if length <= self.prompt_limit:
            return False
        skipped = len(self.admission.skipped) + 1
        if skipped <= 10 or skipped % 1000 == 0:  # a few lines, then a reminder now and then
            log.warning("prompt %d skipped: %d tokens, over the limit of %d (task.max_prompt_tokens); %d skipped so far",
                        prompt.id, length, self.prompt_limit, skipped)
        self.skips_in_a_row += 1
        return True

    def _admit(self, version: int, wanted: int) -> list[int]:
        # Re-issued slots first (oldest first), under the same bound as new admissions.
        out = [i for i in self.reissue if self.admission.allows(i, version)][:wanted]
        for i in out:
            self.reissue.remove(i)
        out.extend(self.admission.admit(version, wanted - len(out)))
        return out

    def _register(self, hub: zmq.Socket, identity: bytes, msg: Hello, now: float) -> None:
        actor_id = self._next_actor_id
        self._next_actor_id += 1
        self.actors[actor_id] = ActorInfo(actor_id, msg.actor_name, msg.pid, msg.host, identity, now, fd=self._fd)
        log.info("actor %d (%s, pid %d) joined", actor_id, msg.actor_name, msg.pid)
        self._membership_changed()
        self._reply(hub, identity, Welcome(actor_id=actor_id, config_yaml=to_yaml(self.cfg),
                                           experience_addr=self.experience_addr, version=self.version))

    def _remove(self, actor_id: int, why: str, level: int = logging.WARNING) -> None:
        actor = self.actors.pop(actor_id, None)
        if actor is None:
            return
        log.log(level, "actor %d (%s) removed: %s", actor_id, actor.name, why)
        for index in sorted(actor.outstanding):  # lose no admitted prompt
            self.granted.pop(index, None)
            self.reissue.append(index)
        self.evals.actor_left(actor_id)
        self._membership_changed()

    def _reap_dead(self) -> None:
        timeout = self.cfg.actors.heartbeat_timeout_s
        now = time.monotonic()
        for actor in [a for a in self.actors.values() if now - a.last_seen > timeout]:
            self._remove(actor.actor_id, f"no heartbeat for {timeout:.0f}s")

    def _membership_changed(self) -> None:
        self.broadcaster.set_members(a.actor_id for a in self.actors.values() if a.ready)
        self._write_endpoints()

    def _write_endpoints(self) -> None:
        data = {
            "hub": self.hub_addr, "experience": self.experience_addr,
            "store": f"{self.broadcaster.host}:{self.broadcaster.port}", "learner_pid": os.getpid(),
            "actors": [{"id": a.actor_id, "pid": a.pid, "name": a.name, "host": a.host} for a in self.actors.values()],
        }
        tmp = self.run_dir / "endpoints.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.run_dir / "endpoints.json")  # readers never see a half-written file

    # -- experience ---------------------------------------------------------------
    def _give_back(self, actor_id: int, index: int) -> None:
        """Every grant ends exactly once: a group of a live actor's grant that is refused
        for any reason is generated again (re-issued), like the grants of an actor that left."""
        grant = self.granted.get(index)
        if grant is None or grant.actor_id != actor_id:
            return
        del self.granted[index]
        actor = self.actors.get(actor_id)
        if actor is not None:
            actor.outstanding.discard(index)
        self.reissue.append(index)

    def _on_rejected_group(self, frames) -> None:
        claim = claimed_group(frames, self.limits)
        if claim is not None:
            self._give_back(*claim)

    def _on_experience(self, msg) -> None:
        if isinstance(msg, EvalResult):
            reason = self.evals.on_result(msg)
            if reason is None:
                self._last_result = time.monotonic()
                self._count_reward_errors(msg.reward_errors)
            elif reason == "stale_eval":  # scored for a round that started over: not an invalid message
                log.debug("actor %d: evaluation result of an earlier round ignored", msg.actor_id)
            elif reason is not None:
                self.rejects.reject(reason)
            return
        if not isinstance(msg, ExperienceGroup):
            self.rejects.reject("unexpected_kind")
            return
        grant = self.granted.get(msg.group)
        if grant is None or grant.actor_id != msg.actor_id:
            self.rejects.reject("not_granted")
            return
        reason = None
        if msg.version < grant.version or msg.version > self.version:
            reason = "bad_version"
        elif msg.response_tokens.shape[0] != self.cfg.train.group_size or msg.prompt_id != grant.prompt_id:
            reason = "bad_group"
        elif self.cfg.train.advantage == "remax" and msg.greedy_reward is None:
            reason = "missing_baseline"
        if reason is not None:
            self.rejects.reject(reason)
            self._give_back(msg.actor_id, msg.group)
            return
        stored = self.buffer.put(msg.group, msg.version, msg)
        self._last_result = time.monotonic()
        if stored:  # a refused group is generated (and scored) again: counted then
            self._count_reward_errors(msg.reward_errors)
        else:
            # Only a full buffer refuses a granted slot (admission keeps it below its
            # capacity): generate the slot again later rather than lose it.
            self.rejects.reject("buffer_refused")
            self.reissue.append(msg.group)
        del self.granted[msg.group]
        actor = self.actors.get(msg.actor_id)
        if actor is not None:
            actor.outstanding.discard(msg.group)
