import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

from async_rl.config import ConfigError, from_yaml, load_config, reference_markdown, to_yaml

ROOT = Path(__file__).resolve().parents[3]


def test_demo_config_loads_with_overrides():
    cfg = load_config(ROOT / "configs/demo.yaml", ["train.max_steps=3", "max_staleness=0", "train.lr=1e-3"])
    assert cfg.train.max_steps == 3 and cfg.max_staleness == 0 and cfg.train.lr == 1e-3


def test_yaml_round_trip():
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert from_yaml(to_yaml(cfg)) == cfg


@pytest.mark.parametrize("override, key", [
    ("train.batchgroups=3", "train.batchgroups: unknown key"),
    ("train.batch_groups=abc", "train.batch_groups:"),
    ("train.loss=dpo", "train.loss:"),
    ("max_staleness=-1", "max_staleness:"),
    ("sync.every=9", "sync.every:"),
    ("learner.ranks=2 train.batch_groups=63", "train.batch_groups: must be a multiple"),
    ("learner.ranks=0", "learner.ranks"),
    ("learner.ranks=some", "learner.ranks"),
    ("task.name=jsonl", "task.train_path:"),
    ("nonsense", "nonsense:"),
    ("train.ppo.is_mode=drop", "train.ppo.is_mode:"),
    ("train.ppo.log_ratio_clamp=0", "train.ppo.log_ratio_clamp:"),
    ("train.kl.clamp=-1", "train.kl.clamp:"),
    ("train.advantage=ppo", "train.advantage:"),
    ("train.agg=token-max", "train.agg:"),
    ("train.kl.estimator=k4", "train.kl.estimator:"),
    ("model.lora.rank=-1", "model.lora.rank:"),
    ("model.lora.rank=8 actors.engine=vllm sync.in_flight=true", "sync.in_flight: vLLM actors switch LoRA"),
    ("actors.engine=vllm actors.dtype=bfloat16", "actors.dtype: sets the torch engine's"),
    ("actors.dtype=float16", "actors.dtype:"),
    ("learner.attention=flash", "learner.attention:"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", override.split())
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_algorithm_choices_are_the_registries():
    """Adding an entry to a registry adds a valid config value."""
    from typing import get_args

    from async_rl.algorithms import ADVANTAGES, AGG_MODES, IS_MODES, KL_KINDS, LOSSES
    from async_rl.config import KLConfig, PPOConfig, TrainConfig

    def choices(section, key):
        return get_args(section.model_fields[key].annotation)

    assert choices(TrainConfig, "loss") == tuple(LOSSES) and choices(TrainConfig, "advantage") == tuple(ADVANTAGES)
    assert choices(TrainConfig, "agg") == AGG_MODES and choices(PPOConfig, "is_mode") == IS_MODES
    assert choices(KLConfig, "estimator") == KL_KINDS
    for loss in LOSSES:
        for advantage in ADVANTAGES:
            if loss == "ppo" or advantage not in ("remax", "gae"):
                assert load_config(None, [f"train.loss={loss}", f"train.advantage={advantage}"]).train.loss == loss


def test_clamp_and_is_mode_defaults_and_overrides():
    cfg = load_config(None)
    assert cfg.train.ppo.is_mode == "truncate" and cfg.train.ppo.log_ratio_clamp == 20.0
    assert cfg.train.kl.clamp == 10.0
    cfg = load_config(ROOT / "configs/demo.yaml", ["train.kl.clamp=null", "train.ppo.is_mode=mask",
                                                   "train.ppo.log_ratio_clamp=5"])
    assert cfg.train.kl.clamp is None and cfg.train.ppo.is_mode == "mask" and cfg.train.ppo.log_ratio_clamp == 5.0


def test_cli_bad_config_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"),
                           "train.loss=xyz", f"run_dir={tmp_path / 'r'}"], capture_output=True, text=True, timeout=60,
                          env=subprocess_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.loss" in lines[0]
    assert not (tmp_path / "r").exists()


def test_cli_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 2 and "nope.yaml" in proc.stderr


def test_reference_lists_every_contract_key():
    doc = reference_markdown()
    for key in ["run_dir", "seed", "max_staleness", "actors.count", "train.max_steps", "train.batch_groups",
                "train.group_size", "train.loss", "train.advantage", "sync.every", "sync.bucket_mb",
                "sync.in_flight", "eval.every", "checkpoint.every"]:
        assert f"`{key}`" in doc


def test_the_config_page_is_the_generated_reference():
    """docs/config.md holds the table `async-rl config-doc` prints, as of this code."""
    from conftest import ROOT

    assert reference_markdown().strip() in (ROOT / "docs" / "config.md").read_text()
