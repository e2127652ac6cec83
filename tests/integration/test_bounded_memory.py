"""Bounded memory: when the learner stalls, actors block instead of memory growing.

The bound comes from admission control, not from socket queues: an actor holding
weights of version v is granted groups only while the admission index stays below
(max_staleness + v + 1) * batch_groups, so with no learner step (no new weights) a
real actor process gets exactly that many groups, delivers them, and then waits
(polling the hub, heartbeating) without generating. One learner step (take a batch,
publish weights, bump the version) lets exactly one more batch through. On top of
that, the replay buffer has a hard cap (refusals are counted) and the coordinator's
sockets refuse oversized frames at the ZeroMQ level, before they are allocated.
"""
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from conftest import ask, dealer, running_coordinator, subprocess_env

from async_rl.wire import ExperienceGroup, Hello, Welcome, WireLimits, WorkGrant, WorkRequest, encode

ETA, B, G, PER_REQUEST = 1, 4, 4, 2


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)
    return pred()


@contextlib.contextmanager
def coordinator_for_model(run_dir: Path, config: dict, model_path: Path, limits: WireLimits | None = None):
    """Like conftest.running_coordinator, but its broadcaster carries the real model's
    parameters, so a real actor can take part in a weight sync; yields (coordinator, engine)
    where the engine's parameters are what the test publishes as the learner's weights."""
    from async_rl.actor.engines.torch_engine import TorchEngine
    from async_rl.config import build_config
    from async_rl.coordinator.coordinator import Coordinator
    from async_rl.tasks import make_task
    from async_rl.weight_transfer.sender import WeightSender

    cfg = build_config({"learner": {"ranks": 1}, "model": {"path": str(model_path), "device": "cpu"}, **config})
    engine = TorchEngine(str(model_path), device=torch.device("cpu"))
    specs = [(n, tuple(p.shape), p.dtype) for n, p in engine.parameters_for_sync()]
    bc = WeightSender(specs, bucket_mb=cfg.sync.bucket_mb, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=cfg.sync.timeout_s)
    coord = Coordinator(cfg, make_task("arithmetic", seed=0), bc, run_dir)
    if limits is not None:
        coord.limits = limits  # before start: the sockets' MAXMSGSIZE is set from it
    coord.start()
    try:
        yield coord, engine
    finally:
        coord.stop(drain_s=1.0)
        bc.close(wait_s=2.0)


def steady(coord, admitted: int, buffered: int, seconds: float) -> None:
    """For `seconds`, and until the actor has been heard from again (it keeps talking to
    the hub, as soon as a loaded machine lets it), nothing more is admitted or buffered."""
    (actor,) = coord.actors.values()
    seen = actor.last_seen
    deadline = time.monotonic() + seconds
    patience = deadline + 60
    while time.monotonic() < deadline or actor.last_seen <= seen:
        assert time.monotonic() < patience, "the waiting actor must keep heartbeating / polling"
        assert coord.admission.admitted == admitted, "a stalled learner must not let admissions grow"
        assert len(coord.buffer) == buffered, "a stalled learner must not let the buffer grow"
        assert not coord.reissue
        time.sleep(0.05)
    assert coord.actors.get(actor.actor_id) is actor, "the waiting actor must stay registered"


def test_stalled_learner_blocks_a_real_actor_and_one_step_releases_exactly_one_batch(tmp_path, demo_model):
    config = {"max_staleness": ETA, "train": {"batch_groups": B, "group_size": G},
              "actors": {"groups_per_request": PER_REQUEST, "max_new_tokens": 4, "heartbeat_s": 0.2,
                         "heartbeat_timeout_s": 60},
              "transport": {"timeout_s": 5}, "sync": {"timeout_s": 10}}
    log_path = tmp_path / "actor.log"
    with coordinator_for_model(tmp_path, config, demo_model) as (coord, engine), open(log_path, "w") as log:
        assert coord.buffer.capacity >= (ETA + 1) * B  # the hard cap never bites in a correct run
        actor = subprocess.Popen([sys.executable, "-m", "async_rl.cli", "actor", "--hub", coord.hub_addr,
                                  "--name", "stall-test"], env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            # Stall: no learner step, so the actor keeps weights of version 0 and may be
            # granted (eta + 0 + 1) * B groups, then nothing until the learner moves on.
            first = (ETA + 1) * B
            assert wait_for(lambda: len(coord.buffer) >= first, timeout=60), \
                (coord.admission.admitted, len(coord.buffer), log_path.read_text()[-2000:])
            # all delivered
            assert coord.admission.admitted == first and len(coord.buffer) == first and not coord.granted
            steady(coord, admitted=first, buffered=first, seconds=2.0)
            assert actor.poll() is None

            # The learner moves on alone: it takes a batch and its version becomes 1, but the
            # actor still holds version-0 weights, so the staleness bound keeps it waiting.
            taken = coord.buffer.take(B, learner_version=coord.version, timeout=5)
            assert taken is not None and taken.indices == list(range(B)) and taken.versions == [0] * B
            coord.version = 1
            steady(coord, admitted=first, buffered=first - B, seconds=1.0)

            # ...and publishes the version-1 weights: the actor syncs, then gets exactly one
            # more batch, (eta + 1 + 1) * B in all, and blocks again.
            coord.sender.publish(1, iter(engine.parameters_for_sync()))
            (info,) = coord.actors.values()
            assert wait_for(lambda: info.version == 1, timeout=20), log_path.read_text()[-2000:]
            assert info.synced[1] == 1 and coord.sender.sent_version == 1
            second = (ETA + 2) * B
            assert wait_for(lambda: len(coord.buffer) >= second - B, timeout=20), \
                (coord.admission.admitted, len(coord.buffer), log_path.read_text()[-2000:])
            assert coord.admission.admitted == second and len(coord.buffer) == second - B and not coord.granted
            steady(coord, admitted=second, buffered=second - B, seconds=1.5)
            assert actor.poll() is None

            # Everything buffered is in admission order, the new batch from version 1.
            assert coord.buffer.take(B, learner_version=1, timeout=5).indices == list(range(B, 2 * B))
            newest = coord.buffer.take(B, learner_version=1, timeout=5)
            assert newest.indices == list(range(2 * B, 3 * B)) and newest.versions == [1] * B
            assert coord.buffer.dropped == 0 and coord.rejects.total == 0, coord.rejects.by_reason()

            # Stop: the actor's next request is answered with Goodbye and it exits cleanly
            # (the hub serves until it has left, however long a loaded machine takes).
            coord.stop(drain_s=60.0)
            assert actor.wait(timeout=60) == 0, log_path.read_text()[-2000:]
            assert "leaving: run finished" in log_path.read_text()
        finally:
            if actor.poll() is None:
                actor.terminate()
                try:
                    actor.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    actor.kill()
                    actor.wait(timeout=5)


# -- the hard caps under the admission bound, driven by a hand-written actor ---------

def pusher(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def group_msg(actor_id: int, index: int, prompt_id: int, g: int = 2) -> ExperienceGroup:
    T = 3  # tokens per response
    return ExperienceGroup(
        actor_id=actor_id, group=index, prompt_id=prompt_id, version=0,
        prompt_tokens=np.array([1, 5, 6], dtype=np.int32), response_tokens=np.full(g * T, 4, dtype=np.int32),
        response_lengths=np.full(g, T, dtype=np.int32), logprobs=np.full(g * T, -0.5, dtype=np.float32),
        token_versions=np.zeros(g * T, dtype=np.int32), rewards=np.zeros(g, dtype=np.float32),
        truncated=np.zeros(g, np.uint8), gen_seconds=0.1)


def test_replay_buffer_hard_cap_refuses_and_counts(tmp_path):
    """Even if more groups than the cap arrive (granted, valid), the buffer does not grow
    past its capacity: the excess is refused and counted as buffer_refused."""
    with running_coordinator(tmp_path, {"train": {"batch_groups": 4, "group_size": 2}}) as (coord, ctx, task):
        cap = coord.cfg.train.batch_groups * (coord.cfg.max_staleness + 2) \
            + coord.cfg.actors.count * coord.cfg.actors.groups_per_request
        assert coord.buffer.capacity == cap
        coord.buffer.capacity = 2  # below the admission bound, to make the cap bite
        sock = dealer(ctx, coord.hub_addr)
        welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
        grant = ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=4))
        assert isinstance(grant, WorkGrant) and grant.groups == [0, 1, 2, 3]
        push = pusher(ctx, coord.experience_addr)
        for i, pid in zip(grant.groups, grant.prompt_ids):
            push.send_multipart(encode(group_msg(welcome.actor_id, i, pid)))
        assert wait_for(lambda: coord.rejects.total == 2, timeout=30)
        assert coord.rejects.by_reason() == {"buffer_refused": 2} and len(coord.buffer) == 2
        assert sorted(coord.reissue) == [2, 3]  # refused slots are generated again, not lost
        # Consuming makes room again.
        assert coord.buffer.take(2, learner_version=0, timeout=2).indices == [0, 1]
        assert coord.buffer.put(2, 0, "late") and coord.buffer.put(3, 0, "late")
        assert not coord.buffer.put(4, 0, "over")


@pytest.mark.parametrize("socket_kind", ["hub", "experience"])
def test_oversized_frames_are_refused_by_the_socket_before_decoding(tmp_path, demo_model, socket_kind):
    """The coordinator sets MAXMSGSIZE from its wire limits: a frame over the limit is
    dropped by ZeroMQ with its connection (never reaching the wire layer, which would
    count it as too_large), and the coordinator keeps serving."""
    limit = 64 << 10
    with coordinator_for_model(tmp_path, {"transport": {"timeout_s": 5}}, demo_model,
                               limits=WireLimits(max_message_bytes=limit)) as (coord, _):
        ctx = zmq.Context()
        try:
            if socket_kind == "hub":
                bad = dealer(ctx, coord.hub_addr)
                bad.send(b"\x00" * (limit + 1))
            else:
                bad = pusher(ctx, coord.experience_addr)
                bad.send(b"\x00" * (limit + 1))
            # A small invalid message from a fresh connection is received and counted...
            probe = pusher(ctx, coord.experience_addr)
            probe.send(b"\x00garbage")
            assert wait_for(lambda: coord.rejects.total >= 1, timeout=30)
            time.sleep(0.3)  # ...while the oversized frame never arrives at all.
            assert coord.rejects.total == 1 and "too_large" not in coord.rejects.by_reason()
            # The coordinator still serves a well-behaved actor.
            sock = dealer(ctx, coord.hub_addr)
            assert isinstance(ask(sock, Hello(actor_name="t", pid=1, host="h")), Welcome)
        finally:
            ctx.destroy(linger=0)
