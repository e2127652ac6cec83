"""The `sft` section: supervised training on demonstrations (`async-rl sft`)."""
from __future__ import annotations

from pydantic import Field

from async_rl.config.section import Section
from async_rl.learner.config import DecaySchedule, ScheduleConfig


class SFTConfig(Section):
    data: str | None = Field(None, description="Demonstrations for `async-rl sft`: a JSON lines file, or a file or save_to_disk folder `datasets` reads (parquet, arrow, csv), one conversation per row.")
    split: str = Field("train", description="The dataset split to train on (a single file is one split).")
    messages_column: str = Field("messages", description="The column (or JSONL key) holding each conversation: a list of {role, content} messages.")
    epochs: int = Field(2, ge=1, description="Passes over the demonstrations.")
    batch_size: int = Field(16, ge=1, description="Conversations per optimizer step, over all ranks.")
    lr: float = Field(5e-5, gt=0.0, description="AdamW peak learning rate (model.lora.rank > 0: of the adapters).")
    lr_schedule: ScheduleConfig = Field(default_factory=DecaySchedule, description="Learning-rate schedule over the epochs' steps: `constant`, `cosine` or `linear` decay.")
    max_tokens: int = Field(2048, ge=8, description="A longer conversation is cut here (its later tokens are not trained).")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of the conversations held out: their loss is printed after each epoch.")
    out: str | None = Field(None, description="The model directory written (default RUN_DIR/model); `async-rl train ... model.path=OUT` starts from it.")
