"""Coordinator: runs as a thread on learner rank 0.

It owns the prompt cursor (admission index = prompt index), admission control, the
replay buffer, the actor registry (actor_registry.py), the weight-sync membership and
the evaluation rounds (eval_rounds.py). A prompt longer than the run's prompt limit is
never granted: its slot is marked skipped in the buffer, counted and logged. Actors
talk to it through the hub (hub.py): hello / work / heartbeat / sync-done / goodbye
requests, timeline spans with the heartbeats, experience pushed separately. Anything
inconsistent with the coordinator's state is rejected and counted like an invalid
message. Valid spans go to the run's trace writer (run/tracing.py).

The learner uses it through a few calls: `take` a batch, `advance` the version,
`counters` for its metrics line, `request_eval` / `eval_results`, `snapshot` /
`restore` for checkpoints, and `idle_s` / `too_long_in_a_row` to tell a run that can
get no more data.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from async_rl.config import Config, to_yaml
from async_rl.coordinator.actor_registry import ActorInfo, ActorRegistry
from async_rl.coordinator.admission import Admission
from async_rl.coordinator.eval_rounds import EvalRounds, eval_prompt_ids
from async_rl.coordinator.hub import Hub
from async_rl.coordinator.replay_buffer import ReplayBuffer, Taken
from async_rl.run.tracing import TraceWriter
from async_rl.tasks.base import Task
from async_rl.weight_transfer.sender import WeightSender
from async_rl.wire import (
    EvalResult,
    ExperienceGroup,
    Goodbye,
    Heartbeat,
    Hello,
    RejectCounter,
    SyncDone,
    SyncOrder,
    TraceSpans,
    Wait,
    WeightsRejected,
    Welcome,
    WireLimits,
    WorkGrant,
    WorkRequest,
    claimed_group,
)
from async_rl.wire.messages import ERROR_FIELDS, FAILURE_REASONS

log = logging.getLogger("async_rl.coordinator")

# How long the end of a run waits for the actors' goodbyes. An actor sees its goodbye
# only at its next request, after the generation or weight sync in hand, and its last
# timeline spans travel with the goodbye: on a loaded machine that takes seconds. Actors
# that have all left end the wait at once.
GOODBYE_WAIT_S = 10.0


@dataclass
class Grant:
    actor_id: int
    version: int
    prompt_id: int


class Coordinator:
    def __init__(self, cfg: Config, task: Task, sender: WeightSender, run_dir: Path,
                 trace: TraceWriter | None = None, prompt_over_limit=None, prompt_limit: int | None = None):
        """`trace`: where the actors' timeline spans go (the learner's writer; by default
        one of our own that nobody writes out). `prompt_over_limit(prompt)`: None when the
        prompt, as the actors will encode it, is at most `prompt_limit` tokens, else what
        makes it longer ("812 tokens"); such prompts are skipped."""
        self.cfg, self.task, self.sender, self.run_dir = cfg, task, sender, run_dir
        self.prompt_over_limit, self.prompt_limit = prompt_over_limit, prompt_limit
        self._too_long_streak = 0  # prompts skipped since the last one granted (all too long: a config error)
        self.evals = EvalRounds(eval_prompt_ids(task, cfg.eval.size), cfg.eval.batch_size)
        self._last_result = time.monotonic()
        self.trace = trace if trace is not None else TraceWriter(run_dir / "trace.json")
        self.admission = Admission(cfg.max_staleness, cfg.train.batch_groups)
        capacity = (cfg.max_staleness + 2) * cfg.train.batch_groups + cfg.actors.count * cfg.actors.groups_per_request
        self.buffer: ReplayBuffer[ExperienceGroup] = ReplayBuffer(cfg.max_staleness, capacity)
        self.limits = WireLimits()
        self.rejects = RejectCounter()
        # Accepted groups' and eval results' failed user-code calls per reason: the
        # reward's (reward_errors) and the environment's (env_errors), as the wire counts them.
        self.errors = {field: dict.fromkeys(FAILURE_REASONS, 0) for field in ERROR_FIELDS}
        self.version = 0  # the learner's version (advance)
        self.actors = ActorRegistry()
        self.granted: dict[int, Grant] = {}  # admission index -> who generates it
        self.reissue: deque[int] = deque()  # indices whose actor died before delivering
        self.weights_rejected = 0  # syncs an actor received and refused: not what rank 0 sent
        self._stopping = threading.Event()  # from now on every actor is told to leave
        self._lock = threading.Lock()  # held while messages are handled; see snapshot()
        self.hub = Hub(cfg, self.rejects, self._lock)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self.hub.start(self, self.limits)
        with self._lock:  # the hub may be handling a first request already
            self._write_endpoints()

    def stop(self, drain_s: float = GOODBYE_WAIT_S) -> None:
        """Tell every actor to leave (they get Goodbye on their next request), then close
        once all have said goodbye, or after `drain_s`."""
        self._stopping.set()
        self.hub.stop(drain_s)

    @property
    def hub_addr(self) -> str:
        return self.hub.request_addr

    @property
    def experience_addr(self) -> str:
        return self.hub.experience_addr

    # -- what the learner asks ----------------------------------------------------
    def take(self, n: int, version: int, timeout: float | None = None,
             stop: threading.Event | None = None) -> Taken[ExperienceGroup] | None:
        """The next `n` groups in admission order for the learner at `version` (older
        ones are dropped and counted); None after `timeout` s or once `stop` is set."""
        return self.buffer.take(n, learner_version=version, timeout=timeout, stop=stop)

    def advance(self, version: int) -> None:
        """The learner's new version: requests at it are served from now on."""
        self.version = version

    def counters(self) -> dict[str, float]:
        """The coordinator's part of a step's metrics line, totals so far."""
        with self._lock:
            counts = {prefix: dict(self.errors[field]) for field, prefix in ERROR_FIELDS.items()}
            return {"staleness/dropped": self.buffer.dropped, "wire/rejected": self.rejects.total,
                    "actors/live": len(self.actors), "sync/rejected": self.weights_rejected,
                    "data/prompts_admitted": self.admission.admitted,
                    "data/prompts_consumed": self.buffer.consumed, "data/prompts_skipped": len(self.admission.skipped),
                    "memory/actor_peak_rss_gb": self.actors.peak_rss_mb() / 1024,
                    **{f"{prefix}/errors": sum(by_reason.values()) for prefix, by_reason in counts.items()},
                    **{f"{prefix}/errors_{r}": n for prefix, by_reason in counts.items() for r, n in by_reason.items()}}

    @property
    def live_actors(self) -> int:
        return len(self.actors)

    def idle_s(self, since: float) -> float:
        """Seconds since the later of `since` (time.monotonic) and the last experience
        group or evaluation result accepted: how long the actors have given nothing."""
        return time.monotonic() - max(since, self._last_result)

    def too_long_in_a_row(self) -> int:
        """Prompts skipped as too long since the last one granted."""
        return self._too_long_streak

    def error_totals(self) -> dict[str, dict[str, int]]:
        """Failed user-code calls per wire field (reward_errors, env_errors) and reason,
        summed over accepted groups and eval results."""
        with self._lock:
            return {field: dict(counts) for field, counts in self.errors.items()}

    def _count_errors(self, msg: ExperienceGroup | EvalResult) -> None:
        for field, counts in self.errors.items():
            for reason, n in zip(FAILURE_REASONS, getattr(msg, field)):
                counts[reason] += n

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
        groups), sharing nothing the hub goes on changing while it is written. Granted
        groups not yet delivered are recorded as pending: a resumed run re-issues them,
        so no admitted prompt is lost or counted twice."""
        with self._lock:
            state = {"admitted": self.admission.admitted, "next_actor_id": self.actors.next_id,
                     "pending": sorted({*self.granted, *self.reissue}), "buffer_next": self.buffer.next_index,
                     "consumed": self.buffer.consumed, "dropped": self.buffer.dropped,
                     "skipped": list(self.admission.skipped), "rejected": self.rejects.by_reason(),
                     **{field: dict(counts) for field, counts in self.errors.items()}}
            return state, self.buffer.contents()

    def restore(self, version: int, state: dict, groups: list[tuple[int, int, ExperienceGroup]]) -> None:
        """Load a snapshot; call before start(). Actor ids continue where they stopped.
        Raises CheckpointError, changing nothing, unless every admitted slot is accounted for."""
        from async_rl.run.checkpoints import check_partition

        check_partition(state, [index for index, _, _ in groups])
        self.version = version
        self.admission.admitted = state["admitted"]
        self.admission.skipped = list(state.get("skipped", []))
        self.actors.next_id = state["next_actor_id"]
        self.reissue.extend(state["pending"])
        self.buffer.restore(state["buffer_next"], groups, consumed=state["consumed"], dropped=state["dropped"],
                            skipped=[i for i in self.admission.skipped if i >= state["buffer_next"]])
        self.rejects.preload(state["rejected"])
        for field, counts in self.errors.items():
            for reason, n in state.get(field, {}).items():  # absent before such errors were counted
                if reason in counts:
                    counts[reason] += int(n)
        log.info("restored %d buffered groups, %d prompts to re-issue", len(self.buffer), len(self.reissue))

    # -- requests (Hub's Handler) ---------------------------------------------------
    def on_request(self, identity: bytes, fd: int, msg):
        now = time.monotonic()
        if isinstance(msg, Hello):
            return self._register(identity, fd, msg, now)
        actor = self.actors.get(getattr(msg, "actor_id", -1))
        if actor is None:
            if isinstance(msg, Goodbye):
                return None  # an actor we already removed, leaving too: nothing to do
            if isinstance(msg, TraceSpans) and 0 <= msg.actor_id < self.actors.next_id:
                # Spans shipped on the heartbeat socket may arrive after the goodbye sent
                # on the request socket: still that actor's, and only trace data.
                self.trace.add_actor_spans(msg.actor_id, msg.names, msg.start_us, msg.dur_us, msg.args, msg.dropped)
                return None
            self.rejects.reject("unknown_actor")
            if isinstance(msg, WorkRequest):  # e.g. stalled past the heartbeat timeout, now back
                return Goodbye(reason="unknown actor: register with hello first", rejoin=True)
            return None
        if identity != actor.identity and not isinstance(msg, (Heartbeat, TraceSpans)):
            # Requests come from the socket that registered (heartbeats and the spans
            # shipped with them have their own):
            # a peer that guesses an actor id cannot take its grants or its place.
            self.rejects.reject("identity_mismatch")
            return None
        actor.last_seen = now
        if identity == actor.identity:
            actor.fd = fd
        if isinstance(msg, Heartbeat):
            actor.version = max(actor.version, msg.version)
            actor.peak_rss_mb = msg.peak_rss_mb
        elif isinstance(msg, TraceSpans):
            self.trace.add_actor_spans(msg.actor_id, msg.names, msg.start_us, msg.dur_us, msg.args, msg.dropped)
        elif isinstance(msg, SyncDone):
            actor.version = max(actor.version, msg.version)
            actor.synced = (msg.epoch, msg.version)
        elif isinstance(msg, WeightsRejected):
            self._weights_rejected(actor, msg)
        elif isinstance(msg, Goodbye):
            self._remove(actor.actor_id, "said goodbye", level=logging.INFO)
        elif isinstance(msg, WorkRequest):
            if msg.version > self.version:
                self.rejects.reject("future_version")
                return Wait(seconds=0.1)
            actor.version = msg.version
            if not actor.ready:
                actor.ready = True
                self._membership_changed()
            return self._answer_work(actor, msg)
        else:
            self.rejects.reject("unexpected_kind")
        return None

    def _weights_rejected(self, actor: ActorInfo, msg: WeightsRejected) -> None:
        """The actor's weights of a version failed their check: it kept its last whole
        version (or generates nothing); rank 0 sends the current one again to a new epoch."""
        if msg.version > self.version:
            self.rejects.reject("future_version")
            return
        self.weights_rejected += 1
        log.warning("actor %d (%s) rejected the weights of version %d (epoch %d): %s; sending them again",
                    actor.actor_id, actor.name, msg.version, msg.epoch, msg.reason)
        self.sender.resend(msg.epoch)

    def _answer_work(self, actor: ActorInfo, req: WorkRequest):
        if self._stopping.is_set():
            return Goodbye(reason="run finished")
        if req.max_groups > 0:  # intact weights: evaluation first, also before a sync (see eval_rounds.py)
            grant = self.evals.grant(actor.actor_id, req.version, self.actors.ready_versions())
            if grant is not None:
                return grant
        job = self.sender.job()
        # Every member must join each broadcast, also one that already holds these
        # weights: a membership change needs the new epoch's group formed by all.
        if job is not None and actor.actor_id in job.members and actor.synced != (job.epoch, job.version):
            return SyncOrder(epoch=job.epoch, rank=job.rank_of(actor.actor_id), world_size=len(job.members) + 1,
                             store_host=self.sender.host, store_port=self.sender.port, version=job.version)
        # Past the last step the learner takes no more batches.
        wanted = req.max_groups if self.version < self.cfg.train.max_steps else 0
        indices, prompts = [], []
        for i in self._admit(req.version, wanted):
            prompt = self.task.train_prompt(i)
            if self._too_long(prompt):
                self.admission.skip(i)
                self.buffer.skip(i)
                continue
            self._too_long_streak = 0
            indices.append(i)
            prompts.append(prompt)
            self.granted[i] = Grant(actor.actor_id, req.version, prompt.id)
            actor.outstanding.add(i)
        if not indices:
            return Wait(seconds=0.02)
        return WorkGrant(groups=indices, prompt_ids=[p.id for p in prompts])

    def _too_long(self, prompt) -> bool:
        if self.prompt_over_limit is None or self.prompt_limit is None:
            return False
        length = self.prompt_over_limit(prompt)
        if length is None:
            return False
        skipped = len(self.admission.skipped) + 1
        if skipped <= 10 or skipped % 1000 == 0:  # a few lines, then a reminder now and then
            log.warning("prompt %d skipped: %s, over the limit of %d tokens (task.max_prompt_tokens); "
                        "%d skipped so far", prompt.id, length, self.prompt_limit, skipped)
        self._too_long_streak += 1
        return True

    def _admit(self, version: int, wanted: int) -> list[int]:
        # Re-issued slots first (oldest first), under the same bound as new admissions.
        out = [i for i in self.reissue if self.admission.allows(i, version)][:wanted]
        for i in out:
            self.reissue.remove(i)
        out.extend(self.admission.admit(version, wanted - len(out)))
        return out

    def _register(self, identity: bytes, fd: int, msg: Hello, now: float) -> Welcome:
        actor = self.actors.add(msg, identity, fd, now)
        log.info("actor %d (%s, pid %d) joined", actor.actor_id, msg.actor_name, msg.pid)
        self._membership_changed()
        return Welcome(actor_id=actor.actor_id, config_yaml=to_yaml(self.cfg), experience_addr=self.experience_addr,
                       version=self.version)

    def _remove(self, actor_id: int, why: str, level: int = logging.WARNING) -> None:
        actor = self.actors.pop(actor_id)
        if actor is None:
            return
        log.log(level, "actor %d (%s) removed: %s", actor_id, actor.name, why)
        for index in sorted(actor.outstanding):  # lose no admitted prompt
            self.granted.pop(index, None)
            self.reissue.append(index)
        self.evals.actor_left(actor_id)
        self._membership_changed()

    def on_disconnect(self, fd: int) -> None:
        for actor in self.actors.connected_through(fd):
            self._remove(actor.actor_id, "its connection closed")

    def on_tick(self) -> None:
        timeout = self.cfg.actors.heartbeat_timeout_s
        for actor in self.actors.silent(time.monotonic(), timeout):
            self._remove(actor.actor_id, f"no heartbeat for {timeout:.0f}s")

    def _membership_changed(self) -> None:
        self.sender.set_members(self.actors.ready_ids())
        self._write_endpoints()

    def _write_endpoints(self) -> None:
        data = {"hub": self.hub_addr, "experience": self.experience_addr,
                "store": f"{self.sender.host}:{self.sender.port}", "learner_pid": os.getpid(),
                "actors": self.actors.describe()}
        tmp = self.run_dir / "endpoints.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.run_dir / "endpoints.json")  # readers never see a half-written file

    # -- experience (Hub's Handler) -------------------------------------------------
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

    def on_rejected_group(self, frames) -> None:
        claim = claimed_group(frames, self.limits)
        if claim is not None:
            self._give_back(*claim)

    def on_experience(self, msg) -> None:
        if isinstance(msg, EvalResult):
            self._on_eval_result(msg)
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
        elif len(msg.response_lengths) != self.cfg.train.group_size or msg.prompt_id != grant.prompt_id:
            reason = "bad_group"
        elif self.cfg.train.advantage.name == "remax" and msg.greedy_reward is None:
            reason = "missing_baseline"
        if reason is not None:
            self.rejects.reject(reason)
            self._give_back(msg.actor_id, msg.group)
            return
        stored = self.buffer.put(msg.group, msg.version, msg)
        self._last_result = time.monotonic()
        if stored:  # a refused group is generated (and scored) again: counted then
            self._count_errors(msg)
        else:
            # Only a full buffer refuses a granted slot (admission keeps it below its
            # capacity): generate the slot again later rather than lose it.
            self.rejects.reject("buffer_refused")
            self.reissue.append(msg.group)
        del self.granted[msg.group]
        actor = self.actors.get(msg.actor_id)
        if actor is not None:
            actor.outstanding.discard(msg.group)

    def _on_eval_result(self, msg: EvalResult) -> None:
        reason = self.evals.on_result(msg)
        if reason is None:
            self._last_result = time.monotonic()
            self._count_errors(msg)
        elif reason == "stale_eval":  # scored for a round that started over: not an invalid message
            log.debug("actor %d: evaluation result of an earlier round ignored", msg.actor_id)
        else:
            self.rejects.reject(reason)
