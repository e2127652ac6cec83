"""Whole samples as the learner trained on them, in `RUN/samples.jsonl`: every
`metrics.samples_every` steps, the first `metrics.samples_per_dump` responses of the
step's batch, one JSON object each, so that a user can check the exact tokens against
the chat template (`python analysis/show_sample.py RUN`).

Each line: `step`, `prompt_id`, `sample` (its index in the prompt's group), `actor_id`,
`version` (the group's: its oldest policy token's), `reward`, `truncated`,
`prompt_ids`, `response_ids`, `policy_mask` (1 for the policy's tokens, 0 for an
environment's: all 1 in a single-turn sample), `logprobs` (the actor's, per response
token; 0 for an environment's), `token_versions`, `step_ends` and `step_rewards` (process
rewards: offsets into the response), and `prompt_text` / `response_text` as decoded
with special tokens kept.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

SAMPLES_FILE = "samples.jsonl"


class SampleLine(msgspec.Struct):
    """What a reader needs of a samples.jsonl line (the other keys are kept as written)."""
    step: int
    prompt_id: int
    sample: int
    actor_id: int
    version: int
    reward: float
    truncated: bool
    prompt_ids: list[int]
    response_ids: list[int]
    policy_mask: list[int]
    token_versions: list[int]
    prompt_text: str


def read_samples(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(the lines of `path` that are whole samples, as dicts; one note per line that is
    not: its number and what is wrong with it)."""
    rows, damaged = [], []
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = msgspec.json.decode(raw, type=SampleLine)
            if not len(line.response_ids) == len(line.policy_mask) == len(line.token_versions):
                raise ValueError("response_ids, policy_mask and token_versions differ in length")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            damaged.append(f"line {number}: {str(err).splitlines()[0]}")
            continue
        rows.append(msgspec.structs.asdict(line))
    return rows, damaged


def sample_records(groups: Sequence[Any], prompt_format, step: int, count: int) -> list[dict[str, Any]]:
    """The first `count` responses of the batch's groups, in order, as samples.jsonl lines."""
    records: list[dict[str, Any]] = []
    for g in groups:
        prompt_ids = np.asarray(g.prompt_tokens).tolist()
        for k, r in enumerate(g.responses()):
            if len(records) == count:
                return records
            n = len(r.tokens)
            records.append({
                "step": step, "prompt_id": int(g.prompt_id), "sample": k, "actor_id": int(g.actor_id),
                "version": int(g.version), "reward": float(g.rewards[k]), "truncated": bool(g.truncated[k]),
                "prompt_ids": prompt_ids, "response_ids": r.tokens.tolist(),
                "policy_mask": (np.ones(n, np.uint8) if r.policy_mask is None else r.policy_mask).astype(int).tolist(),
                "logprobs": [round(float(x), 6) for x in r.logprobs],
                "token_versions": np.asarray(r.versions).tolist(),
                "step_ends": [] if r.step_ends is None else r.step_ends.tolist(),
                "step_rewards": [] if r.step_rewards is None else r.step_rewards.tolist(),
                "prompt_text": prompt_format.display(prompt_ids, truncated=False),
                "response_text": prompt_format.display(r.tokens.tolist(), truncated=bool(g.truncated[k])),
            })
    return records


def truncate_samples(run_dir: Path, step: int) -> None:
    """A run resumed at `step` writes the later steps' samples again: drop them."""
    import json

    path = Path(run_dir) / SAMPLES_FILE
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
        except ValueError:  # the half-written line of a killed run
            continue
    tmp = path.with_name(SAMPLES_FILE + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
