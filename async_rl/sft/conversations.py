"""Demonstrations as token sequences, laid out exactly as the run's episodes are.

A demonstration is a conversation: a list of {"role", "content"} messages (roles
system, user, assistant, tool), one per row of a JSON lines file or a dataset
(`sft.messages_column`). It is encoded the way an actor builds an episode, so that
supervised training teaches the very tokens reinforcement learning samples and scores:

    the prompt (every message before the first assistant turn), as PromptFormat encodes it
    + each assistant turn: its content's tokens, then the stop token
    + the messages between assistant turns, as TurnFormat appends an environment's answer

Only the assistant turns are trained (their stop token included): the prompt, tool
results and the chat template's headers are context. An assistant turn that ends with
one of `actors.stop` (a tool call cut at `</calc>`) gets no stop token, as a sampled
turn that stopped there has none, and the template's closing then comes with the next
messages. Messages after the last assistant turn are dropped.

With `max_tokens` (sft.max_tokens, where a conversation is cut) no text is tokenized
past what that many tokens can hold: a 10 MB message costs a slice, not a tokenization.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rl.actor.rollout.turns import TurnFormat
from async_rl.tasks.base import Prompt
from async_rl.tasks.prompt_format import PromptFormat

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Demonstration:
    ids: list[int]
    trained: list[bool]  # per token: an assistant's token, trained on

    @property
    def trained_tokens(self) -> int:
        return sum(self.trained)


def read_rows(path: str | Path, split: str = "train",
              columns: Mapping[str, str] | None = None) -> list[tuple[str, Any]]:
    """Every row of a file, each with where it is ("FILE:LINE", "FILE (split) row K"): a
    .jsonl file read line by line (no `datasets` needed); anything else through
    `datasets` (tasks/dataset.py), which must have `columns` (each with what names it,
    for the error). ValueError in one line naming the line or the missing column."""
    path = Path(path)
    if path.suffix.lower() == ".jsonl" and path.is_file():
        rows = []
        for k, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{k}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{k}: not JSON ({err.msg})") from None
        return rows
    from async_rl.tasks.dataset import load_split

    data = load_split(path, split)
    for column, named_by in (columns or {}).items():
        if column not in data.column_names:
            raise ValueError(f"{path} ({split}): no column {column!r} ({named_by}); it has "
                             f"{', '.join(sorted(data.column_names))}")
    return [(f"{path} ({split}) row {k}", row) for k, row in enumerate(data)]


def read_conversations(path: str | Path, split: str = "train", column: str = "messages") -> list[list[dict]]:
    """Every row's conversation, checked: ValueError in one line naming the row for
    anything amiss."""
    rows = read_rows(path, split, {column: "sft.messages_column"})
    if not rows:
        raise ValueError(f"{path}: no conversations")
    return [checked(row, where, column) for where, row in rows]


def checked(row: Any, where: str, column: str) -> list[dict]:
    if not isinstance(row, Mapping) or column not in row:
        raise ValueError(f"{where}: no {column!r} (sft.messages_column: the conversation)")
    messages = row[column]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: {column!r} must be a non-empty list of {{'role', 'content'}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {column}[{k}] must be {{'role': one of {'/'.join(ROLES)}, "
                             "'content': string}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ValueError(f"{where}: no assistant turn to learn from")
    if roles[0] == "assistant":
        raise ValueError(f"{where}: the conversation starts with the assistant (the prompt comes first)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class Encoder:
    """Conversations -> Demonstrations for one model's prompt format."""

    def __init__(self, prompt_format: PromptFormat, stop_id: int, stop_strings: Sequence[str] = (),
                 max_tokens: int | None = None):
        self.prompt_format, self.turns = prompt_format, TurnFormat(prompt_format)
        self.tokenizer, self.stop_id = prompt_format.tokenizer, stop_id
        self.stop_strings = [s for s in stop_strings if s]
        self.max_tokens = max_tokens

    def _room(self, ids: list[int]) -> int | None:
        """How many characters can still matter: those that one more token than the
        conversation can still take could stand for (None: no bound)."""
        if self.max_tokens is None:
            return None
        return (max(0, self.max_tokens - len(ids)) + 1) * self.prompt_format.max_token_chars

    def encode(self, messages: list[dict]) -> Demonstration:
        first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        context = messages[:first]
        user_turns = [m for m in context if m["role"] != "system"]
        prompt = Prompt(id=0, text=user_turns[-1]["content"] if user_turns else context[-1]["content"], answer="",
                        messages=tuple((m["role"], m["content"]) for m in context))
        if not self.prompt_format.uses_chat:
            prompt = Prompt(id=0, text="".join(m["content"] for m in context), answer="")
        ids = self.prompt_format.encode(prompt, self.prompt_format.render(prompt)[:self._room([])])
        trained = [False] * len(ids)
        stop: int | None = self.stop_id
        between: list[dict] = []
        for m in messages[first:last + 1]:
            if self.max_tokens is not None and len(ids) > self.max_tokens:
                break  # cut here anyway: the rest is never tokenized
            if m["role"] != "assistant":
                between.append(m)
                continue
            if between:
                context_ids = self.turns.tokens(between, stop, max_chars=self._room(ids))
                ids += context_ids
                trained += [False] * len(context_ids)
                between = []
                if self.max_tokens is not None and len(ids) > self.max_tokens:
                    break
            reply = list(self.tokenizer(m["content"][:self._room(ids)], add_special_tokens=False)["input_ids"])
            cut = any(m["content"].endswith(s) for s in self.stop_strings)
            stop = None if cut else self.stop_id
            reply += [] if cut else [self.stop_id]
            ids += reply
            trained += [True] * len(reply)
        return Demonstration(ids, trained)


def stop_token(prompt_format: PromptFormat, candidates: Sequence[int]) -> int:
    """The token a policy turn ends with: the stop token the chat template closes an
    assistant turn with (ChatML's <|im_end|>), else the tokenizer's EOS among the
    model's stop ids (`candidates`), else the first of them."""
    tokenizer = prompt_format.tokenizer
    closing = TurnFormat(prompt_format).frame()[0]
    for token in candidates:
        text = tokenizer.decode([token], skip_special_tokens=False)
        if text and closing.startswith(text):
            return token
    if tokenizer.eos_token_id in candidates or not candidates:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token and the model names no stop token")
        return tokenizer.eos_token_id
    return candidates[0]
