"""The learning-rate schedule against hand-computed values."""
import pytest

from async_rl.config import build_config
from async_rl.learner.optimizer import lr_factor


@pytest.mark.parametrize("schedule, step, want", [
    ("cosine", 0, 0.5), ("cosine", 1, 1.0),  # warmup: (step + 1) / 2
    ("cosine", 2, 1.0), ("cosine", 4, 0.1 + 0.9 * 0.5 * (1 + 0.8090169943749475)), ("cosine", 7, 0.55),
    ("cosine", 12, 0.1), ("cosine", 20, 0.1),  # progress = (step - 2) / 10, capped at 1
    ("linear", 4, 0.1 + 0.9 * 0.8), ("linear", 12, 0.1), ("constant", 9, 1.0),
])
def test_warmup_then_decay_to_the_floor(schedule, step, want):
    train = build_config({"train": {"lr_schedule": {"name": schedule, "warmup_steps": 2,
                                                    **({} if schedule == "constant" else {"min_ratio": 0.1})},
                                    "max_steps": 12}}).train
    assert lr_factor(train.lr_schedule, train.max_steps, step) == pytest.approx(want, abs=1e-12)
