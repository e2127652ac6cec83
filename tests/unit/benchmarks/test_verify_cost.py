"""benchmarks/verify_cost.py's summary against hand-computed shares."""
import pytest
from conftest import load_script

verify_cost = load_script("verify_cost")


def test_the_share_is_one_minus_the_ratio_of_the_medians_over_runs():
    lines = [{"verify": True, "actor_sync_median_ms": 3.0, "steps_per_s": 9.0},
             {"verify": False, "actor_sync_median_ms": 2.0, "steps_per_s": 10.0},
             {"verify": True, "actor_sync_median_ms": 5.0, "steps_per_s": 8.0},
             {"verify": False, "actor_sync_median_ms": 2.5, "steps_per_s": 11.0},
             {"verify": True, "actor_sync_median_ms": 4.0, "steps_per_s": 10.0},
             {"verify": False, "actor_sync_median_ms": 3.0, "steps_per_s": 9.0}]
    summary = verify_cost.summarize(lines)
    assert summary["runs_each"] == 3
    assert summary["actor_sync_ms_verified"] == 4.0 and summary["actor_sync_ms_unverified"] == 2.5
    assert summary["actor_sync_ms_verified_range"] == [3.0, 5.0]
    assert summary["verify_share_of_actor_sync"] == pytest.approx(1 - 2.5 / 4.0)
    assert summary["steps_per_s_on_over_off"] == pytest.approx(9.0 / 10.0)
