"""The discrete-event model of the actor-learner pipeline that benchmarks/simulate.py runs:
samples/s, learner idle fraction and the staleness distribution, from component rates.

The model (one heapq of (time, seq, callback) events):
- Actor (actor/process.py, coordinator/coordinator.py): a work request is answered at
  once with a sync order (a broadcast is in flight that this actor has not received),
  else a grant of min(groups_per_request, admission_limit - admitted) groups
  (async_rl/staleness.py, the rule coordinator/admission.py enforces; v = the actor's
  weight version), else Wait: sleep 0.02 s, ask again. n granted groups take
  n * (gen + overhead) seconds and are pushed together; the learner sees them
  `delivery_seconds` later (the hub's receive, the buffer, the learner thread's
  wake-up), while the actor asks again at once. A request costs `request_seconds`.
- Learner (learner/loop.py): takes groups B*k .. B*k+B-1 (admission order) once all
  have arrived (that wait is its idle time), trains `step_seconds`, version += 1, every
  sync.every steps gathers `sync_seconds` and publishes, logs the step, then spends
  `log_seconds` (metrics logging, after the publish) and the evaluation and checkpoint
  pauses the config schedules. Staleness of a group = k - v.
- Broadcast (weight_transfer/sender.py): a publish starts a broadcast unless one is in flight (the
  newest version then waits for it). An actor joins at its next request. The transports
  couple the members (`broadcast_coupled`, the default): the gloo chain forwards each
  bucket through every member in turn and NCCL broadcasts to all, so every member holds
  the new weights `broadcast_seconds` after the last has joined. Uncoupled, a sender
  that serves each receiver as it joins, an actor holds them `broadcast_seconds` after
  its own join. The broadcast ends when all have them.
- Durations are lognormal around their means (`*_cv`); results average a few seeds.

Measured alike in a run and in the model, over the window from step k0 to the last step
K: samples/s = B*G*(K - k0) / (time_K - time_k0); idle fraction = learner wait / window
length; staleness over the window's samples. k0 = K/4 (at most 100) leaves out start-up
(actors loading, torch warm-up, the first broadcast's rendezvous, the buffer filling).
Evaluations and checkpoints in the window are modelled as learner pauses of their
measured length (eval line time - step line time; checkpoint: the next step's extra time).
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field, replace

from async_rl.staleness import admission_limit, staleness

POLL_SECONDS = 0.02  # the coordinator's Wait reply when admission blocks (coordinator/coordinator.py)


@dataclass
class Params:
    actors: int = 1
    batch_groups: int = 64  # B
    group_size: int = 8  # G
    groups_per_request: int = 16
    max_staleness: int = 2  # eta
    sync_every: int = 1
    steps: int = 200
    gen_seconds_per_group: list[float] = field(default_factory=lambda: [0.002])  # cycled over actors
    overhead_seconds_per_group: float = 0.0
    request_seconds: float = 0.0003
    delivery_seconds: float = 0.0
    step_seconds: float = 0.03
    log_seconds: float = 0.0
    sync_seconds: float = 0.002
    broadcast_seconds: float = 0.002
    broadcast_coupled: bool = True
    eval_every: int = 0
    eval_seconds: float = 0.0
    checkpoint_every: int = 0
    checkpoint_seconds: float = 0.0
    learner_ranks: int = 1
    gen_cv: float = 0.2
    step_cv: float = 0.2
    broadcast_cv: float = 0.0
    step_replay: list[float] | None = None  # busy seconds of step k (0-based), instead of step_seconds
    gen_replay: list[float] | None = None  # seconds per group generated with weights of version v
    sync_replay: dict[int, float] | None = None  # seconds for an actor to receive version v


def stationary(p: Params) -> Params:
    return replace(p, step_replay=None, gen_replay=None, sync_replay=None)


class Sim:
    def __init__(self, p: Params, seed: int = 0):
        if p.sync_every > p.max_staleness + 1:
            raise ValueError("sync_every > max_staleness + 1 deadlocks (the config rejects it)")
        self.p, self.rng = p, random.Random(seed)
        self.now, self.seq, self.events = 0.0, 0, []
        self.admitted = 0
        self.buffer: dict[int, int] = {}  # admission index -> weight version that generated it
        self.version = [0] * p.actors
        self.job: dict | None = None  # the broadcast in flight: version, start, joined
        self.pending: int | None = None  # newest published version waiting for the broadcast
        self.learner_version, self.waiting_since = 0, None
        self.log: list[dict] = []  # one record per step, like metrics.jsonl
        self.broadcasts: list[float] = []  # seconds from the start of a broadcast to the last actor served
        self.done = False

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def run(self) -> list[dict]:
        for a in range(self.p.actors):
            self.at(0.0, self.request, a)
        self.at(0.0, self.take)
        while self.events and not self.done:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return self.log

    def noisy(self, mean: float, cv: float) -> float:
        if mean <= 0 or cv <= 0:
            return max(mean, 0.0)
        sigma = math.sqrt(math.log1p(cv * cv))
        return mean * self.rng.lognormvariate(-sigma * sigma / 2, sigma)

    # -- actors, the coordinator and the broadcast ------------------------------------------
    def request(self, a: int) -> None:
        p, job = self.p, self.job
        if job is not None and a not in job["joined"]:  # SyncOrder: join the broadcast
            job["joined"].add(a)
            if p.sync_replay and job["version"] in p.sync_replay:
                transfer = p.sync_replay[job["version"]]
            else:
                transfer = self.noisy(p.broadcast_seconds, p.broadcast_cv)
            done = self.now + p.request_seconds + transfer
            if len(job["joined"]) == p.actors:
                for b in job["joined"] if p.broadcast_coupled else [a]:
                    self.at(done, self.received, b, job["version"])
                self.at(done, self.broadcast_done)
            elif not p.broadcast_coupled:
                self.at(done, self.received, a, job["version"])
            return
        v = self.version[a]
        n = min(p.groups_per_request, admission_limit(p.max_staleness, v, p.batch_groups) - self.admitted)
        if n <= 0:  # Wait
            self.at(self.now + p.request_seconds + POLL_SECONDS, self.request, a)
            return
        first, self.admitted = self.admitted, self.admitted + n
        gen = p.gen_replay[min(v, len(p.gen_replay) - 1)] if p.gen_replay else \
            p.gen_seconds_per_group[a % len(p.gen_seconds_per_group)]
        seconds = self.noisy(n * gen, p.gen_cv) + n * p.overhead_seconds_per_group + p.request_seconds
        self.at(self.now + seconds, self.delivered, a, range(first, first + n), v)

    def delivered(self, a: int, indices: range, version: int) -> None:
        self.request(a)
        if self.p.delivery_seconds > 0:
            self.at(self.now + self.p.delivery_seconds, self.arrived, indices, version)
        else:
            self.arrived(indices, version)

    def arrived(self, indices: range, version: int) -> None:
        for i in indices:
            self.buffer[i] = version
        if self.waiting_since is not None:
            self.take()

    def received(self, a: int, version: int) -> None:
        self.version[a] = version
        self.request(a)

    def publish(self, version: int) -> None:
        if self.job is None and self.p.actors:
            self.job = {"version": version, "joined": set(), "start": self.now}
        else:
            self.pending = version

    def broadcast_done(self) -> None:
        job, self.job = self.job, None
        self.broadcasts.append(self.now - job["start"])
        if self.pending is not None and self.pending > job["version"]:
            version, self.pending = self.pending, None
            self.publish(version)

    # -- learner ----------------------------------------------------------------------------
    def take(self) -> None:
        p, k = self.p, self.learner_version
        if self.waiting_since is None:
            self.waiting_since = self.now
        batch = range(k * p.batch_groups, (k + 1) * p.batch_groups)
        if any(i not in self.buffer for i in batch):
            return
        self.waited, self.waiting_since = self.now - self.waiting_since, None
        self.staleness = [staleness(k, self.buffer.pop(i)) for i in batch]
        mean = p.step_replay[k] if p.step_replay and k < len(p.step_replay) else p.step_seconds
        self.at(self.now + self.noisy(mean, p.step_cv), self.trained)

    def trained(self) -> None:
        self.learner_version += 1
        sync = self.learner_version % self.p.sync_every == 0
        self.at(self.now + (self.p.sync_seconds if sync else 0.0), self.synced, sync)

    def synced(self, publish: bool) -> None:
        p, v = self.p, self.learner_version
        if publish:
            self.publish(v)
        self.log.append({"step": v, "time": self.now, "waited": self.waited,
                         "counts": {k: self.staleness.count(k) * p.group_size for k in set(self.staleness)}})
        self.done = v >= p.steps
        pause = (p.eval_seconds if p.eval_every and v % p.eval_every == 0 else 0.0) + \
            (p.checkpoint_seconds if p.checkpoint_every and v % p.checkpoint_every == 0 else 0.0)
        self.at(self.now + p.log_seconds + pause, self.take)


# -- measurement: the same window for runs and simulations ----------------------------------
def default_skip(steps: int) -> int:
    return min(100, max(1, math.ceil(steps / 4)))


def window_summary(log: list[dict], skip: int, samples_per_step: int) -> dict:
    """log: per step {step, time, waited, counts: {staleness: samples}}."""
    base = next(i for i, r in enumerate(log) if r["step"] >= skip)
    win, span = log[base + 1:], log[-1]["time"] - log[base]["time"]
    if not win:
        raise ValueError(f"no steps after the first {skip}: a longer run (or --skip) is needed")
    counts: dict[int, float] = {}
    for r in win:
        for k, c in r["counts"].items():
            counts[k] = counts.get(k, 0) + c
    total = sum(counts.values()) or 1
    return {"samples_per_s": len(win) * samples_per_step / span, "idle_frac": sum(r["waited"] for r in win) / span,
            "staleness_mean": sum(k * c for k, c in counts.items()) / total, "staleness_max": max(counts, default=0),
            "staleness_dist": {k: c / total for k, c in sorted(counts.items())},
            "window_steps": [log[base]["step"], log[-1]["step"]], "window_seconds": span}


def simulate(p: Params, seeds: int = 5, skip: int | None = None) -> dict:
    """The window summary averaged over `seeds` runs of the model, and the mean broadcast time."""
    skip = default_skip(p.steps) if skip is None else skip
    outs, bcast = [], []
    for seed in range(seeds):
        sim = Sim(p, seed)
        outs.append(window_summary(sim.run(), skip, p.batch_groups * p.group_size))
        bcast += sim.broadcasts[len(sim.broadcasts) * skip // p.steps:]
    out = {k: statistics.mean(o[k] for o in outs) for k in ("samples_per_s", "idle_frac", "staleness_mean")}
    keys = sorted({k for o in outs for k in o["staleness_dist"]})
    out["staleness_dist"] = {k: sum(o["staleness_dist"].get(k, 0) for o in outs) / seeds for k in keys}
    out["broadcast_seconds_mean"] = statistics.mean(bcast) if bcast else 0.0
    return out


def with_actors(p: Params, n: int, cores: float | None = None) -> Params:
    """`p` (rates measured with p.actors actors) for n actors; with `cores`, CPU times scaled by
    max(1, (actors + ranks) / cores) relative to p's (a crude processor-sharing bound)."""
    f = max(1.0, (n + p.learner_ranks) / cores) / max(1.0, (p.actors + p.learner_ranks) / cores) if cores else 1.0
    return replace(p, actors=n, gen_seconds_per_group=[g * f for g in p.gen_seconds_per_group],
                   step_seconds=p.step_seconds * f, overhead_seconds_per_group=p.overhead_seconds_per_group * f)
