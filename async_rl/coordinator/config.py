"""The eval section: held-out evaluation rounds, one policy version per round, scored by
an evaluator process of the learner's own (evaluator/) or handed out to the actors by
the coordinator (coordinator/eval_rounds.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_rl.config.section import Section


class EvalConfig(Section):
    placement: Literal["evaluator", "actors"] = Field("evaluator", description="Who scores the rounds: an evaluator process beside the learner, on saved versions (no sync or step waits), or the actors.")
    every: int = Field(10, ge=0, description="Evaluate every this many steps (0 = only first and last).")
    size: int | None = Field(256, ge=1, description="Held-out prompts per round: the task's first ones (null = all).")
    batch_size: int = Field(64, ge=1, description="Held-out prompts per chunk (an actor's request, or the evaluator's generate call).")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length limit (null = actors.max_new_tokens).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    pass_k: int = Field(1, ge=1, description="Samples per prompt; > 1 also logs eval/pass@k.")
    threads: int | None = Field(None, ge=1, description="Torch threads of the evaluator, or of an actor while it evaluates (null = actors.threads).")
    nice: int = Field(0, ge=0, le=19, description="The evaluator's niceness (and its autogroup's): > 0 gives training the CPU first, its lines then come later, each at its version's time.")
    also_dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(default_factory=list, description="The evaluator also scores each round with the torch engine in these dtypes, from the master weights: eval/accuracy@<dtype>.")
    final_dtypes: list[Literal["float32", "bfloat16", "float16"]] = Field(default_factory=list, description="Score final/ again when the run ends, with the torch engine in each of these dtypes (e.g. [float32]): one line, also in final/README.md.")

    @model_validator(mode="after")
    def _also_dtypes_need_the_evaluator(self) -> EvalConfig:
        if self.also_dtypes and self.placement != "evaluator":
            raise ValueError("eval.also_dtypes: only the evaluator scores a round twice; set eval.placement=evaluator")
        return self

    @model_validator(mode="after")
    def _k_samples_differ(self) -> EvalConfig:
        if self.pass_k > 1 and self.temperature == 0.0:
            raise ValueError("eval.pass_k: greedy decoding gives k identical samples; set eval.temperature > 0")
        return self
