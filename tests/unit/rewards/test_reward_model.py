"""rewards/reward_model.py: a sequence-classification model with one output as a reward
component, scored in batches in the reward's workers; each row's score is the one it
gets alone (padding changes nothing); a bad component is one line at launch."""
import pytest
import torch
from transformers import LlamaForSequenceClassification

from async_rl.config import ConfigError, build_config
from async_rl.models.demo import build_tokenizer
from async_rl.rewards.pool import Call, RewardPool
from async_rl.rewards.reward_model import RewardModel
from async_rl.run.checks import check_components

PAIRS = [("12+7=", "19"), ("3+4=", "7000"), ("55+45=", "1"), ("1+1=", "")]


def alone(path, prompt: str, response: str) -> float:
    """The model's score of one pair, unpadded, straight from transformers."""
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    tokenizer = build_tokenizer()
    ids = tokenizer(prompt + response, return_tensors="pt")
    with torch.inference_mode():
        return model(**ids).logits[0, 0].item()


def test_a_batch_scores_each_pair_as_it_scores_alone(reward_model_dir):
    model = RewardModel(reward_model_dir, batch_size=3)  # rows of several lengths, padded, across batches
    scores = model.score_batch([p for p, _ in PAIRS], [r for _, r in PAIRS])
    assert scores == pytest.approx([alone(reward_model_dir, p, r) for p, r in PAIRS], abs=1e-5)
    assert len(set(scores)) == len(PAIRS) and model("12+7=", "19", "19") == pytest.approx(scores[0], abs=1e-5)


@pytest.mark.integration  # a worker that imports transformers (7 s here): the integration tier
def test_the_reward_workers_run_it_as_a_weighted_component(reward_model_dir):
    components = [{"name": "exact", "reward": "task", "weight": 1.0},
                  {"name": "rm", "reward": "reward_model", "model": str(reward_model_dir), "weight": 0.5}]
    with RewardPool({"name": "arithmetic"}, 0, processes=1, timeout_s=60, components=components) as pool:
        outcomes = pool.score([Call(p, r, "19") for p, r in PAIRS])
    for (prompt, response), scored in zip(PAIRS, outcomes):
        assert scored.codes == [0, 0] and scored.ms[1] > 0
        assert scored.values[1] == pytest.approx(alone(reward_model_dir, prompt, response), abs=1e-5)
        assert scored.settle() == pytest.approx(float(response == "19") + 0.5 * scored.values[1])


def test_a_component_that_cannot_load_is_one_line_at_launch(tmp_path, reward_model_dir):
    with pytest.raises(ConfigError, match="needed by"):
        build_config({"reward": {"components": [{"name": "rm", "reward": "reward_model"}]}})
    missing = build_config({"reward": {"components": [{"name": "rm", "reward": "reward_model",
                                                       "model": str(tmp_path / "nowhere")}]}})
    with pytest.raises(ConfigError, match=r"reward.components \(rm\): model .* is not a model directory"):
        check_components(missing)
    unknown = build_config({"reward": {"components": [{"name": "judge", "reward": "no_such_module:judge"}]}})
    with pytest.raises(ConfigError, match=r"reward.components \(judge\)"):
        check_components(unknown)
    fine = build_config({"reward": {"components": [{"name": "rm", "reward": "reward_model",
                                                    "model": str(reward_model_dir)}]}})
    check_components(fine)
