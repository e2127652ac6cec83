"""rollout/rollout.py: one way to make a sample. A single-turn response is a one-turn
episode scored by the task's reward (guarded); it travels as a plain response, as the
engine sampled it. Evaluation scores come from the same path; ReMax's greedy baseline
too, with or without an environment."""
import numpy as np
import psutil
import pytest
import torch

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.environments import Turn
from async_rl.actor.rollout.rollout import Rollout
from async_rl.config import build_config
from async_rl.tasks import PromptIndex, task_from_config
from async_rl.tasks.base import EVAL_ID_OFFSET
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.wire import WorkGrant, decode, encode

pytestmark = pytest.mark.usefixtures("one_torch_thread", "closed_rollouts")
OPENED: list[Rollout] = []


@pytest.fixture
def closed_rollouts():
    """Every rollout a test made is closed after it: its reward workers stop."""
    yield
    while OPENED:
        OPENED.pop().close()


class Spy(TorchEngine):
    def _generate(self, prompts, n, max_new_tokens, temperature, top_p, greedy, generator):
        self.calls.append((len(prompts), n, greedy))
        return super()._generate(prompts, n, max_new_tokens, temperature, top_p, greedy, generator)


def _setup(model, **config):
    cfg = build_config({"model": {"path": str(model)}, "train": {"group_size": 4}, "actors": {"max_new_tokens": 4},
                        **config})
    engine = Spy(str(model))
    engine.calls = []
    task = task_from_config(cfg.task, cfg.seed)
    rollout = Rollout.from_config(cfg, engine, prompt_format_for(cfg.model.path, cfg.task), task,
                                  torch.Generator().manual_seed(0))
    OPENED.append(rollout)
    return cfg, engine, task, rollout


def test_single_turn_samples_are_plain_responses_scored_by_the_task(demo_model):
    cfg, engine, task, rollout = _setup(demo_model)
    grant = WorkGrant(groups=[10, 11, 12], prompt_ids=[3, 4, 5])
    groups = [decode(encode(g)) for g in rollout.experience(grant, actor_id=2)]
    assert engine.calls == [(3, 4, False)]  # one batch, each prompt prefilled once for its 4 samples
    fmt = rollout.prompt_format
    for g, prompt_id, index in zip(groups, grant.prompt_ids, grant.groups):
        prompt = PromptIndex(task)[prompt_id]
        assert (g.actor_id, g.group, g.prompt_id, g.version) == (2, index, prompt_id, 0)
        assert g.prompt_tokens.tolist() == fmt.encode(prompt)
        assert len(g.policy_mask) == 0 and len(g.step_ends) == 0 and g.greedy_reward is None  # the single-turn format
        for r, reward, cut in zip(g.responses(), g.rewards, g.truncated):
            assert reward == task.reward(prompt.text, fmt.response_text(r.tokens.tolist()), prompt.answer)
            assert (r.logprobs <= 0).all() and bool(cut) == (len(r.tokens) == 4 and r.tokens[-1] not in
                                                             engine.eos_token_ids)
        assert g.reward_errors == [0, 0, 0, 0] and g.gen_seconds > 0


def test_a_failing_reward_scores_the_fallback_and_is_counted_with_its_group(demo_model, tmp_path):
    rewards = tmp_path / "flaky.py"
    rewards.write_text("def score(prompt, response, answer):\n    raise ValueError('no')\n")
    cfg, engine, task, rollout = _setup(demo_model, task={"reward": f"{rewards}:score"},
                                        reward={"fallback": -0.25})
    [g] = rollout.experience(WorkGrant(groups=[0], prompt_ids=[0]), actor_id=0)
    assert g.rewards.tolist() == [-0.25] * 4 and g.reward_errors == [4, 0, 0, 0] and g.env_errors == [0, 0, 0, 0]
    assert g.first_failure == "reward raised ValueError: no"
    assert g.unscorable.tolist() == [1, 1, 1, 1]  # reward.on_failure=exclude: the learner leaves them out


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_only_the_failed_samples_are_unscorable_and_fallback_keeps_none(demo_model, tmp_path, executor):
    rewards = tmp_path / "every_other.py"
    rewards.write_text("calls = 0\n"
                       "def score(prompt, response, answer):\n"
                       "    global calls\n"
                       "    calls += 1\n"
                       "    if calls % 2 == 0:\n"
                       "        raise ValueError('even call')\n"
                       "    return 1.0\n")
    for on_failure, flags in (("exclude", [0, 1, 0, 1]), ("fallback", [])):
        *_, rollout = _setup(demo_model, task={"reward": f"{rewards}:score"},
                             reward={"executor": executor, "workers": 1, "on_failure": on_failure})
        [g] = rollout.experience(WorkGrant(groups=[0], prompt_ids=[0]), actor_id=0)
        assert g.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and g.reward_errors == [2, 0, 0, 0]
        assert g.unscorable.tolist() == flags


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_a_reward_past_its_deadline_is_stopped_in_its_worker_and_unscorable(demo_model, tmp_path):
    rewards = tmp_path / "spin.py"
    rewards.write_text("def score(prompt, response, answer):\n    while True:\n        pass\n")
    *_, rollout = _setup(demo_model, task={"reward": f"{rewards}:score"}, reward={"timeout_s": 0.3, "workers": 2})
    spinning = [w.process.pid for w in rollout.reward_pool.workers]
    [g] = rollout.experience(WorkGrant(groups=[0], prompt_ids=[0]), actor_id=0)
    assert g.reward_errors == [0, 4, 0, 0] and g.unscorable.tolist() == [1, 1, 1, 1]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in spinning)  # killed: no core left busy


def test_evaluation_scores_are_the_greedy_responses_rewards(demo_model):
    cfg, engine, task, rollout = _setup(demo_model, eval={"max_new_tokens": 3})
    ids = [EVAL_ID_OFFSET, EVAL_ID_OFFSET + 3]
    scores = rollout.scores(ids)
    assert scores.rewards.shape == scores.lengths.shape == scores.truncated.shape == (2, 1)
    fmt, prompts = rollout.prompt_format, [PromptIndex(task)[i] for i in ids]
    greedy = TorchEngine(str(demo_model)).generate([fmt.encode(p) for p in prompts], max_new_tokens=3, greedy=True)
    for i, (p, (c,)) in enumerate(zip(prompts, greedy)):
        assert scores.rewards[i, 0] == task.reward(p.text, fmt.response_text(c.tokens.tolist()), p.answer)
        assert scores.lengths[i, 0] == len(c.tokens) and scores.truncated[i, 0] == (not c.finished)
    _, _, _, sampling = _setup(demo_model, eval={"pass_k": 3, "temperature": 1.0})
    assert sampling.scores(ids).rewards.shape == (2, 3)


def test_remax_baseline_is_a_greedy_episode_of_the_same_weights(demo_model):
    cfg, engine, task, rollout = _setup(demo_model, train={"group_size": 4, "advantage": "remax"})
    grant = WorkGrant(groups=[0, 1], prompt_ids=[7, 8])
    groups = rollout.experience(grant, actor_id=0)
    assert engine.calls == [(2, 4, False), (2, 1, True)]
    fmt = rollout.prompt_format
    greedy = TorchEngine(str(demo_model)).generate([g.prompt_tokens.tolist() for g in groups], max_new_tokens=4,
                                                   greedy=True)
    for g, (c,), prompt_id in zip(groups, greedy, grant.prompt_ids):
        prompt = PromptIndex(task)[prompt_id]
        assert g.greedy_reward == task.reward(prompt.text, fmt.response_text(c.tokens.tolist()), prompt.answer)


def echo_factory(prompt):
    return Echo()


class Echo:
    """Rewards a turn by its length in characters, over two turns."""

    def __init__(self):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        return Turn([{"role": "user", "content": "again"}], reward=float(len(action)), done=self.turns == 2)


def broken_factory(prompt):
    raise RuntimeError("the board is gone")


def test_an_environment_that_fails_is_counted_as_the_environments_not_the_rewards(chat_model):
    cfg, engine, task, rollout = _setup(
        chat_model, task={"name": "word_problems"}, reward={"fallback": -1.0},
        env={"name": f"{__name__}:broken_factory", "max_turns": 2, "max_tokens": 64, "turn_tokens": 3},
        train={"group_size": 2})
    [g] = [decode(encode(group)) for group in rollout.experience(WorkGrant(groups=[0], prompt_ids=[0]), actor_id=0)]
    assert g.env_errors == [2, 0, 0, 0] and g.reward_errors == [0, 0, 0, 0] and g.rewards.tolist() == [-1.0, -1.0]
    assert g.first_failure == "environment raised RuntimeError: the board is gone" and g.observations_cut == 0
    scores = rollout.scores([EVAL_ID_OFFSET])
    assert scores.failures["env_errors"] == [1, 0, 0, 0] and scores.failures["first_failure"].startswith("environment")


def test_remax_baseline_plays_against_the_environment_too(chat_model):
    cfg, engine, task, rollout = _setup(
        chat_model, task={"name": "word_problems"},
        env={"name": f"{__name__}:echo_factory", "max_turns": 2, "max_tokens": 64, "turn_tokens": 3},
        train={"group_size": 2, "advantage": "remax"})
    groups = rollout.experience(WorkGrant(groups=[0], prompt_ids=[0]), actor_id=0)
    [g] = [decode(encode(group)) for group in groups]
    assert g.greedy_reward is not None and g.greedy_reward >= 0 and g.reward_errors == [0, 0, 0, 0]
    assert any(greedy for _, _, greedy in engine.calls)  # the greedy episode's turns
    assert len(g.policy_mask) == len(g.response_tokens) and np.isin(g.policy_mask, [0, 1]).all()
