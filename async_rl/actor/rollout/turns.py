"""The tokens an environment's answer adds to an episode, built by appending.

An episode's token sequence is the prompt, then the policy's turns as sampled, each
followed by the environment's messages. Re-tokenizing the whole conversation after
every turn could merge or split tokens differently from what the policy sampled, and
the learner would then score other tokens than those whose log-probs the actor
recorded. So the earlier tokens are never touched: after a policy turn, only the text
the chat template puts between that turn and the next assistant turn is tokenized,
and appended:

    what closes the assistant's turn, less the stop token the policy sampled
    + the environment's messages, as the template renders them
    + the header of the next assistant turn (the generation prompt)

That text is the difference between the template's rendering of a probe conversation
with and without the messages, so any template that appends turns (ChatML, Llama 3,
...) works; one that rewrites earlier turns when a turn is added is refused.
Without a chat template, each message's content and a newline are appended.
"""
from __future__ import annotations

from collections.abc import Sequence

from async_rl.tasks.prompt_format import PromptFormat

# Real text averages 3-5 characters per token; an environment's answer of more than this
# many characters per token its episode can still take is taken as too long to fit,
# without tokenizing it (episodes.Environments.answer_tokens).
MAX_CHARS_PER_TOKEN = 16

# A conversation to render around: its assistant reply marks where the turn's closing starts.
_PROBE_REPLY = "async-rl probe reply 7f3a"
_PROBE = [{"role": "user", "content": "async-rl probe question"}, {"role": "assistant", "content": _PROBE_REPLY}]


class TurnFormat:
    def __init__(self, prompt_format: PromptFormat) -> None:
        self.tokenizer = prompt_format.tokenizer
        self.uses_chat = prompt_format.uses_chat
        self._closing = ""
        if self.uses_chat:
            self._base = self._render(_PROBE, generation_prompt=False)
            if _PROBE_REPLY not in self._base:
                raise ValueError("task.chat_template: the chat template leaves out the assistant's reply, so an "
                                 "episode's turns cannot be appended")
            self._closing = self._base[self._base.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def text(self, messages: Sequence[dict[str, str]], stop_text: str = "") -> str:
        """What follows a policy turn that ended with `stop_text` (the decoded stop token
        it sampled; "" if none): the rest of the turn's closing, `messages`, and the
        next assistant turn's header."""
        if not self.uses_chat:
            return "".join(f"{m['content']}\n" for m in messages)
        full = self._render([*_PROBE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("task.chat_template: the chat template rewrites earlier turns when a turn is added, so an "
                             "episode's tokens cannot be appended")
        closing = self._closing[len(stop_text):] if stop_text and self._closing.startswith(stop_text) else self._closing
        return closing + full[len(self._base):]

    def frame(self, stop_text: str = "") -> tuple[str, str]:
        """(what begins, what ends) every `text` after a turn that ended with `stop_text`:
        the rest of the turn's closing, and the next assistant turn's header."""
        bare = self.text([], stop_text)
        closing = self._closing[len(stop_text):] if stop_text and self._closing.startswith(stop_text) else \
            self._closing
        return closing, bare[len(closing):]

    def tokens(self, messages: Sequence[dict[str, str]], stop_token: int | None,
               max_chars: int | None = None) -> list[int]:
        """`text` as token ids (the template's special tokens as such, no BOS added); with
        `max_chars`, of its first that many characters only."""
        stop_text = "" if stop_token is None else self.tokenizer.decode([stop_token], skip_special_tokens=False)
        return list(self.tokenizer(self.text(messages, stop_text)[:max_chars], add_special_tokens=False)["input_ids"])
