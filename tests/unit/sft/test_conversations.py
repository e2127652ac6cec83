"""Demonstrations as tokens: laid out as the chat template renders the whole
conversation (the episode layout, never re-tokenized), only the assistant's turns
trained, tool calls cut at a stop string without a stop token, bad rows one line."""
import json

import pytest
from conftest import CountingTokenizer, build_chat_tokenizer

from async_rl.models.demo import build_tokenizer
from async_rl.sft.conversations import Encoder, read_conversations, stop_token
from async_rl.tasks.prompt_format import PromptFormat

IM_END = 2  # build_chat_tokenizer: <|im_end|>

TOOL_TALK = [
    {"role": "system", "content": "Look prices up."},
    {"role": "user", "content": "What do 3 apples cost?"},
    {"role": "assistant", "content": "<price>apple</price>"},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "They cost 12."},
    {"role": "user", "content": "Thanks."},  # after the last assistant turn: dropped
]


@pytest.fixture(scope="module")
def chat():
    tokenizer = build_chat_tokenizer()
    return tokenizer, PromptFormat(tokenizer, "auto")


def rendered(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, tokenize=False)


def test_a_conversation_is_the_templates_rendering_and_only_the_assistant_is_trained(chat):
    tokenizer, fmt = chat
    demo = Encoder(fmt, IM_END).encode(TOOL_TALK)
    text = tokenizer.decode(demo.ids, skip_special_tokens=False)
    # ChatML closes each turn with "<|im_end|>\n"; the episode ends at the stop token.
    assert text == rendered(tokenizer, TOOL_TALK[:5]).removesuffix("\n")
    trained = tokenizer.decode([t for t, on in zip(demo.ids, demo.trained) if on], skip_special_tokens=False)
    assert trained == "<price>apple</price><|im_end|>They cost 12.<|im_end|>"
    assert demo.trained_tokens == sum(demo.trained) and not demo.trained[0]


def test_a_turn_cut_at_a_stop_string_has_no_stop_token_and_its_closing_is_context(chat):
    tokenizer, fmt = chat
    demo = Encoder(fmt, IM_END, stop_strings=["</price>"]).encode(TOOL_TALK)
    whole = rendered(tokenizer, TOOL_TALK[:5]).removesuffix("\n")
    assert tokenizer.decode(demo.ids, skip_special_tokens=False) == whole
    trained = tokenizer.decode([t for t, on in zip(demo.ids, demo.trained) if on], skip_special_tokens=False)
    assert trained == "<price>apple</price>They cost 12.<|im_end|>"
    end_of_call = demo.ids.index(IM_END, demo.trained.index(True))
    assert not demo.trained[end_of_call]  # as a sampled turn stopped at </price>: the template's closing


def test_the_system_prompt_of_the_task_comes_first_as_in_the_run(chat):
    tokenizer, _ = chat
    fmt = PromptFormat(tokenizer, "auto", system_prompt="Be exact.")
    demo = Encoder(fmt, IM_END).encode(TOOL_TALK[1:3])
    assert tokenizer.decode(demo.ids, skip_special_tokens=False).startswith("<|im_start|>system\nBe exact.<|im_end|>")


def test_the_stop_token_is_the_one_that_closes_the_assistants_turn(chat):
    tokenizer, fmt = chat
    assert stop_token(fmt, [0, 2]) == IM_END  # generation_config may list <|endoftext|> first
    plain = build_tokenizer()  # the demo model's: no chat template, <eos>
    assert stop_token(PromptFormat(plain, "auto"), [plain.eos_token_id]) == plain.eos_token_id


def test_without_a_chat_template_the_prompt_is_the_text_and_the_reply_ends_with_eos():
    plain = build_tokenizer()
    fmt = PromptFormat(plain, "auto")
    demo = Encoder(fmt, plain.eos_token_id).encode([{"role": "user", "content": "3+4="},
                                                     {"role": "assistant", "content": "7"}])
    assert plain.decode(demo.ids, skip_special_tokens=False) == "<bos>3+4=7<eos>"
    assert demo.trained == [False] * 5 + [True, True]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(("row", "says"), [
    ('{"messages": [', "not JSON"),
    ({"prompt": "hi"}, "no 'messages'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "one of system/user/assistant/tool"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]}, "starts with"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, says):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "demos.jsonl", [good, row])
    with pytest.raises(ValueError, match=says) as err:
        read_conversations(path)
    assert str(err.value).startswith(f"{path}:2") and "\n" not in str(err.value)


def test_a_dataset_file_is_read_through_datasets_with_its_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    datasets.Dataset.from_list([{"chat": talk, "source": "x"}] * 3).to_parquet(str(tmp_path / "d.parquet"))
    assert read_conversations(tmp_path / "d.parquet", column="chat") == [talk] * 3
    with pytest.raises(ValueError, match=r"no column 'messages' .*it has chat, source"):
        read_conversations(tmp_path / "d.parquet")



@pytest.mark.parametrize("huge", [2, 3, 4])  # the huge message: the first reply, the tool's answer, the last reply
def test_a_huge_message_is_sliced_to_what_max_tokens_can_hold_and_the_cut_is_the_same(chat, huge):
    tokenizer, _ = chat
    talk = [dict(m) for m in TOOL_TALK[:5]]
    talk[huge]["content"] = "4 apples, " * 20_000  # 200 KB
    counting = CountingTokenizer(tokenizer)
    fmt = PromptFormat(counting, "auto")
    max_tokens = 40
    bounded = Encoder(fmt, IM_END, max_tokens=max_tokens).encode(talk)
    assert counting.chars < 10 * max_tokens * fmt.max_token_chars < 200_000  # a slice of it
    assert len(bounded.ids) > max_tokens  # still counted as cut
    whole = Encoder(PromptFormat(tokenizer, "auto"), IM_END).encode(talk)
    assert bounded.ids[:max_tokens] == whole.ids[:max_tokens]
    assert bounded.trained[:max_tokens] == whole.trained[:max_tokens]


def test_a_bound_that_is_not_reached_changes_nothing(chat):
    tokenizer, fmt = chat
    whole = Encoder(fmt, IM_END).encode(TOOL_TALK)
    assert Encoder(fmt, IM_END, max_tokens=len(whole.ids)).encode(TOOL_TALK) == whole
