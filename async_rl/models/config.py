"""The model section: which policy, on which device, with which adapters."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from async_rl.config.section import Section
from async_rl.lora.config import LoraConfig


class ModelConfig(Section):
    path: str = Field("demo", description="HF causal-LM directory, or `demo` (the built-in arithmetic model, built into RUN_DIR/base_model).")
    warm_start_accuracy: float = Field(0.3, ge=0.0, le=1.0, description="`demo` only: the supervised warm start stops at this held-out accuracy.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device of the learner and the actors; `auto` = cuda when available.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
