"""Other packages' tasks and environments through `async-rl train`, unchanged: a
reasoning-gym dataset as the task (scored by its own score_answer) and a skyrl-gym
environment answering multi-turn episodes, on a tiny chat model with real actors, wire
and learner."""
import math

import pytest
from conftest import read_metrics, train


@pytest.mark.extended
def test_a_reasoning_gym_dataset_trains_and_is_evaluated(tmp_path, chat_model):
    pytest.importorskip("reasoning_gym")
    run = tmp_path / "run"
    # The tiny model's context is short: a short system prompt, the dataset's shortest questions.
    train(run, chat_model, "task.name=reasoning_gym", "task.dataset=basic_arithmetic",
          "task.system_prompt=Answer in <answer></answer>.", "actors.max_new_tokens=6",
          "train.max_steps=2", "learner.ranks=1", "task.eval_size=8", "eval.batch_size=8")
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(math.isfinite(s["loss/total"]) and s["reward/errors"] == 0 for s in steps)
    assert evals and all(0.0 <= e["eval/reward_mean"] <= 1.0 for e in evals)


def test_a_skyrl_gym_environment_answers_multi_turn_episodes(tmp_path, chat_model):
    pytest.importorskip("skyrl_gym")
    run = tmp_path / "run"
    # gsm8k_multi_turn asks again until '#### <answer>' is right or max_turns: the random
    # model is never right, and "e" ends its turns (actors.stop), so episodes take turns.
    train(run, chat_model, "task.name=word_problems", "env.name=skyrl_gym/gsm8k_multi_turn", "env.max_turns=3",
          "env.max_tokens=200", "actors.max_new_tokens=6", "actors.stop=[e]", "train.advantage=grpo_process",
          "train.max_steps=2", "learner.ranks=1", "eval.every=0")
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    assert max(s["env/turns_max"] for s in steps) >= 2 and all(s["env/policy_token_frac"] < 1 for s in steps)
    assert all(math.isfinite(s["loss/total"]) and s["reward/errors"] == 0 for s in steps)
