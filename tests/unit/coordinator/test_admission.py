"""Admission control + in-order consumption never exceed max_staleness."""
import random
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.coordinator.admission import Admission
from async_rl.coordinator.replay_buffer import ReplayBuffer
from async_rl.staleness import consumed_at


def simulate(eta: int, B: int, n_actors: int, per_request: int, sync_every: int, seed: int, steps: int = 12):
    """Discrete simulation: actors with random speeds request work with their own
    (possibly lagging) version, deliver after a random delay, in any order; the learner
    consumes B groups per step in admission order; weights reach each actor after a
    random lag. Returns the staleness of every consumed group and the drop count."""
    rng = random.Random(seed)
    adm = Admission(eta, B)
    buf: ReplayBuffer[int] = ReplayBuffer(eta, capacity=10_000)
    actor_version = [0] * n_actors
    pending_sync = [None] * n_actors  # version in transit to that actor
    in_flight = []  # (finish_time, index, version)
    learner_version, now, staleness = 0, 0.0, []
    for _ in range(100_000):
        if learner_version >= steps:
            break
        now += 1.0
        for a in range(n_actors):
            if pending_sync[a] is not None and rng.random() < 0.3:
                actor_version[a], pending_sync[a] = pending_sync[a], None
            if rng.random() < 0.5:  # actor asks for work at a random moment
                for i in adm.admit(actor_version[a], rng.randint(1, per_request)):
                    in_flight.append((now + rng.expovariate(1 / (1 + 5 * a)), i, actor_version[a]))
        for item in [x for x in in_flight if x[0] <= now]:
            in_flight.remove(item)
            buf.put(item[1], item[2], item[1])
        taken = buf.take(B, learner_version, timeout=0)
        if taken is not None:
            staleness += [learner_version - v for v in taken.versions]
            learner_version += 1
            if learner_version % sync_every == 0:
                pending_sync = [learner_version] * n_actors
    return staleness, buf.dropped, learner_version


@settings(max_examples=60, deadline=None)
@given(eta=st.integers(0, 4), B=st.integers(1, 6), n_actors=st.integers(1, 4), per_request=st.integers(1, 5),
       seed=st.integers(0, 10_000), data=st.data())
def test_staleness_never_exceeds_bound(eta, B, n_actors, per_request, seed, data):
    sync_every = data.draw(st.integers(1, eta + 1))
    staleness, dropped, steps = simulate(eta, B, n_actors, per_request, sync_every, seed)
    assert steps == 12, "the pipeline must not deadlock"
    assert staleness and max(staleness) <= eta
    assert dropped == 0


def test_synchronous_baseline_is_on_policy():
    staleness, dropped, _ = simulate(0, 4, 3, 2, 1, seed=1)
    assert set(staleness) == {0} and dropped == 0


def test_async_runs_are_actually_stale():
    staleness, _, _ = simulate(3, 2, 3, 3, 1, seed=2)
    assert max(staleness) > 0


def test_capacity_uses_actor_version():
    adm = Admission(max_staleness=1, batch_groups=4)
    assert list(adm.admit(0, 100)) == list(range(8))  # (1 + 0 + 1) * 4
    assert adm.capacity(0) == 0 and adm.capacity(1) == 4
    assert consumed_at(7, 4) == 1
    assert adm.allows(7, 0) and not adm.allows(8, 0) and adm.allows(8, 1)


def test_buffer_orders_by_admission_and_keeps_partial_on_timeout():
    buf: ReplayBuffer[str] = ReplayBuffer(max_staleness=2, capacity=10)
    assert buf.put(1, 0, "b") and buf.put(2, 0, "c")
    assert buf.take(2, 0, timeout=0.05) is None  # slot 0 missing
    assert buf.put(0, 0, "a")
    assert buf.take(2, 0, timeout=0.05).groups == ["a", "b"]
    assert not buf.put(1, 0, "dup")  # already consumed
    assert buf.take(1, 0, timeout=0.05).groups == ["c"]


def test_buffer_safety_net_drops_too_stale():
    buf: ReplayBuffer[str] = ReplayBuffer(max_staleness=1, capacity=10)
    buf.put(0, 0, "old")
    buf.put(1, 3, "new")
    taken = buf.take(1, learner_version=3, timeout=0.05)
    assert taken.groups == ["new"] and buf.dropped == 1 and taken.dropped_indices == [0]


def test_buffer_take_blocks_until_put_from_another_thread():
    buf: ReplayBuffer[str] = ReplayBuffer(max_staleness=0, capacity=4)
    waiting = threading.Event()

    class Watched(threading.Event):  # take() looks at its stop event in every round of its wait
        def is_set(self):
            waiting.set()
            return super().is_set()

    def put_once_it_waits():
        waiting.wait(timeout=60)
        time.sleep(0.1)  # a wait of at least this long, for take() to measure
        buf.put(0, 0, "late")

    putter = threading.Thread(target=put_once_it_waits)
    putter.start()
    taken = buf.take(1, 0, timeout=60, stop=Watched())
    putter.join()
    assert taken.groups == ["late"] and taken.waited_s >= 0.1
