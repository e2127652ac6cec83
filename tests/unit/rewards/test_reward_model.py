"""rewards/reward_model.py: a sequence-classification model with one output as a reward
component, scored in batches in the reward's workers; each row's score is the one it
gets alone (padding changes nothing); a bad component is one line at launch."""
import pytest
import torch
from transformers import LlamaForSequenceClassification

from async_rl.config import ConfigError, build_config
from async_rl.models.demo import build_tokenizer
from async_rl.rewards.outcome import as_outcome
from async_rl.rewards.pool import Call, RewardPool
from async_rl.rewards.reward_model import ProcessRewardModel, RewardModel
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


def prefix_score(path, text: str, chars: int) -> float:
    """The model's score of the shortest token prefix of `text` that holds `chars` characters."""
    tokenizer = build_tokenizer()
    ids = tokenizer(text, return_offsets_mapping=True)
    last = next(k for k, (_, end) in enumerate(ids["offset_mapping"]) if end >= chars)
    return alone_ids(path, ids["input_ids"][:last + 1])


def alone_ids(path, ids: list[int]) -> float:
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def test_a_process_reward_model_reads_each_step_as_if_the_response_ended_there(reward_model_dir):
    prompt, response = "12+7=", "1+1\n\n2+7\n\n19"
    prm = ProcessRewardModel(reward_model_dir)  # the demo's tokenizer: prompt + response, no template
    [steps] = prm.score_batch([prompt], [response])
    assert [end for end, _ in steps.steps] == [3, 8, 12]
    for end, score in steps.steps:  # causal attention: a step's score is its prefix's
        assert score == pytest.approx(prefix_score(reward_model_dir, prompt + response, len(prompt) + end), abs=1e-5)
    scores = [score for _, score in steps.steps]
    assert as_outcome(steps).value == pytest.approx(sum(scores))  # grpo_process trains the steps
    for aggregate, expected in (("min", min(scores)), ("last", scores[-1]), ("mean", sum(scores) / 3)):
        [value] = ProcessRewardModel(reward_model_dir, aggregate=aggregate).score_batch([prompt], [response])
        assert value == pytest.approx(expected, abs=1e-6)


@pytest.mark.integration  # a worker process that loads torch and the model: the integration tier
def test_the_reward_workers_run_a_process_reward_model_as_a_component(reward_model_dir):
    components = [{"name": "prm", "reward": "prm", "model": str(reward_model_dir), "weight": 1.0},
                  {"name": "task", "reward": "task", "weight": 0.0}]
    with RewardPool({"name": "arithmetic"}, 0, processes=1, timeout_s=30, components=components) as pool:
        [scored] = pool.score([Call("12+7=", "1+1\n\n19", "19")])
    settled = scored.settle()
    assert [end for end, _ in settled.steps] == [3, 7] and scored.steps[1] is None
    assert settled.value == pytest.approx(sum(reward for _, reward in settled.steps))
