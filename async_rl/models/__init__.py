"""Policies made by the project's own code (nothing is downloaded)."""

from async_rl.models.demo import (
    answer_statistics,
    build_demo_model,
    build_tokenizer,
    greedy_accuracy,
    greedy_responses,
    mixed_group_fraction,
)

__all__ = [
    "answer_statistics",
    "build_demo_model",
    "build_tokenizer",
    "greedy_accuracy",
    "greedy_responses",
    "mixed_group_fraction",
]
