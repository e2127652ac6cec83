"""The in-order replay buffer: skipped slots are passed over and survive a checkpoint."""
from async_rl.coordinator.replay_buffer import ReplayBuffer


def test_skipped_slots_are_passed_over_without_holding_up_later_ones():
    buf = ReplayBuffer(max_staleness=1, capacity=10)
    buf.put(0, 0, "g0")
    buf.skip(1)
    buf.put(2, 0, "g2")
    assert buf.take(1, learner_version=0, timeout=0).groups == ["g0"]
    taken = buf.take(1, learner_version=0, timeout=0)  # slot 1 skipped, not waited for
    assert taken.groups == ["g2"] and taken.indices == [2]
    assert buf.consumed == 2 and buf.dropped == 0
    buf.skip(1)  # already passed: nothing changes
    assert len(buf) == 0


def test_skipped_slots_survive_a_snapshot():
    buf = ReplayBuffer(max_staleness=1, capacity=10)
    buf.put(0, 0, "g0")
    buf.skip(2)
    buf.put(3, 0, "g3")
    items = buf.contents()
    assert [i for i, _, _ in items] == [0, 3]  # the skipped slot is no group
    again = ReplayBuffer(max_staleness=1, capacity=10)
    again.restore(buf.next_index, items, consumed=0, dropped=0, skipped=[2])
    again.put(1, 0, "g1")
    assert again.take(3, learner_version=0, timeout=0).groups == ["g0", "g1", "g3"]
