"""The eval section: held-out evaluation rounds, which the coordinator hands out and the
actors score, one policy version per round."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_rl.config.section import Section


class EvalConfig(Section):
    every: int = Field(10, ge=0, description="Evaluate every this many steps (0 = only first and last).")
    size: int | None = Field(256, ge=1, description="Held-out prompts per round: the task's first ones (null = all).")
    batch_size: int = Field(64, ge=1, description="Held-out prompts per actor request.")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length limit (null = actors.max_new_tokens).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    pass_k: int = Field(1, ge=1, description="Samples per prompt; > 1 also logs eval/pass@k.")
    threads: int | None = Field(None, ge=1, description="An actor's torch threads while it evaluates (null = actors.threads).")
    final_dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(default_factory=list, description="Score final/ again when the run ends, with the torch engine in each of these dtypes (e.g. [float32]): one line, also in final/README.md.")

    @model_validator(mode="after")
    def _k_samples_differ(self) -> EvalConfig:
        if self.pass_k > 1 and self.temperature == 0.0:
            raise ValueError("eval.pass_k: greedy decoding gives k identical samples; set eval.temperature > 0")
        return self
