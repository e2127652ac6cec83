"""The coordinator over real ZeroMQ sockets, driven by a hand-written actor."""
import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq
from conftest import ask, dealer, running_coordinator, wait_for
from wire_samples import make_spans

from async_rl.run.directory import RunDir
from async_rl.wire import (
    EvalGrant,
    EvalResult,
    ExperienceGroup,
    Goodbye,
    Hello,
    Wait,
    Welcome,
    WorkGrant,
    WorkRequest,
    encode,
    send,
)
from async_rl.wire.messages import FAILURE_REASONS

G = 2


@pytest.fixture
def hub(tmp_path):
    with running_coordinator(tmp_path, {"train": {"batch_groups": 4, "group_size": G}}) as running:
        yield running


def group_msg(actor_id, index, prompt_id, version=0, logprob=-0.5):
    R = 3 + 2  # responses of 3 and 2 tokens
    return ExperienceGroup(
        actor_id=actor_id, group=index, prompt_id=prompt_id, version=version,
        prompt_tokens=np.array([1, 5, 6, 7], dtype=np.int32), response_tokens=np.full(R, 4, dtype=np.int32),
        response_lengths=np.array([3, 2], dtype=np.int32), logprobs=np.full(R, logprob, dtype=np.float32),
        token_versions=np.full(R, version, dtype=np.int32), rewards=np.array([1.0, 0.0], dtype=np.float32),
        truncated=np.zeros(G, np.uint8), gen_seconds=0.1)


def test_register_grant_admission_and_experience(hub, tmp_path):
    coord, ctx, task = hub
    sock = dealer(ctx, coord.hub_addr)
    welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
    assert isinstance(welcome, Welcome) and "max_staleness: 0" in welcome.config_yaml
    endpoints = RunDir(tmp_path).endpoints()
    assert endpoints["hub"] == coord.hub_addr and endpoints["actors"][0]["pid"] == 1
    assert endpoints["hub"].startswith("tcp://127.0.0.1:")

    grant = ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=3))
    assert isinstance(grant, WorkGrant) and grant.groups == [0, 1, 2]
    assert grant.prompt_ids == [task.train_prompt(i).id for i in range(3)]
    # Synchronous bound: 4 groups per version, one more fits, then nothing.
    assert ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=3)).groups == [3]
    assert isinstance(ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=3)), Wait)

    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(coord.experience_addr)
    for i in range(4):
        prompt_id = grant.prompt_ids[0] if i == 0 else task.train_prompt(i).id
        push.send_multipart(encode(group_msg(welcome.actor_id, i, prompt_id)))
    assert wait_for(lambda: len(coord.buffer) == 4)
    taken = coord.take(4, version=0, timeout=1)
    assert taken.indices == [0, 1, 2, 3] and coord.rejects.total == 0
    # The learner's metrics line gets the totals under their metric names.
    counters = coord.counters()
    assert {k: counters[k] for k in ("actors/live", "data/prompts_admitted", "data/prompts_consumed",
                                     "data/prompts_skipped", "staleness/dropped", "wire/rejected")} == {
        "actors/live": 1, "data/prompts_admitted": 4, "data/prompts_consumed": 4, "data/prompts_skipped": 0,
        "staleness/dropped": 0, "wire/rejected": 0}
    assert counters["reward/errors"] == 0 and {f"reward/errors_{r}" for r in FAILURE_REASONS} < set(counters)
    assert counters["memory/actor_peak_rss_gb"] == 0.0  # no heartbeat yet
    # Once the learner advances, a request at the new version is served.
    assert isinstance(ask(sock, WorkRequest(actor_id=welcome.actor_id, version=1, max_groups=1)), Wait)
    coord.advance(1)
    assert ask(sock, WorkRequest(actor_id=welcome.actor_id, version=1, max_groups=1)).groups == [4]


def test_inconsistent_and_malformed_messages_are_counted_not_fatal(hub):
    coord, ctx, task = hub
    sock = dealer(ctx, coord.hub_addr)
    welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
    ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=1))
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(coord.experience_addr)
    push.send_multipart(encode(group_msg(welcome.actor_id, 2, task.train_prompt(2).id)))  # never granted
    push.send_multipart(encode(group_msg(welcome.actor_id + 9, 0, task.train_prompt(0).id)))  # wrong actor
    push.send_multipart(encode(group_msg(welcome.actor_id, 0, task.train_prompt(0).id, version=7)))  # future
    push.send_multipart([b"\x00garbage"])
    push.send_multipart([b"\x81\xa6schema\x02", b"x"])
    sock.send_multipart([b"not msgpack at all"])
    assert wait_for(lambda: coord.rejects.total == 6)
    reasons = coord.rejects.by_reason()
    assert reasons["not_granted"] == 2 and reasons["bad_version"] == 1
    # Unknown actors are told to register (again).
    unknown = ask(sock, WorkRequest(actor_id=99, version=0, max_groups=1))
    assert isinstance(unknown, Goodbye) and unknown.rejoin
    # The refused group of a live actor's grant is generated again, not left as a hole.
    assert list(coord.reissue) == [0]
    assert ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=1)).groups == [0]
    # Still serving: the real group is accepted.
    push.send_multipart(encode(group_msg(welcome.actor_id, 0, task.train_prompt(0).id)))
    assert wait_for(lambda: len(coord.buffer) == 1)


def test_a_group_rejected_by_the_wire_layer_is_reissued(hub):
    coord, ctx, task = hub
    sock = dealer(ctx, coord.hub_addr)
    welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
    assert ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=2)).groups == [0, 1]
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(coord.experience_addr)
    push.send_multipart(encode(group_msg(welcome.actor_id, 1, task.train_prompt(1).id, logprob=float("nan"))))
    push.send_multipart(encode(group_msg(welcome.actor_id + 5, 0, task.train_prompt(0).id, logprob=float("nan"))))
    assert wait_for(lambda: coord.rejects.by_reason().get("non_finite") == 2)
    # Only the claim of the actor holding the grant hands it back.
    assert list(coord.reissue) == [1] and set(coord.granted) == {0}


def test_a_killed_actor_is_removed_when_its_connection_closes(hub, caplog):
    coord, ctx, _ = hub
    script = ("import sys, time, zmq\n"
              "from async_rl.wire import Hello, WorkRequest, RejectCounter, WireLimits, recv, send\n"
              "s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])\n"
              "send(s, Hello(actor_name='k', pid=1, host='h'))\n"
              "_, w = recv(s, WireLimits(), RejectCounter(), routed=False)\n"
              "send(s, WorkRequest(actor_id=w.actor_id, version=0, max_groups=2))\n"
              "recv(s, WireLimits(), RejectCounter(), routed=False)\n"
              "print('granted', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, coord.hub_addr], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "granted"
        assert coord.live_actors == 1
        with caplog.at_level(logging.WARNING, logger="async_rl.coordinator"):
            proc.kill()  # SIGKILL: no goodbye; the heartbeat timeout is 30 s here
            assert wait_for(lambda: coord.live_actors == 0)
        # Its closed connection removed it, not the heartbeat timeout.
        assert "removed: its connection closed" in caplog.text and sorted(coord.reissue) == [0, 1]
    finally:
        proc.kill()
        proc.wait()


def test_an_actor_removed_while_stalled_registers_again(hub):
    coord, ctx, _ = hub
    coord.cfg.actors.heartbeat_timeout_s = 0.3
    a = dealer(ctx, coord.hub_addr)
    first = ask(a, Hello(actor_name="a", pid=1, host="h"))
    assert wait_for(lambda: coord.live_actors == 0)  # silent: removed
    coord.cfg.actors.heartbeat_timeout_s = 30.0  # now it is back
    reply = ask(a, WorkRequest(actor_id=first.actor_id, version=0, max_groups=1))
    assert isinstance(reply, Goodbye) and reply.rejoin
    again = ask(a, Hello(actor_name="a", pid=1, host="h"))  # what the actor does on rejoin
    assert isinstance(again, Welcome) and again.actor_id != first.actor_id and coord.live_actors == 1


def test_requests_for_an_actor_from_another_socket_are_refused(hub):
    coord, ctx, _ = hub
    owner, intruder = dealer(ctx, coord.hub_addr), dealer(ctx, coord.hub_addr)
    welcome = ask(owner, Hello(actor_name="t", pid=1, host="h"))
    send(intruder, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=2))
    send(intruder, Goodbye(reason="forged", actor_id=welcome.actor_id))
    assert wait_for(lambda: coord.rejects.by_reason().get("identity_mismatch") == 2)
    assert coord.live_actors == 1 and coord.admission.admitted == 0
    assert ask(owner, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=2)).groups == [0, 1]
    # Leaving with a goodbye hands the actor's grants back at once, not after the heartbeat timeout.
    send(owner, Goodbye(reason="leaving", actor_id=welcome.actor_id))
    assert wait_for(lambda: coord.live_actors == 0) and list(coord.reissue) == [0, 1]


def test_spans_arriving_after_their_actors_goodbye_are_still_traced(hub):
    coord, ctx, _ = hub
    sock = dealer(ctx, coord.hub_addr)
    welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
    send(sock, Goodbye(reason="leaving", actor_id=welcome.actor_id))
    assert wait_for(lambda: coord.live_actors == 0)
    # Shipped on the heartbeat socket, spans can arrive after the goodbye: still traced.
    heartbeat_socket = dealer(ctx, coord.hub_addr)
    send(heartbeat_socket, make_spans(n=2, actor_id=welcome.actor_id))
    send(sock, make_spans(n=1, actor_id=welcome.actor_id + 7))  # an id never given: rejected

    def spans_by_track():
        events = coord.trace.document()["traceEvents"]
        tracks = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
        counts = dict.fromkeys(tracks.values(), 0)
        for e in events:
            if e["ph"] == "X":
                counts[tracks[e["pid"]]] += 1
        return counts

    assert wait_for(lambda: spans_by_track().get(f"actor-{welcome.actor_id}") == 2)
    assert wait_for(lambda: coord.rejects.by_reason().get("unknown_actor") == 1)
    assert f"actor-{welcome.actor_id + 7}" not in spans_by_track()


def test_silent_actor_is_removed_and_its_prompts_reissued(hub):
    coord, ctx, task = hub
    a = dealer(ctx, coord.hub_addr)
    wa = ask(a, Hello(actor_name="a", pid=1, host="h"))
    assert ask(a, WorkRequest(actor_id=wa.actor_id, version=0, max_groups=2)).groups == [0, 1]
    # Silent from now on (a short timeout only now: a slow machine must not make the
    # actor seem silent between its hello and its request).
    coord.cfg.actors.heartbeat_timeout_s = 0.3
    assert wait_for(lambda: coord.live_actors == 0)
    coord.cfg.actors.heartbeat_timeout_s = 30.0
    b = dealer(ctx, coord.hub_addr)
    wb = ask(b, Hello(actor_name="b", pid=2, host="h"))
    assert ask(b, WorkRequest(actor_id=wb.actor_id, version=0, max_groups=4)).groups == [0, 1, 2, 3]


def test_stop_says_goodbye(hub):
    coord, ctx, _ = hub
    sock = dealer(ctx, coord.hub_addr)
    welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
    coord._stopping.set()  # what stop() does first; the hub keeps serving until the fixture stops it
    assert isinstance(ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=1)), Goodbye)


def test_membership_change_brings_up_to_date_actors_into_the_new_group(hub):
    """After a join, an actor that already holds the current weights must still take
    part in the new epoch's broadcast, or the group can never form."""
    import threading

    from async_rl.weight_transfer.receiver import ParameterReceiver
    from async_rl.wire import SyncDone, SyncOrder

    coord, ctx, _ = hub
    coord.advance(1)

    def sync_once(sock, actor_id, version, params):
        deadline = time.time() + 30
        while time.time() < deadline:  # the job appears asynchronously
            reply = ask(sock, WorkRequest(actor_id=actor_id, version=version, max_groups=0))
            if isinstance(reply, SyncOrder):
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"actor {actor_id} at version {version} never got a SyncOrder")
        receiver = ParameterReceiver([("w", params)], bucket_mb=1, backend="gloo", timeout_s=5)
        receiver.receive(epoch=reply.epoch, rank=reply.rank, world_size=reply.world_size,
                         store_host=reply.store_host, store_port=reply.store_port)
        send(sock, SyncDone(actor_id=actor_id, epoch=reply.epoch, version=reply.version))
        return reply

    a = dealer(ctx, coord.hub_addr)
    wa = ask(a, Hello(actor_name="a", pid=1, host="h"))
    params_a = torch.zeros(4)
    coord.sender.publish(1, iter([("w", torch.full((4,), 7.0))]))
    first = sync_once(a, wa.actor_id, 0, params_a)
    assert first.world_size == 2 and torch.equal(params_a, torch.full((4,), 7.0))

    b = dealer(ctx, coord.hub_addr)
    wb = ask(b, Hello(actor_name="b", pid=2, host="h"))
    params_b = torch.zeros(4)
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("a", sync_once(a, wa.actor_id, 1, params_a)))
    t.start()
    second_b = sync_once(b, wb.actor_id, 0, params_b)
    t.join(timeout=60)
    assert results["a"].epoch == second_b.epoch > first.epoch and second_b.world_size == 3
    assert torch.equal(params_b, torch.full((4,), 7.0))


def test_prompts_over_the_limit_are_skipped_and_later_slots_flow(tmp_path):
    """A too-long prompt is never granted: its slot is marked skipped, so the learner's
    in-order take does not wait for it, and the count is kept."""
    from async_rl.tasks import make_task

    task = make_task("arithmetic", seed=0)

    def over_limit(prompt):  # a stand-in tokenizer: answers divisible by 3 make long prompts
        return "10 tokens" if int(prompt.answer) % 3 == 0 else None

    long_ones = {i for i in range(8) if over_limit(task.train_prompt(i))}
    assert 0 < len(long_ones) < 8
    with running_coordinator(tmp_path, {"train": {"batch_groups": 8, "group_size": 2}},
                             prompt_over_limit=over_limit, prompt_limit=5) as (coord, ctx, _):
        sock = dealer(ctx, coord.hub_addr)
        welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
        grant = ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=8))
        assert set(grant.groups) == set(range(8)) - long_ones
        assert coord.admission.skipped == sorted(long_ones)
        # Skipped slots do not count against the staleness window: room for as many more.
        assert coord.admission.capacity(0) == len(long_ones)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(coord.experience_addr)
        for index, pid in zip(grant.groups, grant.prompt_ids):
            push.send_multipart(encode(group_msg(welcome.actor_id, index, pid)))
        taken = coord.take(len(grant.groups), version=0, timeout=30)
        assert taken is not None and taken.indices == grant.groups and coord.rejects.total == 0
        assert coord.counters()["data/prompts_skipped"] == len(long_ones) and coord.too_long_in_a_row() == 0


def test_an_actor_holding_the_pinned_weights_evaluates_before_it_syncs(tmp_path):
    """Evaluation chunks go to actors at the round's version first, also while a newer
    broadcast waits for them, and their results end up as one metrics line."""
    with running_coordinator(tmp_path, {"eval": {"size": 3, "batch_size": 2}}) as (coord, ctx, _):
        sock = dealer(ctx, coord.hub_addr)
        welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
        aid = welcome.actor_id
        assert isinstance(ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=0)), (Wait, WorkGrant))
        coord.request_eval(0)
        # Half-updated weights (max_groups=0) get no evaluation work.
        assert not isinstance(ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=0)), EvalGrant)
        first = ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=4))
        second = ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=4))
        assert isinstance(first, EvalGrant) and isinstance(second, EvalGrant) and first.version == 0
        assert len(first.prompt_ids) + len(second.prompt_ids) == 3
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(coord.experience_addr)
        for g in (first, second):
            n = len(g.prompt_ids)
            push.send_multipart(encode(EvalResult(actor_id=aid, round=g.round, version=0, prompt_ids=g.prompt_ids,
                                                  rewards=np.ones((n, 1), np.float32),
                                                  response_lengths=np.ones((n, 1), np.int32),
                                                  truncated=np.zeros((n, 1), np.uint8))))
        assert wait_for(lambda: coord.evals.pending == 0)
        lines, pending = coord.eval_results()
        assert pending == 0 and len(lines) == 1 and lines[0]["eval/accuracy"] == 1.0 and lines[0]["step"] == 0


def test_nothing_is_admitted_past_the_last_step(tmp_path):
    """Once the learner has made its last step, an actor gets no more training prompts
    (the staleness bound would allow them): nothing is generated that no step takes."""
    config = {"max_staleness": 1, "train": {"batch_groups": 4, "group_size": G, "max_steps": 1}}
    with running_coordinator(tmp_path, config) as (coord, ctx, _):
        sock = dealer(ctx, coord.hub_addr)
        aid = ask(sock, Hello(actor_name="t", pid=1, host="h")).actor_id
        assert len(ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=4)).groups) == 4
        coord.advance(1)
        assert coord.admission.capacity(0) == 4
        assert isinstance(ask(sock, WorkRequest(actor_id=aid, version=0, max_groups=4)), Wait)


def test_a_snapshot_is_not_changed_by_later_requests(tmp_path):
    """The checkpoint state is written after the lock is released, while the hub goes on
    skipping over-long prompts: what it lists must stay as it was when taken."""
    from async_rl.run.checkpoints import check_partition

    with running_coordinator(tmp_path, {"train": {"batch_groups": 8, "group_size": 2}},
                             prompt_over_limit=lambda prompt: "10 tokens", prompt_limit=5) as (coord, ctx, _):
        sock = dealer(ctx, coord.hub_addr)
        welcome = ask(sock, Hello(actor_name="t", pid=1, host="h"))
        assert isinstance(ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=3)), Wait)
        state, groups = coord.snapshot()
        assert state["skipped"] == [0, 1, 2] and coord.too_long_in_a_row() == 3
        assert isinstance(ask(sock, WorkRequest(actor_id=welcome.actor_id, version=0, max_groups=3)), Wait)
        assert coord.too_long_in_a_row() == 6 and coord.counters()["data/prompts_skipped"] == 6
        assert state["skipped"] == [0, 1, 2] and state["admitted"] == 3
        check_partition(state, [index for index, _, _ in groups])


def test_the_coordinator_sums_counts_into_its_checkpoint_state_and_old_states_mean_zero(tmp_path):
    import torch

    from async_rl.config import build_config
    from async_rl.coordinator.coordinator import Coordinator
    from async_rl.tasks import make_task
    from async_rl.weight_transfer.sender import WeightSender

    cfg = build_config({"learner": {"ranks": 1}})
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)
    try:
        coord = Coordinator(cfg, make_task("arithmetic", seed=0), bc, tmp_path)
        state, _ = coord.snapshot()
        zero = dict.fromkeys(FAILURE_REASONS, 0)
        assert state["reward_errors"] == state["env_errors"] == zero
        old = {k: v for k, v in state.items() if k not in ("reward_errors", "env_errors")}  # before the counts
        coord.restore(0, old, [])
        assert coord.error_totals() == {"reward_errors": zero, "env_errors": zero}
        coord.restore(0, {**old, "reward_errors": {"raised": 3, "timeout": 1}}, [])
        coord._count_errors(SimpleNamespace(reward_errors=[1, 0, 2, 0], env_errors=[0, 5, 0, 0]))
        totals = coord.error_totals()
        assert totals["reward_errors"] == {"raised": 4, "timeout": 1, "non_finite": 2, "not_a_number": 0}
        assert totals["env_errors"] == {**zero, "timeout": 5}
        assert {k: coord.snapshot()[0][k] for k in totals} == totals
        counters = coord.counters()
        assert counters["reward/errors"] == 7 and counters["env/errors"] == counters["env/errors_timeout"] == 5
    finally:
        bc.close()
