"""actor/scoring.py: an actor hands generated samples to its scorer thread and goes on;
each group is pushed once scored, in order; past `reward.in_flight` grants the actor
waits; a failure there surfaces in the actor; queued grants are dropped on leaving.
A reward that waits for a file to appear stands for a slow one (no timing assumed)."""
import threading
import time

import pytest
import torch
import zmq

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.rollout.rollout import Rollout
from async_rl.actor.scoring import Scorer
from async_rl.config import build_config
from async_rl.run.tracing import SpanRecorder
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.wire import ExperienceGroup, WorkGrant, decode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GATED_REWARD = """import os, time


def score(prompt, response, answer):
    while not os.path.exists({gate!r}):
        time.sleep(0.01)
    return 1.0
"""


@pytest.fixture
def setup(demo_model, tmp_path):
    """(make_scorer(in_flight, push_timeout_ms), rollout, pull socket, gate file); all closed after."""
    gate = tmp_path / "go"
    reward = tmp_path / "gated.py"
    reward.write_text(GATED_REWARD.format(gate=str(gate)))
    cfg = build_config({"model": {"path": str(demo_model)}, "train": {"group_size": 2},
                        "actors": {"max_new_tokens": 3}, "task": {"name": "arithmetic", "reward": f"{reward}:score"},
                        "reward": {"workers": 1, "timeout_s": 60}})
    engine = TorchEngine(str(demo_model))
    rollout = Rollout.from_config(cfg, engine, prompt_format_for(cfg.model.path, cfg.task),
                                  task_from_config(cfg.task, cfg.seed), torch.Generator().manual_seed(0))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 30_000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    made = []

    def make(in_flight: int, connect: bool = True) -> tuple[Scorer, dict, SpanRecorder]:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, 30_000 if connect else 100)
        push.setsockopt(zmq.LINGER, 0)
        if connect:
            push.connect(f"tcp://127.0.0.1:{port}")
        state, spans = {"generated": 0}, SpanRecorder()
        scorer = Scorer(rollout, push, state, spans, in_flight)
        made.append((scorer, push))
        return scorer, state, spans

    yield make, rollout, pull, gate
    gate.touch()
    for scorer, push in made:
        scorer.close(wait_s=10)
        push.close()
    pull.close()
    rollout.close()
    ctx.term()


def grant(first: int) -> WorkGrant:
    return WorkGrant(groups=[first, first + 1], prompt_ids=[first, first + 1])


def received(pull) -> ExperienceGroup:
    return decode(pull.recv_multipart())


def test_the_actor_goes_on_while_its_samples_are_scored_and_they_arrive_once_scored(setup):
    make, rollout, pull, gate = setup
    scorer, state, spans = make(in_flight=2)
    scorer.score(rollout.generate(grant(0), actor_id=3))  # returns with the reward still waiting
    scorer.score(rollout.generate(grant(2), actor_id=3))  # the actor generated the next grant meanwhile
    assert pull.poll(200) == 0 and state["generated"] == 0  # nothing enters the stream unscored
    gate.touch()
    groups = [received(pull) for _ in range(4)]
    assert [g.group for g in groups] == [0, 1, 2, 3]  # in order
    assert all(g.actor_id == 3 and g.rewards.tolist() == [1.0, 1.0] for g in groups)
    names = [s.name for s in spans.snapshot()[0]]
    assert "score" in names and "wait-for-rewards" not in names


def test_past_the_bound_the_actor_waits_for_rewards(setup):
    make, rollout, pull, gate = setup
    scorer, state, spans = make(in_flight=1)
    scorer.score(rollout.generate(grant(0), actor_id=0))
    second = rollout.generate(grant(2), actor_id=0)
    done = threading.Event()
    waiting = threading.Thread(target=lambda: (scorer.score(second), done.set()), daemon=True)
    waiting.start()
    assert not done.wait(0.5)  # one grant in flight: the second waits
    gate.touch()
    assert done.wait(30)
    assert [received(pull).group for _ in range(4)] == [0, 1, 2, 3]
    assert "wait-for-rewards" in [s.name for s in spans.snapshot()[0]]


def test_in_flight_zero_scores_and_pushes_before_returning(setup):
    make, rollout, pull, gate = setup
    gate.touch()
    scorer, state, _ = make(in_flight=0)
    scorer.score(rollout.generate(grant(0), actor_id=0))
    assert state["generated"] == 2  # pushed already
    assert [received(pull).group for _ in range(2)] == [0, 1]


def test_a_failure_in_the_scorer_thread_is_raised_in_the_actor(setup):
    make, rollout, pull, gate = setup
    gate.touch()
    scorer, _, _ = make(in_flight=1, connect=False)  # nobody to push to: the send times out
    scorer.score(rollout.generate(grant(0), actor_id=0))
    with pytest.raises(zmq.Again):
        for _ in range(100):  # the next call after the thread failed raises its error
            scorer.score(rollout.generate(grant(2), actor_id=0))


def test_leaving_drops_the_queued_grants(setup):
    make, rollout, pull, gate = setup
    scorer, state, _ = make(in_flight=3)
    for first in (0, 2, 4):
        scorer.score(rollout.generate(grant(first), actor_id=0))
    while scorer.queued > 2:  # until the first is being scored
        time.sleep(0.01)
    scorer.drop_pending()  # the hub re-issued them; the one being scored still goes out
    gate.touch()
    assert [received(pull).group for _ in range(2)] == [0, 1]
    scorer.close(wait_s=10)
    assert pull.poll(300) == 0 and state["generated"] == 2


def test_closing_says_whether_the_thread_stopped_so_its_socket_is_left_to_it(setup):
    make, rollout, pull, gate = setup
    scorer, state, _ = make(in_flight=1)
    scorer.score(rollout.generate(grant(0), actor_id=0))
    while scorer.queued:  # until it is being scored: the gated reward holds the thread
        time.sleep(0.01)
    assert scorer.close(wait_s=0.2) is False  # still at work: the actor must not close its socket
    gate.touch()
    assert [received(pull).group for _ in range(2)] == [0, 1]  # the grant being scored still goes out
    assert scorer.close(wait_s=10) is True
