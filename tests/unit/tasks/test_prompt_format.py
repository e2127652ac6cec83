"""Prompt formatting: chat templates, one BOS, stop ids from every source, response text."""
import json

import pytest
from conftest import CountingTokenizer, build_chat_tokenizer

from async_rl.tasks import Prompt
from async_rl.tasks.prompt_format import CUT_MARK, PromptFormat, prompt_limit, stop_token_ids

QUESTION = "What is 7 + 5? Answer with just the number."


def test_a_string_prompt_becomes_one_user_turn_with_the_generation_prompt():
    fmt = PromptFormat(build_chat_tokenizer(), "auto")
    assert fmt.uses_chat
    text = fmt.render(Prompt(0, QUESTION, "12"))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n" + QUESTION
                    + "<|im_end|>\n<|im_start|>assistant\n")
    ids = fmt.encode(Prompt(0, QUESTION, "12"))
    assert fmt.tokenizer.decode(ids) == text


def test_messages_are_rendered_as_given_and_a_system_prompt_only_fills_in():
    turns = (("system", "You add."), ("user", "1 + 1?"), ("assistant", "2"), ("user", QUESTION))
    fmt = PromptFormat(build_chat_tokenizer(), True, system_prompt="Be terse.")
    text = fmt.render(Prompt(0, QUESTION, "12", messages=turns))
    assert text.startswith("<|im_start|>system\nYou add.<|im_end|>") and "Be terse." not in text
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    plain = fmt.render(Prompt(0, QUESTION, "12"))  # no system turn of its own: ours replaces the template's
    assert plain.startswith("<|im_start|>system\nBe terse.<|im_end|>") and "Be brief." not in plain


def test_one_bos_whether_the_template_or_the_tokenizer_adds_it():
    # The template writes BOS itself (as Llama 3's do) and the tokenizer also adds one.
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = build_chat_tokenizer(template=template, add_bos=True)
    bos = tok.bos_token_id
    assert tok("x")["input_ids"][0] == bos  # the tokenizer does add BOS to plain text
    chat = PromptFormat(tok, "auto").encode(Prompt(0, "hi", "x"))
    assert chat[0] == bos and chat[1] != bos
    plain = PromptFormat(tok, False)
    assert plain.encode(Prompt(0, "hi", "x"))[:2] == [bos, *tok("hi", add_special_tokens=False)["input_ids"][:1]]
    # A plain prompt that already starts with the BOS text gets no second one.
    assert plain.encode(Prompt(0, "<|im_start|>hi", "x")).count(bos) == 1


def test_template_choices_and_their_errors():
    no_template = build_chat_tokenizer(template=None)
    assert not PromptFormat(no_template, "auto").uses_chat
    assert PromptFormat(no_template, "auto").render(Prompt(0, QUESTION, "12")) == QUESTION
    with pytest.raises(ValueError, match="task.chat_template: true, but the tokenizer has no chat template"):
        PromptFormat(no_template, True)
    off = PromptFormat(build_chat_tokenizer(), False)
    assert not off.uses_chat and off.render(Prompt(0, QUESTION, "12")) == QUESTION
    with pytest.raises(ValueError, match="is a conversation"):
        off.encode(Prompt(3, QUESTION, "12", messages=(("user", QUESTION),)))


def test_response_text_drops_special_tokens_and_display_marks_a_cut():
    fmt = PromptFormat(build_chat_tokenizer(), "auto")
    tok = fmt.tokenizer
    ended = tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert fmt.response_text(ended) == "12"
    assert fmt.display(ended, truncated=False) == "12<|im_end|>"
    cut = tok("The answer is", add_special_tokens=False)["input_ids"]
    assert fmt.display(cut, truncated=True) == "The answer is" + CUT_MARK


def test_stop_ids_are_the_union_of_config_generation_config_and_tokenizer(tmp_path, chat_model):
    # chat_model: config eos 2, generation_config [2, 0]; a tokenizer whose EOS is 1 adds 1.
    tok = build_chat_tokenizer()
    tok.eos_token = "<|im_start|>"
    assert stop_token_ids(chat_model, tok) == [0, 1, 2]
    assert stop_token_ids(chat_model) == [0, 2]
    (tmp_path / "config.json").write_text((chat_model / "config.json").read_text())
    assert stop_token_ids(tmp_path) == [2]  # no generation_config.json: the config's alone
    cfg = json.loads((chat_model / "config.json").read_text())
    cfg["eos_token_id"] = [2, 7]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert stop_token_ids(tmp_path) == [2, 7]


def test_prompt_limit_leaves_room_for_a_response():
    class Config:
        max_position_embeddings = 2048

    assert prompt_limit(None, Config(), 512) == 1536
    assert prompt_limit(100, Config(), 512) == 100
    assert prompt_limit(None, object(), 512) is None


def test_a_prompt_too_long_by_its_characters_is_never_tokenized():
    fmt = PromptFormat(CountingTokenizer(build_chat_tokenizer()), "auto")
    longest = fmt.max_token_chars
    assert longest == max(len(token) for token in fmt.tokenizer.get_vocab())
    limit = 64
    huge = Prompt(0, "7 + 5? " * 2_000_000, "12")  # 14 MB
    assert fmt.over_limit(huge, limit) == f"{len(fmt.render(huge))} characters (at most {longest} a token)"
    assert fmt.tokenizer.chars == 0
    short = Prompt(1, QUESTION, "12")
    assert fmt.over_limit(short, limit) is None and fmt.tokenizer.chars == len(fmt.render(short))
    tokens = len(fmt.encode(short))
    assert fmt.over_limit(short, tokens) is None and fmt.over_limit(short, tokens - 1) == f"{tokens} tokens"
    assert fmt.over_limit(huge, None) is None


def test_the_character_bound_never_skips_a_prompt_that_fits():
    """Any text of at most limit tokens is at most limit x max_token_chars characters."""
    fmt = PromptFormat(build_chat_tokenizer(), False)
    for text in ["a" * 500, " " * 300, "\n\n".join(["x"] * 100), "é" * 200, QUESTION * 20]:
        prompt = Prompt(0, text, "")
        tokens = len(fmt.encode(prompt))
        assert fmt.over_limit(prompt, tokens) is None and len(fmt.render(prompt)) <= tokens * fmt.max_token_chars
