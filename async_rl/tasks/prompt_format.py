"""From a task's prompts to the model's input tokens, and from response tokens back to text.

One place decides what the model sees, so that rollout, evaluation, the coordinator's
prompt-length check and the logged samples can never disagree:

- **Chat template** (`task.chat_template`): `auto` uses the tokenizer's template when it
  has one. A chat model asked a plain, un-templated question usually answers with its
  end-of-turn token at once: reward 0, gradient 0, and nothing says why. With the
  template, `messages` rows are rendered as they are, `prompt` rows as one user turn
  (after `task.system_prompt`, when set), always with the assistant's generation prompt.
- **One BOS**: a rendered template already holds whatever special tokens the model
  expects (Llama 3's templates write `{{ bos_token }}` themselves), so it is tokenized
  with `add_special_tokens=False`; plain text gets the tokenizer's special tokens, minus
  a doubled BOS when the text already starts with one.
- **Stop tokens** (`stop_token_ids`): the union of the EOS ids of the model config,
  `generation_config.json` and the tokenizer. Chat models often list their end-of-turn
  token in only one of them (Qwen2.5 and Llama 3 put it in generation_config), and a
  model that never stops spends every response at the length limit.
- **Response text**: rewards get the decoded response without special tokens; logs keep
  them and mark a response cut at the length limit, so the two cases look different. A
  reward's step ends, offsets in that text, fall on the tokens whose text reaches them.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from async_rl.tasks.base import Prompt

CUT_MARK = " [cut at the length limit]"


class PromptFormat:
    """Encodes prompts for one tokenizer and one `task.chat_template` choice."""

    def __init__(self, tokenizer: Any, chat_template: bool | Literal["auto"] = "auto",
                 system_prompt: str | None = None) -> None:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat_template is True and not has_template:
            raise ValueError("task.chat_template: true, but the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.uses_chat = has_template if chat_template == "auto" else bool(chat_template)
        self.system_prompt = system_prompt
        self.bos_id = getattr(tokenizer, "bos_token_id", None)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The conversation the chat template renders for `prompt`."""
        turns = prompt.conversation()
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def render(self, prompt: Prompt) -> str:
        """The text the model is given, special tokens included."""
        if self.uses_chat:
            return self.tokenizer.apply_chat_template(self.messages(prompt), tokenize=False,
                                                      add_generation_prompt=True)
        if prompt.messages is not None:
            raise ValueError(f"prompt {prompt.id} is a conversation (`messages`), but no chat template is used "
                             "(task.chat_template)")
        return prompt.text

    def encode(self, prompt: Prompt, text: str | None = None) -> list[int]:
        """The prompt's token ids (`text`: its render, when already made)."""
        text = self.render(prompt) if text is None else text
        ids = list(self.tokenizer(text, add_special_tokens=not self.uses_chat)["input_ids"])
        if self.bos_id is not None and ids[:2] == [self.bos_id, self.bos_id]:
            ids = ids[1:]  # the text began with BOS and the tokenizer added another
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its longest vocabulary entry (a
        byte-level token's bytes, a SentencePiece piece's characters). A text longer than
        n times this cannot fit in n tokens, which is known without tokenizing it."""
        return max(1, max(map(len, self.tokenizer.get_vocab()), default=1))

    def over_limit(self, prompt: Prompt, limit: int | None) -> str | None:
        """None when `prompt` encodes to at most `limit` tokens, else what makes it longer:
        "N tokens", or "N characters" when its text alone rules it out (a 10 MB prompt is
        never tokenized)."""
        if limit is None:
            return None
        text = self.render(prompt)
        if len(text) > limit * self.max_token_chars:
            return f"{len(text)} characters (at most {self.max_token_chars} a token)"
        tokens = len(self.encode(prompt, text))
        return f"{tokens} tokens" if tokens > limit else None

    def response_text(self, tokens: Sequence[int]) -> str:
        """What a reward function scores: the response without special tokens."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def token_ends(self, tokens: Sequence[int], char_ends: Sequence[int]) -> list[int]:
        """Where in `tokens` each character offset of their `response_text` falls: the
        first token whose text reaches it (a binary search over decoded prefixes); an
        offset at or past the text's end is the last token, special tokens included."""
        tokens = list(tokens)
        length = len(self.response_text(tokens))
        ends = []
        for end in char_ends:
            if end >= length:
                ends.append(len(tokens) - 1)
                continue
            lo, hi = 0, len(tokens) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if len(self.response_text(tokens[:mid + 1])) >= end:
                    hi = mid
                else:
                    lo = mid + 1
            ends.append(lo)
        return ends

    def display(self, tokens: Sequence[int], truncated: bool) -> str:
        """For logs and TensorBoard: special tokens kept, a cut response marked."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False) + (CUT_MARK if truncated else "")


def prompt_format_for(model_path: str, task, tokenizer: Any = None) -> PromptFormat:
    """How a run turns prompts into tokens: the model's tokenizer and the `task` section's
    rendering choices. Loads its own tokenizer unless given one (a fast tokenizer must not
    be shared between threads)."""
    from async_rl.models.loading import load_tokenizer

    return PromptFormat(tokenizer if tokenizer is not None else load_tokenizer(model_path), task.chat_template,
                        task.system_prompt)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def stop_token_ids(model_path: str | Path, tokenizer: Any = None, config: Any = None) -> list[int]:
    """Every EOS id named by the model's config, its generation_config.json and the tokenizer."""
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_path))
    ids = _ids(getattr(config, "eos_token_id", None))
    generation = Path(model_path) / "generation_config.json"
    if generation.exists():
        ids += _ids(json.loads(generation.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids += _ids(getattr(tokenizer, "eos_token_id", None))
    return sorted(set(ids))


def prompt_limit(max_prompt_tokens: int | None, config: Any, max_new_tokens: int) -> int | None:
    """Longest prompt the run admits: `task.max_prompt_tokens`, else what leaves room for
    a full response in the model's context (None when the config names no context)."""
    if max_prompt_tokens is not None:
        return max_prompt_tokens
    context = getattr(config, "max_position_embeddings", None)
    return None if context is None else max(1, int(context) - max_new_tokens)
