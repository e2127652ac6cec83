"""Preference pairs as token sequences, written as a `reward_model` component reads them.

A row holds a `chosen` and a `rejected` side, each a conversation (a list of {"role",
"content"} messages ending with the assistant's answer) or an answer alone with the
row's `prompt` (a string: one user turn; or a conversation) before it, as TRL's
preference datasets do (explicit or implicit prompt). An optional margin column gives
how much the chosen side should win by. Each side is rendered by the reward model's
tokenizer: with its chat template when it has one (the whole conversation, no
generation prompt), else as the contents one after the other with the tokenizer's
special tokens: exactly how rewards/reward_model.py renders (prompt, response) when it
scores, so the model is trained on the text it will read.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.sft.conversations import ROLES, read_rows

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0


@dataclass
class PairSplit:
    train: list[Pair]
    held_out: list[Pair]
    too_long: int  # pairs with a side over rm.max_tokens, left out


def read_pairs(path: str | Path, split: str = "train", margin_column: str | None = "margin") -> list[dict]:
    """Every row as {"chosen": messages, "rejected": messages, "margin": float}, checked:
    ValueError in one line naming the row for anything amiss."""
    rows = read_rows(path, split, {side: "a pair's side" for side in SIDES})
    if not rows:
        raise ValueError(f"{path}: no preference pairs")
    return [checked_pair(row, where, margin_column) for where, row in rows]


def checked_pair(row: Any, where: str, margin_column: str | None) -> dict:
    if not isinstance(row, Mapping) or any(side not in row for side in SIDES):
        raise ValueError(f"{where}: a pair needs a 'chosen' and a 'rejected' side")
    prompt = _messages(row["prompt"], where, "prompt", "user") if row.get("prompt") is not None else []
    pair = {}
    for side in SIDES:
        messages = prompt + _messages(row[side], where, side, "assistant")
        if messages[-1]["role"] != "assistant":
            raise ValueError(f"{where}: {side!r} must end with the assistant's answer")
        if len(messages) < 2 and prompt == [] and isinstance(row[side], list):
            raise ValueError(f"{where}: {side!r} has no prompt before the answer (give a 'prompt')")
        pair[side] = messages
    margin = row.get(margin_column) if margin_column else None
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, numbers.Real)
                               or not math.isfinite(margin)):
        raise ValueError(f"{where}: {margin_column!r} must be a finite number, got {margin!r:.40}")
    pair["margin"] = float(margin or 0.0)
    return pair


def _messages(value: Any, where: str, key: str, role: str) -> list[dict]:
    """A side or a prompt as messages: a string is one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key!r} must be a string or a non-empty list of {{'role', 'content'}} objects")
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: {key}[{k}] must be {{'role': one of {'/'.join(ROLES)}, 'content': string}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """One side's tokens as the reward model reads them (rewards/reward_model.py)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("".join(m["content"] for m in messages))["input_ids"])


def split_pairs(rows: list[dict], tokenizer, max_tokens: int, eval_fraction: float, seed: int) -> PairSplit:
    """Encode, leave out the pairs with a side over `max_tokens`, hold out a seeded
    `eval_fraction` (at least one pair when the fraction is positive)."""
    pairs = [Pair(render(tokenizer, r["chosen"]), render(tokenizer, r["rejected"]), r["margin"]) for r in rows]
    kept = [p for p in pairs if max(len(p.chosen), len(p.rejected)) <= max_tokens]
    if not kept:
        raise ValueError(f"every pair has a side longer than rm.max_tokens={max_tokens}")
    order = np.random.default_rng(seed).permutation(len(kept))
    held = min(len(kept) - 1, math.ceil(eval_fraction * len(kept))) if eval_fraction > 0 else 0
    return PairSplit([kept[i] for i in order[held:]], [kept[i] for i in order[:held]], len(pairs) - len(kept))
