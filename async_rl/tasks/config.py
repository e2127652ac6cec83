"""The task section: where prompts come from and how responses are scored. One variant
per task (`task.name`), each with its own fields; how prompts are rendered is common."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from async_rl.config.section import Section, choice

REWARD = ("Reward `f(prompt, response, answer) -> float`: a built-in name, `module:function` or `path/file.py:function`; "
          "null = the task's own.")


class _Rendering(Section):
    chat_template: bool | Literal["auto"] = Field("auto", description="Render prompts with the tokenizer's chat template: `auto` = when it has one.")
    system_prompt: str | None = Field(None, description="With a chat template: a system turn before prompts that have none.")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longer prompts are skipped and counted; null = context length minus actors.max_new_tokens.")


class ArithmeticConfig(_Rendering):
    name: Literal["arithmetic"] = "arithmetic"
    digits: int = Field(2, ge=1, le=6, description="Digits per operand of `a+b=`.")
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")
    reward: str | None = Field(None, description=REWARD)


class WordProblemsConfig(_Rendering):
    name: Literal["word_problems"] = "word_problems"
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")
    reward: str | None = Field(None, description=REWARD)


class ToolProblemsConfig(_Rendering):
    name: Literal["tool_problems"] = "tool_problems"
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")
    reward: str | None = Field(None, description=REWARD)


class CodingConfig(_Rendering):
    name: Literal["coding"] = "coding"
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")
    eval_families: Literal["held_out", "trained"] = Field("held_out", description="Held-out prompts from the 4 families never trained on, or new prompts of the trained families.")
    reward: str | None = Field(None, description=REWARD)


ROW_REWARD = ("Reward `f(prompt, response, answer, ...)` (and the row's columns it names): a built-in, "
              "`module:function` or `file.py:function`; null = env.name scores.")


class JsonlConfig(_Rendering):
    name: Literal["jsonl"] = "jsonl"
    train_path: str = Field(description="Training prompts: lines with `answer` and `prompt` or `messages`; other keys are the prompt's fields.")
    eval_path: str | None = Field(None, description="Held-out prompts (null = a held-out 10% of train_path).")
    reward: str | None = Field(None, description=ROW_REWARD)


class DatasetConfig(_Rendering):
    name: Literal["dataset"] = "dataset"
    path: str = Field(description="A Hugging Face dataset: a parquet, arrow, csv or jsonl file, or a save_to_disk folder.")
    split: str = Field("train", description="The split to train on (a file is one split, `train`).")
    prompt_column: str = Field("prompt", description="The prompt: a string, or a chat (a list of role/content messages).")
    answer_column: str = Field("answer", description="The answer the reward compares with (may be absent when the environment scores).")
    eval_split: str | None = Field(None, description="Held-out prompts from this split (null = a held-out eval_fraction of `split`).")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held out when there is no eval_split, the same rows for every seed.")
    reward: str | None = Field(None, description=ROW_REWARD)


class ReasoningGymConfig(_Rendering):
    name: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(description="The reasoning-gym dataset, e.g. `leg_counting` (scored by its own score_answer).")
    dataset_options: dict[str, Any] = Field(default_factory=dict, description="The dataset's config fields; `size` = training pool entries (10000).")
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")


TASKS = (ArithmeticConfig, WordProblemsConfig, ToolProblemsConfig, CodingConfig, JsonlConfig, DatasetConfig,
         ReasoningGymConfig)
TaskConfig = choice(*TASKS, default=ArithmeticConfig)
