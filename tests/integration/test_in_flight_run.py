"""In-flight weight updates (sync.in_flight=true) in one short real run: its metrics show
samples whose tokens span two versions. (The engine's step hook and the actor's hook:
tests/unit/actor/test_in_flight.py.)"""
import pytest
from conftest import read_metrics, train


def test_in_flight_run_has_mixed_version_samples(tmp_path, demo_model) -> None:
    run = tmp_path / "in_flight"
    # Generation has to span learner steps: long responses (a hot sampler rarely picks
    # EOS) and enough steps after the start-up, where the actor runs ahead, to see it
    # (steps of the barely trained demo model take tens of milliseconds, so whether a
    # publish lands inside a generation is up to the scheduler: 40 steps make it sure).
    train(run, demo_model, "sync.in_flight=true", "train.max_steps=40", "max_staleness=2", "learner.ranks=1",
          "actors.groups_per_request=8", "actors.temperature=3.0", "actors.max_new_tokens=64", "eval.every=0",
          "task.max_prompt_tokens=16",  # responses run past the demo model's 64 positions: allow it
          "train.correction=geometric_mask",  # a sequence-level correction over responses of several versions
          timeout=120)
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == list(range(1, 41))
    for s in steps:
        # Every group passed the hub's check that its version is its oldest token's ...
        assert s["wire/rejected"] == 0
        # ... and the admission bound holds on that version.
        assert s["staleness/max"] <= 2 and s["staleness/dropped"] == 0
        # Sample staleness counts from the oldest token, so never below the token figure;
        # above it exactly on steps with mixed-version samples.
        mixed = s["actors/mixed_version_frac"] > 0
        assert s["staleness/mean"] - s["actors/token_staleness_mean"] > 1e-9 if mixed else \
            s["staleness/mean"] == pytest.approx(s["actors/token_staleness_mean"])
    assert any(s["actors/mixed_version_frac"] > 0 for s in steps), [s["actors/mixed_version_frac"] for s in steps]
    assert all(0.0 <= s["is/masked_seq_frac"] <= 1.0 for s in steps)
    # The groups still buffered at the end (real ExperienceGroups, from the final checkpoint).
    from async_rl.learner.checkpoint import BUFFER_FILE, read_groups

    final = sorted((run / "checkpoints").iterdir())[-1]
    for _, version, g in read_groups(final / BUFFER_FILE):
        assert version == g.version == g.token_versions.min()
