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


def two_groups(model, executor: str, components: list[dict]):
    """(config, rollout, two groups of 4 as the learner decodes them) of a real engine whose
    samples `components` scored, in the reward's workers or the actor's thread."""
    cfg = build_config({"model": {"path": str(model)}, "train": {"group_size": 4}, "actors": {"max_new_tokens": 3},
                        "reward": {"executor": executor, "workers": 1, "components": components}})
    rollout = Rollout.from_config(cfg, TorchEngine(str(model)), prompt_format_for(cfg.model.path, cfg.task),
                                  task_from_config(cfg.task, cfg.seed), torch.Generator().manual_seed(0))
    try:
        groups = rollout.experience(WorkGrant(groups=[0, 1], prompt_ids=[0, 1]), 0)
        return cfg, rollout, [decode(encode(g)) for g in groups]
    finally:
        rollout.close()


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
    cfg, _, groups = two_groups(demo_model, executor, [{"name": "exact", "reward": "task", "weight": 1.0},
                                                       {"name": "length", "reward": f"{path}:length", "weight": 0.5},
                                                       {"name": "judge", "reward": f"{path}:broken", "weight": 0.0}])
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
    lengths = np.concatenate([g.response_lengths for g in groups])
    assert metrics["reward/length/length_corr"] == pytest.approx(np.corrcoef(values[:, 1], lengths)[0, 1], abs=1e-6)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_an_evaluation_scores_the_tasks_own_reward_not_the_components(demo_model, tmp_path, executor):
    path = tmp_path / "generous.py"
    path.write_text("def generous(prompt, response, answer):\n    return 5.0\n")
    cfg = build_config({"model": {"path": str(demo_model)}, "eval": {"max_new_tokens": 3},
                        "reward": {"executor": executor, "workers": 1, "components": [
                            {"name": "generous", "reward": f"{path}:generous", "weight": 1.0},
                            {"name": "exact", "reward": "task", "weight": 0.0}]}})
    task = task_from_config(cfg.task, cfg.seed)
    fmt = prompt_format_for(cfg.model.path, cfg.task)
    rollout = Rollout.from_config(cfg, TorchEngine(str(demo_model)), fmt, task, torch.Generator().manual_seed(0))
    try:
        prompts = task.eval_prompts()[:4]
        groups = rollout.evaluation([p.id for p in prompts])
    finally:
        rollout.close()
    for prompt, group in zip(prompts, groups):
        for ep in group:  # a learned reward's gains are checked against the task's, not repeated
            assert ep.reward == task.reward(prompt.text, fmt.response_text(ep.tokens), prompt.answer)
            assert ep.components is None


RANKING = """def shortest_first(prompt, responses, answer):
    order = sorted(range(len(responses)), key=lambda i: (len(responses[i]), i))
    return [1.0 - order.index(i) / max(len(responses) - 1, 1) for i in range(len(responses))]


def too_few(prompt, responses, answer):
    return [1.0]
"""


def test_a_group_scope_component_scores_the_whole_group_once():
    calls = []

    def listwise(prompt, responses, answer):
        calls.append(list(responses))
        return [float(len(r)) for r in responses]

    parts = Components([("exact", 1.0, lambda p, r, a: float(r == a)), ("list", 0.5, listwise),
                        ("broken", 0.0, lambda p, rs, a: [1.0])], grouped=frozenset({"list", "broken"}))
    scores = parts.score_group("q", ["12", "3", "12x"], "12")
    assert calls == [["12", "3", "12x"]]  # once, with every response
    assert [s.settle() for s in scores] == [1.0 + 0.5 * 2, 0.5 * 1, 0.5 * 3]
    assert all(s.codes[2] == 1 and "returned 1 scores for 3 responses" in s.notes[2] for s in scores)
    with pytest.raises(ConfigError, match="scope: group"):
        build_config({"reward": {"components": [{"name": "t", "reward": "task", "scope": "group"}]}})


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_each_prompts_group_goes_to_a_group_scorer_together(demo_model, tmp_path, executor):
    path = tmp_path / "ranking.py"
    path.write_text(RANKING)
    _, rollout, groups = two_groups(demo_model, executor, [
        {"name": "exact", "reward": "task"},
        {"name": "rank", "reward": f"{path}:shortest_first", "weight": 0.5, "scope": "group"},
        {"name": "few", "reward": f"{path}:too_few", "weight": 0.0, "scope": "group"}])
    for g in groups:
        texts = [rollout.prompt_format.response_text(r.tokens) for r in g.responses()]
        order = sorted(range(4), key=lambda i: (len(texts[i]), i))
        np.testing.assert_allclose(g.components[:, 1], [1.0 - order.index(i) / 3 for i in range(4)], rtol=1e-6)
        np.testing.assert_allclose(g.rewards, g.components[:, 0] + 0.5 * g.components[:, 1], rtol=1e-6)
        assert (g.component_failures[:, 2] == 1).all() and len(g.unscorable) == 0


def test_an_actor_whose_workers_score_builds_no_source_of_its_own(tmp_path):
    from async_rl.rewards.components import components_from_config

    missing = str(tmp_path / "no-such-model")  # loading it would raise
    parts = [{"name": "rm", "reward": "reward_model", "model": missing, "weight": 1.0},
             {"name": "pairwise", "reward": "tests.nowhere:f", "weight": 0.5, "scope": "group"}]
    described = components_from_config(parts, task_reward=None, load=False)
    assert described.names == ["rm", "pairwise"] and described.weights == [1.0, 0.5] and described.grouped
    assert described.functions == [None, None]
    with pytest.raises(OSError):
        components_from_config(parts[:1], task_reward=None)
