"""models/critic.py: the GAE critic starts from the policy's trunk with a zero head, or
from a reward model (train.advantage.critic_init), its trunk and score head: its value
after the last token is the reward model's score; a directory it cannot start from is
one line before the run."""
import pytest
import torch

from async_rl.config import ConfigError, build_config
from async_rl.models.critic import ValueModel
from async_rl.run.checks import check_critic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_critic_from_a_reward_model_values_the_last_token_as_it_scores(demo_model, reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    ids = torch.tensor([[5, 9, 14, 7, 11, 3]])
    mask = torch.ones_like(ids)
    fresh = ValueModel(str(demo_model))
    assert torch.count_nonzero(fresh(ids, mask)) == 0  # the zero head: the first values are 0
    critic = ValueModel(str(demo_model), reward_model=str(reward_model_dir))
    rm = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        values, score = critic(ids, mask), rm(input_ids=ids, attention_mask=mask).logits[0, 0]
    torch.testing.assert_close(values[0, -1], score, rtol=1e-5, atol=1e-6)
    for name, tensor in critic.trunk.state_dict().items():  # the reward model's trunk, not the policy's
        torch.testing.assert_close(tensor, rm.model.state_dict()[name], rtol=0, atol=0)


def test_a_critic_init_that_cannot_start_the_critic_is_one_line(demo_model, reward_model_dir, chat_model, tmp_path):
    def cfg(path):
        return build_config({"model": {"path": str(demo_model)},
                             "train": {"advantage": {"name": "gae", "critic_init": str(path)}}})

    check_critic(cfg(reward_model_dir))  # the demo's vocabulary: fine
    with pytest.raises(ConfigError, match="is not a model directory"):
        check_critic(cfg(tmp_path))
    with pytest.raises(ConfigError, match="no score head"):
        check_critic(cfg(demo_model))  # a causal LM: no reward head
    with pytest.raises(ConfigError, match="another vocabulary"):
        check_critic(cfg(chat_rm(chat_model, tmp_path)))


def chat_rm(chat_model, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "chat_rm"
    AutoModelForSequenceClassification.from_pretrained(chat_model, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(chat_model).save_pretrained(out)
    return out
