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


class JsonlConfig(_Rendering):
    name: Literal["jsonl"] = "jsonl"
    train_path: str = Field(description="Training prompts: lines with `answer` and `prompt` or `messages`.")
    eval_path: str | None = Field(None, description="Held-out prompts (null = a held-out 10% of train_path).")
    reward: str = Field(description="Reward `f(prompt, response, answer) -> float`: a built-in name, `module:function` or `path/file.py:function`.")


class ReasoningGymConfig(_Rendering):
    name: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(description="The reasoning-gym dataset, e.g. `leg_counting` (scored by its own score_answer).")
    dataset_options: dict[str, Any] = Field(default_factory=dict, description="The dataset's config fields; `size` = training pool entries (10000).")
    eval_size: int = Field(256, ge=1, description="Held-out prompts, never trained on.")


TASKS = (ArithmeticConfig, WordProblemsConfig, ToolProblemsConfig, JsonlConfig, ReasoningGymConfig)
TaskConfig = choice(*TASKS, default=ArithmeticConfig)
