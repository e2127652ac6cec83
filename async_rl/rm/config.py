"""The `rm` section: a reward model trained on preference pairs (`async-rl rm`)."""
from __future__ import annotations

from pydantic import Field

from async_rl.config.section import Section
from async_rl.learner.config import DecaySchedule, ScheduleConfig


class RMConfig(Section):
    data: str | None = Field(None, description="Preference pairs for `async-rl rm`: a JSON lines file, or a file or save_to_disk folder `datasets` reads; each row a `chosen` and a `rejected` conversation (or answer, with a `prompt`).")
    split: str = Field("train", description="The dataset split to train on (a single file is one split).")
    epochs: int = Field(1, ge=1, description="Passes over the pairs.")
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step, over all ranks.")
    lr: float = Field(1e-5, gt=0.0, description="AdamW peak learning rate (model.lora.rank > 0: of the adapters and the head).")
    lr_schedule: ScheduleConfig = Field(default_factory=DecaySchedule, description="Learning-rate schedule over the epochs' steps: `constant`, `cosine` or `linear` decay.")
    max_tokens: int = Field(2048, ge=8, description="A pair with a side longer than this is left out (counted): its last token, where the score is read, would be cut.")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of the pairs held out: their accuracy and margin are logged after each epoch.")
    margin_column: str | None = Field("margin", description="A column of per-pair margins m: the loss is -log sigmoid(r_chosen - r_rejected - m) (Llama 2); rows without it have m = 0.")
    center_coef: float = Field(0.0, ge=0.0, description="Reward centering: adds center_coef * mean((r_chosen + r_rejected)^2), keeping scores near 0 (Eisenstein et al. 2023; TRL's center_rewards_coefficient, 0.01 there).")
    out: str | None = Field(None, description="The model directory written (default RUN_DIR/model); a `reward_model` component scores with it (`model: OUT`).")
