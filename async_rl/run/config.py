"""The metrics section: what the run directory's logs show besides the figures."""
from __future__ import annotations

from pydantic import Field

from async_rl.config.section import Section


class MetricsConfig(Section):
    text_every: int = Field(10, ge=0, description="A few generations to TensorBoard's text tab every this many steps (0 = never).")
    samples_every: int = Field(0, ge=0, description="Whole samples (token ids, mask, log-probs, text) to RUN/samples.jsonl every this many steps (0 = never).")
    samples_per_dump: int = Field(4, ge=1, description="Samples written each time (the batch's first responses).")
    warn_after_steps: int = Field(10, ge=1, description="Warn once when a run has had nothing to learn from this many steps in a row.")
    warn_mismatch_kl: float | None = Field(0.05, gt=0.0, description="Warn when is/mismatch_kl passes this, and each time it doubles (null = never).")
