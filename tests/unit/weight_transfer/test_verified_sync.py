"""Verified weights over real gloo groups: a byte corrupted on its way to one member is
caught before that member uses the version, named, and fixed by sending it again."""
import threading
import time

import pytest
import torch
from conftest import wait_for_job

from async_rl.weight_transfer import gloo_chain
from async_rl.weight_transfer.errors import WeightMismatch
from async_rl.weight_transfer.gloo_chain import GlooChainReceiver
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.sender import WeightSender

BUCKET_MB = 0.0005  # several buckets of the small model: the chain


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(16, 8, generator=g)), ("layer.w", torch.randn(8, 8, generator=g)),
            ("layer.b", torch.randn(8, generator=g)), ("head", torch.randn(4, 8, generator=g))]


def specs(params):
    return [(n, tuple(p.shape), p.dtype) for n, p in params]


def corrupting_receive(victim: str, corrupted: list):
    """The gloo chain's receive that, in the thread named `victim` (the chain's last
    member: nothing forwards from it), flips one bit of its first bucket as it arrives,
    before the receiver takes its fingerprint."""
    real = GlooChainReceiver.receive

    def receive(self, landed=None):
        def flip_then_report(i):
            if i == 0 and threading.current_thread().name.startswith(victim) and not corrupted:
                self.target[0].view(torch.uint8)[5] ^= 0x10
                corrupted.append(True)
            if landed is not None:
                landed(i)
        real(self, flip_then_report)
    return receive


def wait_until(condition, timeout=10.0):
    deadline = time.time() + timeout
    while not (value := condition()):
        assert time.time() < deadline, "not within the timeout"
        time.sleep(0.01)
    return value


def sync(bc, job, receivers, version):
    """Each receiver receives the job's sync in a thread named after it; their errors."""
    errors = {}

    def run(name, receiver, actor_id):
        try:
            receiver.receive(epoch=job.epoch, rank=job.rank_of(actor_id), world_size=len(job.members) + 1,
                             store_host=bc.host, store_port=bc.port, version=version)
        except Exception as err:  # collected for the assertions
            errors[name] = err

    threads = [threading.Thread(target=run, args=(name, r, k), name=name) for k, (name, r) in receivers.items()]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    return errors


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "unstaged"])
def test_a_byte_corrupted_in_flight_is_caught_named_and_sent_again(monkeypatch, staged):
    old, new = model(1), model(2)
    bc = WeightSender(specs(new), bucket_mb=BUCKET_MB, host="127.0.0.1", backend="gloo",
                      device=torch.device("cpu"), timeout_s=20)
    params = {k: model(1) for k in (3, 7)}
    receivers = {k: (f"member-{k}", ParameterReceiver(params[k], bucket_mb=BUCKET_MB, backend="gloo", timeout_s=20,
                                                      staged=staged)) for k in (3, 7)}
    corrupted = []
    monkeypatch.setattr(GlooChainReceiver, "receive", corrupting_receive("member-7", corrupted))
    try:
        bc.set_members([3, 7])
        bc.publish(5, iter(new))
        job = wait_for_job(bc, [3, 7])
        assert gloo_chain.chained(len(bc.plan), 3) and job.rank_of(7) == 2  # the chain's last member
        errors = sync(bc, job, receivers, version=5)
        assert corrupted and list(errors) == ["member-7"], errors
        err = errors["member-7"]
        assert isinstance(err, WeightMismatch)
        assert str(err) == "version 5 did not arrive as sent: embed (bucket 0, bytes 0-512) differs"
        for (name, want), (_, got) in zip(new, params[3]):  # the other member has the version
            assert torch.equal(want, got), name
        victim = receivers[7][1]
        if staged:  # nothing copied: the last version, whole
            assert victim.intact and all(torch.equal(a, b) for (_, a), (_, b) in zip(old, params[7]))
        else:
            assert not victim.intact

        bc.resend(job.epoch)  # what the hub does on WeightsRejected
        again = wait_for_job(bc, [3, 7], newer_than=job.epoch)
        assert again.version == 5
        assert sync(bc, again, receivers, version=5) == {}
        assert victim.intact
        for k in (3, 7):
            for (name, want), (_, got) in zip(new, params[k]):
                assert torch.equal(want, got), (k, name)
    finally:
        bc.close()


def test_a_version_other_than_the_orders_is_refused():
    source = model(0)
    bc = WeightSender(specs(source), bucket_mb=1, host="127.0.0.1", backend="gloo", device=torch.device("cpu"),
                      timeout_s=20)
    receiver = ParameterReceiver(model(1), bucket_mb=1, backend="gloo", timeout_s=2)
    try:
        bc.set_members([1])
        bc.publish(4, iter(source))
        job = wait_for_job(bc, [1])
        errors = sync(bc, job, {1: ("member", receiver)}, version=3)
        assert str(errors["member"]) == ("rank 0 wrote no fingerprint of version 3 within 2s (it published "
                                         "another version, stopped, or its store is out of reach): what arrived "
                                         "cannot be checked")
    finally:
        bc.close()


def test_without_verify_nothing_is_written_or_checked(monkeypatch):
    source = model(0)
    bc = WeightSender(specs(source), bucket_mb=BUCKET_MB, host="127.0.0.1", backend="gloo",
                      device=torch.device("cpu"), timeout_s=20, verify=False)
    params = model(1)
    receiver = ParameterReceiver(params, bucket_mb=BUCKET_MB, backend="gloo", timeout_s=20)
    corrupted = []
    monkeypatch.setattr(GlooChainReceiver, "receive", corrupting_receive("member", corrupted))
    try:
        bc.set_members([1])
        bc.publish(2, iter(source))
        job = wait_for_job(bc, [1])
        assert sync(bc, job, {1: ("member", receiver)}, version=2) == {}
        assert corrupted and not torch.equal(params[0][1], source[0][1])  # used as it came: unchecked
        deadline = time.time() + 10
        while bc.completed < 1 and time.time() < deadline:
            time.sleep(0.01)
        assert not bc.store.check(["check/2"])
    finally:
        bc.close()


def test_a_sync_is_complete_only_once_every_member_has_it():
    """One bucket to three members goes as gloo's broadcast, a tree: rank 0's own part is
    done once its sends are out, before the member its child relays to has the bucket.
    Rank 0 must not count the sync (and take up the next version, which the hub would
    then order) until every member has arrived: a late member would otherwise receive
    this version under the next one's label. Verified weights caught exactly that."""
    source = model(0)
    bc = WeightSender(specs(source), bucket_mb=1, host="127.0.0.1", backend="gloo", device=torch.device("cpu"),
                      timeout_s=20)
    params = {k: model(k) for k in (1, 2, 3)}
    receivers = {k: (f"member-{k}", ParameterReceiver(params[k], bucket_mb=1, backend="gloo", timeout_s=20))
                 for k in (1, 2, 3)}
    try:
        bc.set_members([1, 2, 3])
        bc.publish(1, iter(model(9)))
        first = wait_for_job(bc, [1, 2, 3])
        assert sync(bc, first, receivers, version=1) == {}  # the epoch's group, formed by all
        assert len(bc.plan) == 1 and not gloo_chain.chained(1, 4)  # the tree, not the chain
        wait_until(lambda: bc.completed == 1)
        bc.publish(2, iter(source))
        job = wait_until(lambda: (j := bc.job()) is not None and j.version == 2 and j)
        assert job.epoch == first.epoch
        early = threading.Thread(target=sync, args=(bc, job, {k: receivers[k] for k in (1, 2)}, 2))
        early.start()
        time.sleep(1.5)
        assert bc.completed == 1, "rank 0 counted the sync before member 3 had it"
        assert sync(bc, job, {3: receivers[3]}, version=2) == {}
        early.join(timeout=20)
        wait_until(lambda: bc.completed == 2)
        for k in (1, 2, 3):
            for (name, want), (_, got) in zip(source, params[k]):
                assert torch.equal(want, got), (k, name)
    finally:
        bc.close()


def test_a_slow_sync_keeps_its_fingerprint_while_the_learner_publishes_on():
    """The learner publishes every step without waiting for actors; a sync held up (a
    slow link) may span many publishes. Its version's fingerprint must stay in the store
    until no member can still be reading it: two syncs later, and two sync timeouts after
    it was written (a member dropped from its epoch may still be looking for it)."""
    bc = WeightSender(specs(model(0)), bucket_mb=BUCKET_MB, host="127.0.0.1", backend="gloo",
                      device=torch.device("cpu"), timeout_s=2.5)
    receiver = ParameterReceiver(model(9), bucket_mb=BUCKET_MB, backend="gloo", timeout_s=3)
    try:
        bc.set_members([1])
        bc.publish(1, iter(model(1)))
        job = wait_for_job(bc, [1])
        for version in range(2, 12):  # the member is late: ten more versions meanwhile
            bc.publish(version, iter(model(version)))
        assert sync(bc, job, {1: ("member", receiver)}, version=1) == {}
        assert torch.equal(receiver.params["embed"], model(1)[0][1])
        wait_until(lambda: bc.completed == 1)
        later = wait_until(lambda: (j := bc.job()) is not None and j.version == 11 and j)
        assert sync(bc, later, {1: ("member", receiver)}, version=11) == {}
        wait_until(lambda: bc.completed == 2)
        bc.publish(12, iter(model(12)))
        newest = wait_until(lambda: (j := bc.job()) is not None and j.version == 12 and j)
        assert sync(bc, newest, {1: ("member", receiver)}, version=12) == {}
        wait_until(lambda: bc.completed == 3)
        bc.publish(13, iter(model(13)))  # two syncs since version 1's, but written too recently
        assert bc.store.check(["check/1"])
        time.sleep(2 * 2.5)
        bc.publish(14, iter(model(14)))
        assert not any(bc.store.check([f"check/{v}"]) for v in range(1, 11))  # 2-10 were never sent
        assert bc.store.check(["check/12"]) and bc.store.check(["check/13"])
    finally:
        bc.close()
