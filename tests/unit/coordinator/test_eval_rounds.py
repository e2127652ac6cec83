"""Evaluation on the actors: rounds pinned to one version, chunks, restarts, metrics."""
import numpy as np
import pytest

from async_rl.coordinator.eval_rounds import EvalRounds, summarize
from async_rl.tasks import EVAL_ID_OFFSET
from async_rl.wire import EvalResult

IDS = [EVAL_ID_OFFSET + k for k in range(5)]


def result(grant, actor_id, rewards=None, version=None):
    n = len(grant.prompt_ids)
    r = np.ones((n, 1), np.float32) if rewards is None else np.asarray(rewards, np.float32).reshape(n, -1)
    return EvalResult(actor_id=actor_id, round=grant.round, version=grant.version if version is None else version,
                      prompt_ids=list(grant.prompt_ids), rewards=r, response_lengths=np.full(r.shape, 3, np.int32),
                      truncated=np.zeros(r.shape, np.uint8))


def test_a_round_is_pinned_to_the_first_version_at_or_after_its_request_and_chunked():
    rounds = EvalRounds(IDS, batch_size=2)
    assert rounds.grant(0, 4, {4}) is None  # nothing requested
    rounds.request(5)
    assert rounds.grant(0, 4, {4, 6}) is None  # older weights than asked for
    g1 = rounds.grant(1, 6, {4, 6})
    assert g1.version == 6 and g1.prompt_ids == IDS[:2]
    assert rounds.grant(0, 7, {6, 7}) is None  # pinned to 6: an actor at 7 gets none
    g2, g3 = rounds.grant(1, 6, {6, 7}), rounds.grant(2, 6, {6, 7})
    assert [g2.prompt_ids, g3.prompt_ids] == [IDS[2:4], IDS[4:]]
    assert rounds.grant(1, 6, {6}) is None  # all handed out
    assert rounds.on_result(result(g1, 1, [1, 0])) is None
    assert rounds.on_result(result(g3, 2, [0])) is None
    assert rounds.take_done() == [] and rounds.pending == 1
    assert rounds.on_result(result(g2, 1, [1, 1])) is None
    (line,) = rounds.take_done()
    assert line["step"] == line["version"] == 6 and line["eval/accuracy"] == pytest.approx(3 / 5)
    assert line["eval/prompts"] == 5 and rounds.pending == 0


def test_results_that_answer_no_open_grant_are_refused():
    rounds = EvalRounds(IDS, batch_size=5)
    rounds.request(0)
    g = rounds.grant(0, 0, {0})
    assert rounds.on_result(result(g, actor_id=9)) == "not_granted"  # another actor's chunk
    assert rounds.on_result(result(g, 0, version=1)) == "not_granted"  # scored with other weights
    assert rounds.on_result(result(g, 0)) is None
    assert rounds.on_result(result(g, 0)) == "stale_eval"  # the round is over


def test_a_dead_actors_chunk_goes_to_another_and_a_lost_version_restarts_the_round():
    rounds = EvalRounds(IDS, batch_size=3)
    rounds.request(2)
    g1 = rounds.grant(0, 2, {2})
    rounds.actor_left(0)
    g1b = rounds.grant(1, 2, {2})  # actor 1 holds the same weights: it takes the chunk over
    assert g1b.prompt_ids == g1.prompt_ids and g1b.round == g1.round
    assert rounds.on_result(result(g1b, 1)) is None
    # Nobody holds version 2 any more and a chunk is left: the round starts over at 3.
    g = rounds.grant(1, 3, {3})
    assert g.version == 3 and g.round > g1.round and g.prompt_ids == IDS[:3]
    assert rounds.on_result(result(g1b, 1)) == "stale_eval"
    rest = rounds.grant(1, 3, {3})
    rounds.on_result(result(g, 1))
    rounds.on_result(result(rest, 1))
    (line,) = rounds.take_done()
    assert line["version"] == 3


def test_rounds_queue_in_request_order_and_a_repeated_request_is_one_round():
    rounds = EvalRounds(IDS[:1], batch_size=4)
    rounds.request(0)
    rounds.request(10)
    rounds.request(10)
    assert rounds.pending == 2
    g = rounds.grant(0, 3, {3})
    assert g.version == 3  # the first round takes whatever version >= 0 the actor holds
    assert rounds.grant(0, 3, {3}) is None
    rounds.on_result(result(g, 0))
    assert rounds.grant(0, 3, {3}) is None  # the next round wants version >= 10
    g = rounds.grant(0, 10, {10})
    rounds.on_result(result(g, 0))
    assert [line["step"] for line in rounds.take_done()] == [3, 10]


def test_summarize_accuracy_and_pass_at_k():
    rewards = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    line = summarize(rewards, np.full(rewards.shape, 4), np.array([[0, 0, 0, 1]] * 3, np.uint8))
    assert line["eval/accuracy"] == pytest.approx(5 / 12)
    assert line["eval/pass@4"] == pytest.approx(2 / 3)
    assert line["eval/truncated_frac"] == pytest.approx(0.25) and line["eval/response_len_mean"] == 4
    assert "eval/pass@1" not in summarize(rewards[:, :1], np.ones((3, 1)), np.zeros((3, 1)))
