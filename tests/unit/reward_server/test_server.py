"""The reward server on real sockets, in a thread of this process, with a tiny reward model."""
import threading
import time

import pytest
import zmq

from async_rl.reward_server import protocol
from async_rl.reward_server.client import ServerScorer
from async_rl.reward_server.server import RewardServer
from async_rl.rewards.outcome import Failed
from async_rl.rewards.reward_model import RewardModel, weights_version

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Flaky:
    """A source whose second row of each batch raises, and which counts its batches."""

    def __init__(self):
        self.batches = []

    def score_batch(self, prompts, responses, answers):
        self.batches.append(len(prompts))
        return [Failed("not_a_number", "unparsable") if r == "bad" else float(len(r)) for r in responses]


@pytest.fixture
def serve():
    started = []

    def start(sources, **limits):
        limits = {"max_batch": 32, "max_tokens": 1 << 20, "max_wait_s": 0.05, **limits}
        server = RewardServer(sources, {name: f"v-{name}" for name in sources}, "tcp://127.0.0.1:0", **limits)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stopping = True
        thread.join(timeout=10)


def test_batched_scores_equal_one_at_a_time_scores(serve, reward_model_dir):
    model = RewardModel(reward_model_dir)
    server = serve({"rm": model})
    prompts = [f"{a}+{b}=" for a, b in [(1, 2), (13, 29), (7, 7), (100, 1), (5, 55)]]
    responses = ["3", "42", "14 and more words here", "101", ""]
    alone = [model.score_batch([p], [r])[0] for p, r in zip(prompts, responses)]
    scorer = ServerScorer(server.endpoint, "rm", timeout_s=30)
    together = scorer.score_batch(prompts, responses)
    assert together == pytest.approx(alone, abs=1e-5)
    assert scorer.version == "v-rm" and server.stats.largest == 5


def test_rows_of_several_callers_are_scored_in_one_batch_and_each_gets_its_own(serve):
    source = Flaky()
    server = serve({"f": source}, max_batch=6, max_wait_s=60.0)  # scored when all six rows are in
    results = {}

    def call(k):
        results[k] = ServerScorer(server.endpoint, "f", timeout_s=30).score_batch(["p"] * 2, ["x" * k, "bad"])

    threads = [threading.Thread(target=call, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert source.batches == [6]  # three requests, one forward
    for k in (1, 2, 3):
        assert results[k][0] == float(k)
        assert isinstance(results[k][1], Failed) and results[k][1].reason == "not_a_number"


def test_max_batch_splits_a_request_and_its_answer_waits_for_all_rows(serve):
    source = Flaky()
    server = serve({"f": source}, max_batch=2, max_wait_s=0.0)
    assert ServerScorer(server.endpoint, "f", timeout_s=30).score_batch(["p"] * 5, ["a"] * 5) == [1.0] * 5
    assert source.batches == [2, 2, 1]


def test_a_server_that_is_not_there_fails_rows_quickly_as_unscorable():
    started = time.monotonic()
    with pytest.raises(Failed, match="unreachable") as err:
        ServerScorer("tcp://127.0.0.1:9", "rm", timeout_s=30).score_batch(["p"], ["r"])
    assert err.value.reason == "raised" and time.monotonic() - started < 10


def test_a_server_that_does_not_answer_in_time_is_a_timeout(serve):
    class Slow:
        def score_batch(self, prompts, responses, answers):
            time.sleep(1.5)
            return [1.0] * len(prompts)

    server = serve({"slow": Slow()})
    scorer = ServerScorer(server.endpoint, "slow", timeout_s=0.5)
    with pytest.raises(Failed, match="no answer") as err:
        scorer.score_batch(["p"], ["r"])
    assert err.value.reason == "timeout"
    time.sleep(1.5)  # the late answer went to a socket that was dropped; the next call is answered as its own
    assert ServerScorer(server.endpoint, "slow", timeout_s=5).score_batch(["p"], ["r"]) == [1.0]


def test_malformed_requests_and_unknown_components_are_refused_and_counted(serve):
    server = serve({"f": Flaky()})
    with pytest.raises(Failed, match="no component 'rm'"):
        ServerScorer(server.endpoint, "rm", timeout_s=5).score_batch(["p"], ["r"])
    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    raw.send(b"\xc1 not msgpack")
    raw.send_multipart([b"two", b"frames"])
    ping = protocol.encode(protocol.ScoreRequest(9, "", [], [], [], 1.0))
    raw.send(ping)
    assert raw.poll(5000)
    reply = protocol.decode_reply(raw.recv())
    assert reply.id == 9 and reply.version == '{"f": "v-f"}'  # the server lives on after what it refused
    raw.close()
    assert server.stats.rejected == 3


def test_a_version_is_the_weights_content(tmp_path, reward_model_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reward_model_dir, copy)
    assert weights_version(copy) == weights_version(reward_model_dir)
    (copy / "model.safetensors").write_bytes(b"retrained")
    assert weights_version(copy) != weights_version(reward_model_dir)


def test_a_local_judge_answers_a_batch_in_one_generate_call(serve, demo_model):
    from async_rl.rewards.judge import Judge

    judge = Judge(model=demo_model, parser="score", max_tokens=4, template="{prompt}{response}=")
    calls = []
    generate = judge.local.engine.generate
    judge.local.engine.generate = lambda ids, **kw: calls.append(len(ids)) or generate(ids, **kw)
    server = serve({"judge": judge})
    scorer = ServerScorer(server.endpoint, "judge", timeout_s=60)
    prompts, responses = ["12+7=", "3+4=", "12+7="], ["19", "7", "19"]
    first = scorer.score_batch(prompts, responses, ["19", "7", "19"])
    assert calls == [2]  # two questions (one asked twice), one generate call
    for outcome in first:  # a tiny model may answer with no number: unscorable, never 0
        assert isinstance(outcome, float) or (isinstance(outcome, Failed) and outcome.reason == "not_a_number")
    again = scorer.score_batch(prompts, responses, ["19", "7", "19"])
    unparsed = {(p, r) for p, r, o in zip(prompts, responses, first) if isinstance(o, Failed)}
    assert calls == ([2, len(unparsed)] if unparsed else [2])  # the parsed ones answered by the cache
    assert [type(o) for o in again] == [type(o) for o in first]
