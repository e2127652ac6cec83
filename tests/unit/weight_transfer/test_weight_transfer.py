"""Bucket planning, and real gloo broadcasts from WeightSender to receivers: delivery,
membership, and members that die or never come."""
import threading
import time

import pytest
import torch
from conftest import wait_for_job

from async_rl.weight_transfer import gloo_chain
from async_rl.weight_transfer.buckets import plan_buckets, sync_bucket_bytes
from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.gloo_chain import chained
from async_rl.weight_transfer.groups import CollectiveReceiver, CollectiveSender
from async_rl.weight_transfer.nccl import NcclReceiver, NcclSender
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.sender import WeightSender


def specs(params):
    return [(n, tuple(p.shape), p.dtype) for n, p in params]


def test_plan_buckets_respects_size_and_dtype():
    s = [("a", (10,), torch.float32), ("b", (300,), torch.float32), ("c", (5, 2), torch.float16),
         ("d", (20,), torch.float32)]
    plan = plan_buckets(s, bucket_bytes=400)  # 100 float32
    names = [[e.name for e in b.entries] for b in plan]
    assert ["a"] in names and ["b"] in names  # b alone exceeds the bucket: its own bucket
    assert all(b.numel * torch.empty((), dtype=b.dtype).element_size() <= 400 or len(b.entries) == 1 for b in plan)
    assert {e.name for b in plan for e in b.entries} == {"a", "b", "c", "d"}
    for b in plan:
        offsets = [e.offset for e in b.entries]
        assert offsets == sorted(offsets) and sum(e.numel for e in b.entries) == b.numel
        assert all(e.name != "c" or b.dtype == torch.float16 for e in b.entries)


def test_small_models_get_smaller_buckets_so_copy_and_send_overlap():
    mib = 2**20
    big = [("w", (64 * mib // 4,), torch.float32)]  # 64 MiB: four 16 MiB buckets already
    assert sync_bucket_bytes(big, bucket_mb=16) == 16 * mib
    small = [("w", (12 * mib // 4,), torch.float32)]  # 12 MiB: 4 buckets of 3 MiB, not one of 16
    assert sync_bucket_bytes(small, bucket_mb=16) == 3 * mib
    tiny = [("w", (1000,), torch.float32)]  # 4 kB: never below 1 MiB (a collective's fixed cost)
    assert sync_bucket_bytes(tiny, bucket_mb=16) == mib
    assert sync_bucket_bytes(tiny, bucket_mb=0.5) == mib // 2  # never above sync.bucket_mb


def make_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(16, 8, generator=g)), ("layer.w", torch.randn(8, 8, generator=g)),
            ("layer.b", torch.randn(8, generator=g)), ("head", torch.randn(4, 8, generator=g))]


def test_chain_only_where_it_beats_the_tree():
    """Chain: buckets + (world - 2) bucket times; gloo's tree: ceil(log2(world)) writes
    of every bucket from rank 0 (gloo_chain.chained)."""
    assert chained(5, 3)  # 5 + 1 <= 5 * 2
    assert chained(2, 2)  # one member: a chain of one link, receives posted up front
    assert not chained(1, 3)  # a single bucket: nothing to pipeline
    assert chained(3, 9) and not chained(2, 9)  # 3 + 7 <= 3 * 4, but 2 + 7 > 2 * 4
    assert chained(11, 65) and not chained(10, 65)  # 11 + 63 <= 11 * 7, but 10 + 63 > 70
    # NCCL pipelines its own broadcast: its ends are the plain one-broadcast-per-bucket ones.
    assert NcclSender.send is CollectiveSender.send
    assert NcclReceiver.receive is CollectiveReceiver.receive


@pytest.mark.parametrize("members", [(3, 7), (3, 5, 7)], ids=["chain-of-2", "chain-of-3"])
def test_broadcast_reaches_all_receivers_and_follows_membership(members):
    source = make_params(0)
    bc = WeightSender(specs(source), bucket_mb=0.0005, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=20)
    receivers = {k: (make_params(k + 10), None) for k in members}
    try:
        bc.set_members(members)
        bc.publish(5, iter(source))
        job = wait_for_job(bc, members)
        assert job.version == 5
        assert chained(len(bc.plan), len(members) + 1)

        def receive(actor_id):
            params, _ = receivers[actor_id]
            r = ParameterReceiver(params, bucket_mb=0.0005, backend="gloo", timeout_s=20)
            r.receive(epoch=job.epoch, rank=job.rank_of(actor_id), world_size=len(members) + 1, store_host=bc.host,
                      store_port=bc.port)

        threads = [threading.Thread(target=receive, args=(k,)) for k in members]
        [t.start() for t in threads]
        [t.join(timeout=30) for t in threads]
        for k in members:
            for (name, want), (_, got) in zip(source, receivers[k][0]):
                assert torch.equal(want, got), name
        deadline = time.time() + 10
        while bc.completed < 1 and time.time() < deadline:
            time.sleep(0.01)
        assert bc.completed == 1 and bc.sent_version == 5 and len(bc.plan) > 1
    finally:
        bc.close()


def test_missing_member_fails_with_timeout_instead_of_hanging():
    source = make_params(0)
    bc = WeightSender(specs(source), bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=1.0)
    try:
        bc.set_members([1])
        bc.publish(1, iter(source))
        deadline = time.time() + 15
        while bc.failures == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert bc.failures >= 1
    finally:
        bc.close()


def receive(receiver, job, actor_id, bc):
    receiver.receive(epoch=job.epoch, rank=job.rank_of(actor_id), world_size=len(job.members) + 1,
                     store_host=bc.host, store_port=bc.port)


def kill_mid_sync(monkeypatch, bc, job, survivor, survivor_id, dying, dying_id, buckets=1, last_words=None):
    """Run one sync in which the dying member receives `buckets` buckets (forwarding all
    but the last), calls `last_words` if given, then dies: its connections close, as when
    the process is killed. Returns the survivor's errors."""
    failures, completed = bc.failures, bc.completed
    real_await = gloo_chain.await_bucket

    awaited = [0]  # a count, not the works: holding one would keep the dead member's connections open

    def await_then_die(work, timeout_s):
        real_await(work, timeout_s)
        if threading.current_thread().name.startswith("dying"):
            awaited[0] += 1
            if awaited[0] == buckets:
                if last_words is not None:
                    last_words()
                raise RuntimeError("died")

    monkeypatch.setattr(gloo_chain, "await_bucket", await_then_die)
    errors, died = [], []

    def survive():
        try:
            receive(survivor, job, survivor_id, bc)
        except Exception as err:
            errors.append(err)

    def die():
        try:
            receive(dying, job, dying_id, bc)
        except RuntimeError as err:
            died.append(str(err))

    t = threading.Thread(target=survive)
    t.start()
    dead = threading.Thread(target=die, name="dying")
    dead.start()
    dead.join(timeout=20)
    assert died == ["died"]
    t.join(timeout=20)
    assert not t.is_alive()
    deadline = time.time() + 10
    while bc.failures == failures and time.time() < deadline:
        time.sleep(0.01)
    # Rank 0 counts the sync as failed either way: no acknowledgement from the end of the chain.
    assert bc.failures > failures and bc.completed == completed
    return errors


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def holds_first_bucket(receiver, flat, source):
    """Whether `flat` (one of the receiver's bucket sets) holds source's bucket 0."""
    named = dict(source)
    return all(same_bits(flat[e.offset:e.offset + e.numel], named[e.name].reshape(-1))
               for e in receiver.plan[0].entries)


def until(done, timeout_s=30.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline and not done():
        time.sleep(0.005)


@pytest.mark.parametrize("dying_rank", [1, 2], ids=["dies-first-in-chain", "dies-last-in-chain"])
def test_member_dying_mid_sync_leaves_survivor_not_intact_until_a_resync(dying_rank, monkeypatch):
    """sync.stage_on_actors=false. Rank 1 forwards to rank 2 (gloo_chain.py). A dead rank 1
    leaves the survivor after it half-updated, and it must not generate until a resync; a
    dead rank 2 leaves the survivor before it with every bucket. Either way rank 0 counts
    the sync as failed (no acknowledgement from the end of the chain) and resends once the
    dead member is gone."""
    source = make_params(0)
    bc = WeightSender(specs(source), bucket_mb=0.0002, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=10)
    survivor_params = make_params(1)
    survivor = ParameterReceiver(survivor_params, bucket_mb=0.0002, backend="gloo", timeout_s=10, staged=False)
    dying = ParameterReceiver(make_params(2), bucket_mb=0.0002, backend="gloo", timeout_s=10, staged=False)
    assert len(survivor.plan) >= 3 and survivor.staging is None
    dying_id, survivor_id = (1, 2) if dying_rank == 1 else (2, 1)
    try:
        bc.set_members([1, 2])
        bc.publish(5, iter(source))
        job = wait_for_job(bc, [1, 2])
        def first_bucket_landed():
            return holds_first_bucket(survivor, survivor.buckets[0], source)

        errors = kill_mid_sync(monkeypatch, bc, job, survivor, survivor_id, dying, dying_id, buckets=2,
                               last_words=(lambda: until(first_bucket_landed)) if dying_rank == 1 else None)
        if dying_rank == 1:  # only the first bucket reached the survivor through the dead member
            assert errors, "the survivor should see the sync break off"
            assert not survivor.intact and survivor.group is None
            assert first_bucket_landed() and not torch.equal(source[-1][1], survivor_params[-1][1])
        else:  # every bucket reached the survivor; its forwards may have been written before the death
            assert all(torch.equal(want, got) for (_, want), (_, got) in zip(source, survivor_params))
            assert survivor.intact == (not errors)
        # The reaper removes the dead member; the retry rebroadcasts the same version.
        bc.set_members([survivor_id])
        retry = wait_for_job(bc, [survivor_id], newer_than=job.epoch)
        assert retry.version == 5
        receive(survivor, retry, survivor_id, bc)
        assert survivor.intact
        assert all(torch.equal(want, got) for (_, want), (_, got) in zip(source, survivor_params))
    finally:
        bc.close()


@pytest.mark.parametrize("dying_rank", [1, 2], ids=["dies-first-in-chain", "dies-last-in-chain"])
def test_member_dying_mid_sync_leaves_staged_survivor_on_its_last_complete_version(dying_rank, monkeypatch):
    """sync.stage_on_actors=true (the default): the broken-off sync of version 5 lands in
    the staging buckets only, so the survivor keeps version 4 bit for bit, stays intact
    (it goes on generating) and gets version 5 from the retry. A dead rank 2 may leave the
    survivor before it with a complete sync (its forwards already written): then it has
    version 5, whole."""
    old, source = make_params(3), make_params(0)
    bc = WeightSender(specs(source), bucket_mb=0.0002, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=10)
    survivor_params = make_params(1)
    survivor = ParameterReceiver(survivor_params, bucket_mb=0.0002, backend="gloo", timeout_s=10)
    dying = ParameterReceiver(make_params(2), bucket_mb=0.0002, backend="gloo", timeout_s=10)
    assert len(survivor.plan) >= 3 and survivor.staging is not None
    dying_id, survivor_id = (1, 2) if dying_rank == 1 else (2, 1)
    try:
        bc.set_members([1, 2])
        bc.publish(4, iter(old))
        first = wait_for_job(bc, [1, 2])
        threads = [threading.Thread(target=receive, args=(r, first, k, bc))
                   for r, k in ((survivor, survivor_id), (dying, dying_id))]
        [t.start() for t in threads]
        [t.join(timeout=20) for t in threads]
        assert all(same_bits(want, got) for (_, want), (_, got) in zip(old, survivor_params)) and survivor.intact
        before = [p.clone() for _, p in survivor_params]
        deadline = time.time() + 10
        while bc.completed < 1 and time.time() < deadline:
            time.sleep(0.01)
        bc.publish(5, iter(source))
        deadline = time.time() + 10
        while (bc.job() is None or bc.job().version != 5) and time.time() < deadline:
            time.sleep(0.005)
        job = bc.job()
        assert bc.completed == 1 and job.members == (1, 2)
        def first_bucket_staged():
            return holds_first_bucket(survivor, survivor.staging[0], source)

        # A dying rank 1 forwards bucket 0 first: the survivor after it is midway, not at the start.
        errors = kill_mid_sync(monkeypatch, bc, job, survivor, survivor_id, dying, dying_id, buckets=2,
                               last_words=(lambda: until(first_bucket_staged)) if dying_rank == 1 else None)
        assert survivor.intact
        if dying_rank == 1 or errors:
            assert errors and survivor.group is None
            assert all(same_bits(want, got) for want, (_, got) in zip(before, survivor_params))
        else:
            assert all(same_bits(want, got) for (_, want), (_, got) in zip(source, survivor_params))
        if dying_rank == 1:  # it broke off midway: version 5's first bucket is in staging only
            assert first_bucket_staged()
        bc.set_members([survivor_id])
        retry = wait_for_job(bc, [survivor_id], newer_than=job.epoch)
        assert retry.version == 5
        receive(survivor, retry, survivor_id, bc)
        assert survivor.intact
        assert all(same_bits(want, got) for (_, want), (_, got) in zip(source, survivor_params))
    finally:
        bc.close()


def test_membership_change_releases_a_member_waiting_for_a_dead_one():
    """A member that never comes holds nobody for the full timeout: once the membership
    changes, rank 0 abandons the epoch and the waiting member is released, untouched."""
    source = make_params(0)
    timeout_s = 30.0
    bc = WeightSender(specs(source), bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=timeout_s)
    params = make_params(1)
    waiting = ParameterReceiver(params, bucket_mb=1, backend="gloo", timeout_s=timeout_s)
    try:
        bc.set_members([1, 2])  # member 2 is dead and never joins
        bc.publish(3, iter(source))
        job = wait_for_job(bc, [1, 2])
        threading.Timer(0.5, bc.set_members, args=([1],)).start()
        started = time.monotonic()
        try:
            receive(waiting, job, 1, bc)
        except SyncAbandoned:
            pass
        else:
            raise AssertionError("the epoch should have been abandoned")
        # Released by the abandoning, not by its own timeout.
        assert time.monotonic() - started < timeout_s and waiting.intact and bc.failures == 0
        assert torch.equal(params[0][1], make_params(1)[0][1])  # untouched
        receive(waiting, wait_for_job(bc, [1], newer_than=job.epoch), 1, bc)
        assert all(torch.equal(want, got) for (_, want), (_, got) in zip(source, params))
    finally:
        bc.close()


def test_a_dead_broadcast_thread_fails_the_next_publish(monkeypatch):
    """A bug that ends the broadcast thread must not leave the learner training for
    actors that will never get its weights: the next publish raises, naming it."""
    monkeypatch.setattr(WeightSender, "_run", lambda self: 1 / 0)
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)
    try:
        bc._thread.join(timeout=5)
        with pytest.raises(RuntimeError, match="weight-broadcast thread died: division by zero"):
            bc.publish(1, iter([("w", torch.zeros(4))]))
    finally:
        bc.close(wait_s=1)
