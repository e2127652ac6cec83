"""rm/pairs.py: preference pairs with an explicit prompt or as whole conversations, a
margin column, one-line errors naming the row; each side rendered exactly as the
reward_model component renders (prompt, response) when it scores."""
import json

import pytest
from conftest import build_chat_tokenizer

from async_rl.rm.pairs import read_pairs, render, split_pairs


def write(tmp_path, rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_explicit_prompts_and_whole_conversations_read_alike(tmp_path):
    conversation = [{"role": "user", "content": "2+2="}]
    rows = read_pairs(write(tmp_path, [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 1.5},
        {"chosen": conversation + [{"role": "assistant", "content": "4"}],
         "rejected": conversation + [{"role": "assistant", "content": "5"}]},
        {"prompt": conversation, "chosen": "4", "rejected": "5", "margin": None}]))
    assert rows[0]["chosen"] == rows[1]["chosen"] == rows[2]["chosen"] == conversation + [
        {"role": "assistant", "content": "4"}]
    assert [r["margin"] for r in rows] == [1.5, 0.0, 0.0]


@pytest.mark.parametrize("row, says", [
    ({"prompt": "q", "chosen": "a"}, ":2: a pair needs a 'chosen' and a 'rejected' side"),
    ({"prompt": "q", "chosen": "a", "rejected": 3}, ":2: 'rejected' must be a string or a non-empty list"),
    ({"prompt": "q", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"}, ":2: chosen[0] must be"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": "b"}, ":2: 'chosen' must end with the assistant"),
    ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, ":2: 'chosen' has no prompt"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, ":2: 'margin' must be a finite number"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": float("inf")}, ":2: 'margin' must be a finite"),
    ("{not json", ":2: not JSON"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, says):
    path = write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(ValueError, match=f"^{path}{says}".replace("[", r"\[").replace("(", r"\(")):
        read_pairs(path)


def test_a_side_is_rendered_as_the_reward_model_component_reads_it(reward_model_dir):
    from async_rl.rewards.reward_model import RewardModel

    scorer = RewardModel(reward_model_dir)
    messages = [{"role": "user", "content": "7+5="}, {"role": "assistant", "content": "12"}]
    read = scorer.tokenizer(scorer.text("7+5=", "12"), add_special_tokens=not scorer.templated)["input_ids"]
    assert render(scorer.tokenizer, messages) == list(read)  # the demo tokenizer: no template
    chat = build_chat_tokenizer()
    templated = chat.apply_chat_template(messages, tokenize=False)
    assert render(chat, messages) == chat(templated, add_special_tokens=False)["input_ids"]
    assert templated.endswith("<|im_start|>user\n7+5=<|im_end|>\n<|im_start|>assistant\n12<|im_end|>\n")


def test_pairs_over_the_limit_are_left_out_and_counted_and_one_is_held_out(tmp_path):
    tok = build_chat_tokenizer()
    rows = read_pairs(write(tmp_path, [{"prompt": "q", "chosen": "a" * k, "rejected": "b"} for k in (1, 2, 400)]))
    split = split_pairs(rows, tok, max_tokens=64, eval_fraction=0.1, seed=0)
    assert split.too_long == 1 and len(split.train) == 1 and len(split.held_out) == 1
    with pytest.raises(ValueError, match="longer than rm.max_tokens=2"):
        split_pairs(rows, tok, max_tokens=2, eval_fraction=0.0, seed=0)
