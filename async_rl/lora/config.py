"""The model.lora section: LoRA adapters (peft) on the learner and the actors."""
from __future__ import annotations

from pydantic import Field

from async_rl.config.section import Section

LLAMA_LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    rank: int = Field(0, ge=0, le=1024, description="LoRA rank: train and sync adapters on a frozen base; 0 = full fine-tuning.")
    alpha: float = Field(32.0, gt=0.0, description="The adapters' update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input in the learner's passes (not the actors').")
    target_modules: list[str] = Field(default_factory=lambda: list(LLAMA_LINEAR_LAYERS), description="Linear layers that get adapters, by the last part of their name.")
    merged_final: bool = Field(False, description="Also write final/merged: the base with the adapter merged in.")
