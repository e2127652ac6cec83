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


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_yaml_round_trip(config):
    cfg = load_config(config)
    assert from_yaml(to_yaml(cfg)) == cfg


@pytest.mark.parametrize("override, key", [
    ("train.batchgroups=3", "train.batchgroups: unknown key"),
    ("train.batch_groups=abc", "train.batch_groups:"),
    ("train.loss=dpo", "train.loss.name: 'dpo' is not one of ppo, gspo, cispo, opmd"),
    ("max_staleness=-1", "max_staleness:"),
    ("sync.every=9", "sync.every:"),
    ("learner.ranks=2 train.batch_groups=63", "train.batch_groups: must be a multiple"),
    ("learner.ranks=0", "learner.ranks"),
    ("learner.ranks=some", "learner.ranks"),
    ("task.name=jsonl", "task.train_path: required when task.name=jsonl"),
    ("task.name=dataset", "task.path: required when task.name=dataset"),
    ("task.name=reasoning_gym task.dataset=leg_counting task.reward=exact_match",
     "task.reward: unknown key for task.name=reasoning_gym"),
    ("nonsense", "nonsense:"),
    ("train.correction.mode=drop", "train.correction.mode:"),
    ("train.loss.is_mode=mask", "train.loss.is_mode: moved to train.correction.mode"),
    ("train.correction=icepop train.correction.high=0.5", "train.correction.high:"),
    ("train.correction=m2po train.correction.cap=2",
     "train.correction.cap: unknown key for train.correction.name=m2po"),
    ("train.loss.decoupled=false train.correction=icepop", "train.correction: icepop corrects toward"),
    ("train.loss.log_ratio_clamp=0", "train.loss.log_ratio_clamp:"),
    ("train.loss=opmd train.loss.eps_low=0.1", "train.loss.eps_low: unknown key for train.loss.name=opmd"),
    ("train.kl.clamp=-1", "train.kl.clamp:"),
    ("train.advantage=ppo", "train.advantage.name: 'ppo' is not one of"),
    ("train.advantage.lam=0.9", "train.advantage.lam: unknown key for train.advantage.name=grpo"),
    ("train.advantage=gae train.advantage.lam=2", "train.advantage.lam:"),
    ("train.agg=token-max", "train.agg:"),
    ("train.kl.estimator=k4", "train.kl.estimator:"),
    ("train.lr_schedule=constant train.lr_schedule.min_ratio=0.5",
     "train.lr_schedule.min_ratio: unknown key for train.lr_schedule.name=constant"),
    ("model.lora.rank=-1", "model.lora.rank:"),
    ("model.lora.rank=8 actors.engine=vllm sync.in_flight=true", "sync.in_flight: vLLM actors switch LoRA"),
    ("actors.engine=vllm actors.engine.dtype=int8", "actors.engine.dtype:"),
    ("actors.engine.dtype=float8", "actors.engine.dtype:"),
    ("actors.engine.kv_cache_gb=2", "actors.engine.kv_cache_gb: unknown key for actors.engine.name=torch"),
    ("learner.attention=flash", "learner.attention:"),
    ("eval.pass_k=4", "eval.pass_k: greedy decoding"),
    ("security.curve=true", "security.keys_dir: required"),
    ("env.max_turns=3", "env.name: required"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", override.split())
    assert str(err.value).startswith(key) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("override, line", [
    ("task.name=jsonl task.train_path=a.jsonl task.eval_size=10",
     "task.eval_size: unknown key for task.name=jsonl (a key of task.name=arithmetic/word_problems/tool_problems/"
     "coding/reasoning_gym); with jsonl: the held-out prompts are task.eval_path, else a held-out 10% of "
     "task.train_path; eval.size caps how many are scored"),
    ("task.name=dataset task.path=d task.eval_size=10", "with dataset: the held-out prompts are task.eval_split"),
    ("task.name=arithmetic task.eval_path=x.jsonl",
     "task.eval_path: unknown key for task.name=arithmetic (a key of task.name=jsonl)"),
    ("train.advantage.lam=0.9", "train.advantage.lam: unknown key for train.advantage.name=grpo (a key of "
                                "train.advantage.name=gae)"),
])
def test_a_key_of_another_variant_says_whose_it_is_and_what_is_here_instead(override, line):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", override.split())
    message = str(err.value)
    assert (message == line or line in message) and "\n" not in message, message


@pytest.mark.parametrize("override, where", [
    ("train.ppo.eps_low=0.1", "train.ppo.eps_low: moved to train.loss.eps_low (with train.loss.name=ppo)"),
    ("train.opmd.tau=2", "train.opmd.tau: moved to train.loss.tau (with train.loss.name=opmd)"),
    ("train.critic.lr=1e-4", "train.critic.lr: moved to train.advantage.critic_lr (with train.advantage.name=gae)"),
    ("train.gamma=0.9", "train.gamma: moved to train.advantage.gamma"),
    ("train.lr_min_ratio=0", "train.lr_min_ratio: moved to train.lr_schedule.min_ratio"),
    ("train.warmup_steps=3", "train.warmup_steps: moved to train.lr_schedule.warmup_steps"),
    ("actors.vllm.dtype=bfloat16", "actors.vllm.dtype: moved to actors.engine.dtype (with actors.engine.name=vllm)"),
    ("actors.dtype=bfloat16", "actors.dtype: moved to actors.engine.dtype"),
])
def test_an_old_key_names_its_new_place(override, where):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/demo.yaml", [override])
    assert str(err.value).startswith(where) and "\n" not in str(err.value)


def test_a_config_holds_only_the_chosen_variants_fields():
    ppo = load_config(None).train
    assert ppo.loss.name == "ppo" and ppo.loss.eps_low == 0.2 and not hasattr(ppo.loss, "tau")
    assert not hasattr(ppo.advantage, "lam")
    opmd = load_config(None, ["train.loss=opmd", "train.loss.tau=2"]).train.loss
    assert opmd.name == "opmd" and opmd.tau == 2.0 and not hasattr(opmd, "eps_low")
    gae = load_config(None, ["train.advantage.name=gae", "train.advantage.lam=0.9"]).train.advantage
    assert gae.lam == 0.9 and gae.critic_lr == 1e-3
    assert load_config(None, ["train.loss.eps_high=0.28"]).train.loss.eps_high == 0.28  # the default variant's knob
    assert load_config(None).env is None and load_config(None, ["env.name=calculator"]).env.max_turns == 4


def test_a_file_variant_switched_on_the_command_line_drops_the_old_knobs(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  loss: {name: ppo, eps_high: 0.28}\n  lr_schedule: cosine\n")
    cfg = load_config(config, ["train.loss=opmd", "train.lr_schedule.min_ratio=0.2"])
    assert cfg.train.loss.name == "opmd" and cfg.train.lr_schedule.name == "cosine"
    assert cfg.train.lr_schedule.min_ratio == 0.2


def test_algorithm_choices_are_the_registries():
    """Every loss and advantage the config offers is a registry entry, and the reverse."""
    from typing import get_args

    from async_rl.algorithms.advantages import ADVANTAGES
    from async_rl.algorithms.aggregation import AGG_MODES
    from async_rl.algorithms.config import ADVANTAGE_VARIANTS, CORRECTION_VARIANTS, LOSS_VARIANTS
    from async_rl.algorithms.corrections import CORRECTIONS
    from async_rl.algorithms.losses import LOSSES
    from async_rl.config.section import variant_names

    assert sorted(n for v in LOSS_VARIANTS for n in variant_names(v)) == sorted(LOSSES)
    assert sorted(n for v in CORRECTION_VARIANTS for n in variant_names(v)) == sorted(CORRECTIONS)
    assert sorted(n for v in ADVANTAGE_VARIANTS for n in variant_names(v)) == sorted(ADVANTAGES)
    assert get_args(type(load_config(None).train).model_fields["agg"].annotation) == AGG_MODES
    for loss in LOSSES:
        for advantage in ADVANTAGES:
            if loss != "opmd" or advantage not in ("remax", "gae"):
                cfg = load_config(None, [f"train.loss={loss}", f"train.advantage={advantage}"])
                assert (cfg.train.loss.name, cfg.train.advantage.name) == (loss, advantage)


def test_clamp_and_correction_defaults_and_overrides():
    cfg = load_config(None)
    assert cfg.train.correction.name == "token" and cfg.train.correction.mode == "truncate"
    assert cfg.train.loss.log_ratio_clamp == 20.0 and cfg.train.kl.clamp == 10.0
    cfg = load_config(ROOT / "configs/demo.yaml", ["train.kl.clamp=null", "train.correction.mode=mask",
                                                   "train.loss.log_ratio_clamp=5"])
    assert cfg.train.kl.clamp is None and cfg.train.correction.mode == "mask" and cfg.train.loss.log_ratio_clamp == 5.0
    # OPMD's reference is the sampler's log-probs: no correction unless one is named
    assert load_config(None, ["train.loss=opmd"]).train.correction.name == "none"
    assert load_config(None, ["train.loss=opmd", "train.correction=icepop"]).train.correction.name == "icepop"
    assert load_config(None, ["train.loss=gspo"]).train.correction.name == "token"


def test_importing_the_config_imports_no_torch():
    """The sections and the loader stay importable where torch is absent or slow to import."""
    code = ("import sys; import async_rl.config; from async_rl.config import Config, load_config, reference_markdown; "
            "load_config('configs/demo.yaml'); reference_markdown(); assert 'torch' not in sys.modules, 'torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_field_has_a_one_line_description():
    """Longer explanations live in docs/config.md."""
    for row in reference_markdown().splitlines()[2:]:
        meaning = row.split(" | ", 2)[2]
        assert meaning.strip(" |") and len(meaning) < 200, row


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
                "train.group_size", "train.loss.name", "train.advantage.name", "train.loss.eps_low", "train.loss.tau",
                "train.advantage.lam", "actors.engine.name", "actors.engine.kv_cache_gb", "task.dataset",
                "sync.every", "sync.bucket_mb", "sync.in_flight", "eval.every", "checkpoint.every", "env.max_turns"]:
        assert f"`{key}`" in doc, key


def test_the_config_page_is_the_generated_reference():
    """docs/config.md holds the table `async-rl config-doc` prints, as of this code, once
    (no row of an earlier table left beside it)."""
    page, table = (ROOT / "docs" / "config.md").read_text(), reference_markdown().strip()
    assert table in page
    rows = set(table.splitlines()[2:])
    assert sum(line in rows for line in page.splitlines()) == len(table.splitlines()) - 2


def test_cli_eval_of_a_directory_that_is_no_model_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "eval", str(ROOT / "configs/demo.yaml"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"async-rl: eval: {tmp_path} is not a model directory (no config.json)"]
