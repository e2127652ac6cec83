"""Keys that moved when choices became variants: a config that still uses one gets a
one-line error naming the new place, not a bare "unknown key"."""
from __future__ import annotations

from typing import Any

from async_rl.config.section import ConfigError

# old dotted key (or section) -> (new key, or its section + "." when every field moved along; the variant it needs)
MOVED: dict[str, tuple[str, str | None]] = {
    "train.ppo": ("train.loss.", "train.loss.name=ppo"),
    "train.opmd": ("train.loss.", "train.loss.name=opmd"),
    "train.loss.is_cap": ("train.correction.cap", "train.correction.name=token or sequence_is"),
    "train.loss.is_mode": ("train.correction.mode", "train.correction.name=token"),
    "train.critic.lr": ("train.advantage.critic_lr", "train.advantage.name=gae"),
    "train.critic.lam": ("train.advantage.lam", "train.advantage.name=gae"),
    "train.critic.value_clip": ("train.advantage.value_clip", "train.advantage.name=gae"),
    "train.critic": ("train.advantage.", "train.advantage.name=gae"),
    "train.gamma": ("train.advantage.gamma", "train.advantage.name=reinforce_pp or gae"),
    "train.lr_min_ratio": ("train.lr_schedule.min_ratio", "train.lr_schedule.name=cosine or linear"),
    "train.warmup_steps": ("train.lr_schedule.warmup_steps", None),
    "actors.vllm": ("actors.engine.", "actors.engine.name=vllm"),
    "actors.dtype": ("actors.engine.dtype", None),
}

# a key some variants have, and what another variant has in its place: {key: {variant: what instead}}
VARIANT_INSTEAD: dict[str, dict[str, str]] = {
    "task.eval_size": {
        "jsonl": "the held-out prompts are task.eval_path, else a held-out 10% of task.train_path; "
                 "eval.size caps how many are scored",
        "dataset": "the held-out prompts are task.eval_split, else a held-out task.eval_fraction of task.split; "
                   "eval.size caps how many are scored",
    },
}


def _keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        out.append(dotted)
        if isinstance(value, dict):
            out.extend(_keys(value, dotted + "."))
    return out


def refuse_moved_keys(tree: dict[str, Any]) -> None:
    """ConfigError naming the first key of `tree` (a raw config) that moved, and where to."""
    for key in _keys(tree):
        for old, (new, variant) in MOVED.items():
            if key == old or key.startswith(old + "."):
                rest = key[len(old) + 1:]
                if new.endswith(".") and not rest:
                    continue  # the section itself: its fields are named one by one
                target = new + rest if new.endswith(".") else new
                raise ConfigError(f"{key}: moved to {target}" + (f" (with {variant})" if variant else ""))
