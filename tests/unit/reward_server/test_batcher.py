from async_rl.reward_server.batcher import Batcher, Row


def rows(request, n, tokens=10, at=0.0, expires=100.0):
    return [Row(request, i, tokens, at, expires) for i in range(n)]


def test_a_full_queue_is_scored_at_once_and_a_short_one_after_its_wait():
    batcher = Batcher(max_batch=4, max_tokens=1000, max_wait_s=0.5)
    batcher.add("rm", rows("a", 3))
    assert batcher.next_batch(now=0.1) is None and batcher.wait_s(now=0.1) == 0.4
    batcher.add("rm", rows("b", 3, at=0.1))
    name, batch = batcher.next_batch(now=0.1)
    assert name == "rm" and [(r.request, r.index) for r in batch] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert batcher.next_batch(now=0.2) is None  # b's other two rows wait from 0.1
    assert [r.index for r in batcher.next_batch(now=0.6)[1]] == [1, 2]
    assert batcher.wait_s(now=0.6) is None


def test_tokens_bound_a_batch_and_a_long_row_goes_alone():
    batcher = Batcher(max_batch=32, max_tokens=100, max_wait_s=0.0)
    batcher.add("rm", [Row("a", 0, 60, 0, 9), Row("a", 1, 60, 0, 9), Row("a", 2, 500, 0, 9), Row("a", 3, 1, 0, 9)])
    sizes = []
    while (batch := batcher.next_batch(now=1.0)) is not None:
        sizes.append([r.tokens for r in batch[1]])
    assert sizes == [[60], [60], [500], [1]]


def test_rows_nobody_waits_for_are_dropped_and_the_longest_waiting_component_goes_first():
    batcher = Batcher(max_batch=2, max_tokens=1000, max_wait_s=0.0)
    batcher.add("judge", rows("late", 2, at=0.5))
    batcher.add("rm", rows("gone", 2, expires=1.0) + rows("here", 1, at=0.2))
    assert batcher.next_batch(now=2.0)[1][0].request == "here"
    assert batcher.dropped == 2
    assert batcher.next_batch(now=2.0)[0] == "judge"
