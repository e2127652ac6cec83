"""rollout/turns.py: the tokens an environment's answer adds equal what the chat template
renders for the whole conversation, and earlier tokens are never re-tokenized."""
import pytest
from conftest import build_chat_tokenizer

from async_rl.actor.rollout.turns import TurnFormat
from async_rl.tasks.base import Prompt
from async_rl.tasks.prompt_format import PromptFormat

OBSERVATION = [{"role": "user", "content": "The tool says 12."}]


def test_appending_a_turn_gives_the_templates_rendering_of_the_whole_conversation():
    tok = build_chat_tokenizer()
    pf = PromptFormat(tok)
    prompt = Prompt(id=0, text="What is 7 + 5?", answer="12")
    reply = tok("The answer is 12.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled
    appended = pf.encode(prompt) + reply + TurnFormat(pf).tokens(OBSERVATION, stop_token=tok.eos_token_id)
    whole = tok.apply_chat_template(
        [*pf.messages(prompt), {"role": "assistant", "content": "The answer is 12."}, *OBSERVATION],
        tokenize=False, add_generation_prompt=True)
    assert appended == tok(whole, add_special_tokens=False)["input_ids"]
    assert tok.decode(appended[len(pf.encode(prompt)) + len(reply):]) == (
        "\n<|im_start|>user\nThe tool says 12.<|im_end|>\n<|im_start|>assistant\n")


def test_a_turn_cut_before_its_stop_token_gets_the_whole_closing():
    pf = PromptFormat(build_chat_tokenizer())
    assert TurnFormat(pf).text(OBSERVATION).startswith("<|im_end|>\n<|im_start|>user\n")


def test_without_a_chat_template_the_contents_are_appended_line_by_line():
    pf = PromptFormat(build_chat_tokenizer(template=None))
    turns = [{"role": "tool", "content": "12"}, {"role": "user", "content": "go on"}]
    assert TurnFormat(pf).text(turns) == "12\ngo on\n"


def test_templates_that_drop_or_rewrite_turns_are_refused():
    drops = "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="leaves out the assistant's reply"):
        TurnFormat(PromptFormat(build_chat_tokenizer(template=drops)))
    # Renders only the last two turns: adding one rewrites what came before.
    window = "{% for m in messages[-2:] %}{{ m['role'] + ':' + m['content'] + '|' }}{% endfor %}"
    fmt = TurnFormat(PromptFormat(build_chat_tokenizer(template=window)))
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        fmt.text(OBSERVATION)
