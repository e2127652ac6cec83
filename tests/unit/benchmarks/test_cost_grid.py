"""benchmarks/cost_grid.py: each cell's config changes, and its prediction from a base run
against hand-computed rates (a learner-bound base written as metrics.jsonl)."""
import json

import pytest
import yaml
from conftest import load_script

from async_rl.config import build_config

grid = load_script("cost_grid")

B, G, STEP_S, GEN_S = 8, 8, 10.0, 1.0  # base: 8 groups of 8 per 10 s step, 1 s per generated group


def write_run(run_dir, response_len: float, steps: int = 12):
    """A learner-bound run: the learner never waits, one step every STEP_S seconds."""
    run_dir.mkdir(parents=True)
    cfg = {"train": {"batch_groups": B, "group_size": G}, "eval": {"every": 0}, "checkpoint": {"every": 0},
           "actors": {"count": 1, "groups_per_request": 8}, "max_staleness": 1, "sync": {"every": 1},
           "learner": {"ranks": 1}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": k, "time": 30.0 + k * STEP_S, "loss/total": 0.0, "throughput/samples_per_s": B * G / STEP_S,
              "learner/idle_frac": 0.0, "sync/seconds": 0.0, "sync/broadcast_seconds": 0.0,
              "actors/gen_seconds_per_group": GEN_S, "staleness/count_1": B * G,
              "train/response_len_mean": response_len,
              "memory/learner_peak_rss_gb": 5.0, "memory/actor_peak_rss_gb": 1.5}
             for k in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def test_cells_change_one_axis_and_split_the_actor_threads():
    cfg = build_config({"actors": {"count": 1, "threads": 2}})
    assert grid.cell_overrides("base", cfg) == []
    assert grid.cell_overrides("actors=4", cfg) == ["actors.count=4", "actors.threads=1"]
    assert grid.cell_overrides("actors=2", cfg) == ["actors.count=2", "actors.threads=1"]
    assert grid.cell_overrides("tokens=64", cfg) == ["actors.max_new_tokens=64"]
    assert grid.cell_overrides("batch=4", cfg) == ["train.batch_groups=4"]
    with pytest.raises(SystemExit, match="unknown cell"):
        grid.cell_overrides("threads=2", cfg)


def test_a_smaller_batch_scales_the_step(tmp_path):
    """4 groups: the step takes 5 s, the actor 4 s per batch: learner-bound at 32 / 5 samples/s."""
    base = write_run(tmp_path / "base", response_len=10)
    assert grid.predict(base, "batch=4", base, prompt_tokens=40, cores=2) == pytest.approx(4 * G / 5.0, rel=0.03)


def test_longer_responses_scale_generation_and_the_step_by_tokens(tmp_path):
    """Responses 10 -> 20 tokens with 40-token prompts: the step grows by (40 + 8*20) / (40 + 8*10)
    = 5/3 to 16.7 s, generation doubles to 16 s per batch: still learner-bound at 64 / 16.7."""
    base = write_run(tmp_path / "base", response_len=10)
    cell = write_run(tmp_path / "tokens=64", response_len=20)
    expected = B * G / (STEP_S * 5 / 3)
    assert grid.predict(base, "tokens=64", cell, prompt_tokens=40, cores=2) == pytest.approx(expected, rel=0.03)


def test_more_actors_than_cores_slow_every_process(tmp_path):
    """3 actors + the learner on 2 cores: CPU times x (4/2) / (2/2) = 2, so a 20 s step."""
    base = write_run(tmp_path / "base", response_len=10)
    assert grid.predict(base, "actors=3", base, prompt_tokens=40, cores=2) == pytest.approx(B * G / 20.0, rel=0.03)
