"""reward.components in a real run: the task's reward trained on with a reward model
beside it (a learned source, scored in batches in the reward's workers), a listwise
scorer of each prompt's whole group, and a watcher of weight 0 that always fails; each
is logged on its own, and the watcher's failures leave every sample scorable."""
from conftest import read_metrics, train

WATCHER = """def judge(prompt, response, answer):
    raise RuntimeError("the judge is down")


def shortest(prompt, responses, answer):
    return [float(len(r) == min(map(len, responses))) for r in responses]
"""


def test_a_run_trains_on_weighted_components_and_logs_each(tmp_path, demo_model, reward_model_dir):
    watcher = tmp_path / "watcher.py"
    watcher.write_text(WATCHER)
    run = tmp_path / "run"
    components = (f"reward.components=[{{name: exact, reward: task}}, "
                  f"{{name: rm, reward: reward_model, model: {reward_model_dir}, weight: 0.1}}, "
                  f"{{name: judge, reward: '{watcher}:judge', weight: 0}}, "
                  f"{{name: shortest, reward: '{watcher}:shortest', weight: 0.1, scope: group}}]")
    train(run, demo_model, "train.max_steps=2", "eval.every=0", components)
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["reward/exact/error_frac"] == 0.0 and step["reward/rm/error_frac"] == 0.0
        assert step["reward/rm/latency_p50_ms"] > 0 and "reward/rm/mean" in step
        assert step["reward/judge/error_frac"] == 1.0 and step["reward/judge/errors_raised"] == 32
        assert step["reward/judge/unscorable_frac"] == 0.0 and step["reward/unscorable_frac"] == 0.0
        assert step["reward/errors"] == 0  # a watcher's failures are its own, not the sample's
        assert step["reward/shortest/error_frac"] == 0.0 and 0 < step["reward/shortest/mean"] <= 1
