"""rewards/components.py: reward.components, weighted sources summed; a weight-0 one is
logged only; each is timed and guarded on its own, in the actor's thread and in the
reward's worker processes alike; the learner logs each one's mean, latency and errors."""
import numpy as np
import pytest
import torch

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.actor.rollout.rollout import Rollout
from async_rl.config import ConfigError, build_config
from async_rl.learner.step_data import component_metrics
from async_rl.rewards.components import Components, ComponentScores
from async_rl.rewards.outcome import Failed
from async_rl.rewards.pool import Call, RewardPool
from async_rl.tasks import task_from_config
from async_rl.tasks.prompt_format import prompt_format_for
from async_rl.wire import WorkGrant, decode, encode

SOURCES = """def length(prompt, response, answer):
    return len(response)


def broken(prompt, response, answer):
    raise KeyError("no judge")


def nan(prompt, response, answer):
    return float("nan")
"""


def test_the_reward_is_the_weighted_sum_and_a_weight_0_failure_fails_nothing():
    parts = Components([("exact", 2.0, lambda p, r, a: float(r == a)), ("len", -0.5, lambda p, r, a: len(r)),
                        ("watch", 0.0, lambda p, r, a: 1 / 0)])
    scores = parts("q", "12", "12")
    assert scores.values == [1.0, 2.0, 0.0] and scores.codes == [0, 0, 1]
    assert scores.settle() == 2.0 * 1.0 - 0.5 * 2  # 1.0: the watcher's failure is logged, not trained on
    assert all(ms >= 0 for ms in scores.ms) and "ZeroDivisionError" in scores.notes[2]


def test_a_weighted_failure_fails_the_sample_naming_the_component_and_reason():
    parts = Components([("exact", 1.0, lambda p, r, a: 1.0), ("judge", 0.5, lambda p, r, a: "yes")])
    failure = parts("q", "r", "a").settle()
    assert isinstance(failure, Failed) and failure.reason == "not_a_number" and "component judge" in str(failure)
    whole = parts.failed_whole(Failed("timeout", "ran past its timeout"))
    assert isinstance(whole.settle(), Failed) and whole.settle().reason == "timeout"


def test_components_need_distinct_names_and_one_weight():
    with pytest.raises(ConfigError, match="names must differ"):
        build_config({"reward": {"components": [{"name": "a", "reward": "task"}, {"name": "a", "reward": "task"}]}})
    with pytest.raises(ConfigError, match="weight other than 0"):
        build_config({"reward": {"components": [{"name": "a", "reward": "task", "weight": 0}]}})


def test_the_reward_workers_score_components_one_by_one(tmp_path):
    path = tmp_path / "sources.py"
    path.write_text(SOURCES)
    components = [{"name": "task", "reward": "task", "weight": 1.0},
                  {"name": "length", "reward": f"{path}:length", "weight": 0.1},
                  {"name": "judge", "reward": f"{path}:broken", "weight": 0.0},
                  {"name": "nan", "reward": f"{path}:nan", "weight": 0.0}]
    with RewardPool({"name": "arithmetic"}, 0, processes=1, timeout_s=10, components=components) as pool:
        [right, wrong] = pool.score([Call("1+1=", "2", "2"), Call("1+1=", "345", "2")])
    assert isinstance(right, ComponentScores) and right.values[:2] == [1.0, 1.0] and right.codes == [0, 0, 1, 3]
    assert right.settle() == pytest.approx(1.1) and wrong.settle() == pytest.approx(0.3)
    assert "KeyError" in right.notes[2] and right.notes[3]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_each_group_carries_its_components_and_the_learner_logs_them(demo_model, tmp_path, executor):
    path = tmp_path / "sources.py"
    path.write_text(SOURCES)
    cfg = build_config({"model": {"path": str(demo_model)}, "train": {"group_size": 4}, "actors": {"max_new_tokens": 3},
                        "reward": {"executor": executor, "workers": 1, "components": [
                            {"name": "exact", "reward": "task", "weight": 1.0},
                            {"name": "length", "reward": f"{path}:length", "weight": 0.5},
                            {"name": "judge", "reward": f"{path}:broken", "weight": 0.0}]}})
    rollout = Rollout.from_config(cfg, TorchEngine(str(demo_model)), prompt_format_for(cfg.model.path, cfg.task),
                                  task_from_config(cfg.task, cfg.seed), torch.Generator().manual_seed(0))
    try:
        groups = [decode(encode(g)) for g in rollout.experience(WorkGrant(groups=[0, 1], prompt_ids=[0, 1]), 0)]
    finally:
        rollout.close()
    for g in groups:
        assert g.components.shape == g.component_ms.shape == g.component_failures.shape == (4, 3)
        np.testing.assert_allclose(g.rewards, g.components[:, 0] + 0.5 * g.components[:, 1], rtol=1e-6)
        assert (g.component_failures[:, :2] == 0).all() and (g.component_failures[:, 2] == 1).all()
        assert len(g.unscorable) == 0  # the judge carries no weight: every sample stays
    metrics = component_metrics(cfg.reward.components, groups)
    values = np.concatenate([g.components for g in groups])
    assert metrics["reward/length/mean"] == pytest.approx(values[:, 1].mean())
    assert metrics["reward/judge/error_frac"] == 1.0 and metrics["reward/judge/errors_raised"] == 8
    assert metrics["reward/judge/unscorable_frac"] == 0.0 and metrics["reward/exact/error_frac"] == 0.0
    assert metrics["reward/exact/latency_p50_ms"] <= metrics["reward/exact/latency_p95_ms"]
    assert "reward/judge/mean" not in metrics
