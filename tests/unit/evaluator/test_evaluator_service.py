import json
from pathlib import Path

import pytest
import torch

from async_rl.config import load_config, to_yaml
from async_rl.evaluation.saved_model import score_saved_model
from async_rl.evaluator.service import Evaluator
from async_rl.evaluator.versions import VersionStore, unscored, version_file

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def evaluator_and_cfg(demo_model):
    cfg = load_config(ROOT / "configs/demo.yaml", [f"model.path={demo_model}", "eval.size=32", "eval.batch_size=12"])
    return Evaluator(cfg), cfg


def saved(tmp_path, cfg, named, version=5, time_s=1.25):
    store = VersionStore(tmp_path, to_yaml(cfg), torch.float32)
    store.saver(version, time_s)(iter(named))
    store.flush()
    return store


def test_a_saved_version_scores_as_the_saved_model_does(tmp_path, demo_model, evaluator_and_cfg):
    from transformers import AutoModelForCausalLM

    evaluator, cfg = evaluator_and_cfg
    trained = AutoModelForCausalLM.from_pretrained(demo_model)  # what a learner gathers: its named parameters
    saved(tmp_path, cfg, list(trained.named_parameters()))
    line = evaluator.score(tmp_path, 5)
    assert evaluator.rollout.engine.version == 5
    assert json.loads(version_file(tmp_path, 5, ".result.json").read_text()) == line and unscored(tmp_path) == []
    assert line["step"] == line["version"] == 5 and line["version_time"] == 1.25 and line["eval/prompts"] == 32
    alone = score_saved_model(cfg, str(demo_model), threads=1).line
    assert line["eval/accuracy"] == alone["eval/accuracy"]
    assert line["eval/response_len_mean"] == alone["eval/response_len_mean"]


def test_the_weights_of_each_version_are_the_ones_scored(tmp_path, demo_model, evaluator_and_cfg):
    from transformers import AutoModelForCausalLM

    evaluator, cfg = evaluator_and_cfg
    broken = AutoModelForCausalLM.from_pretrained(demo_model)
    with torch.no_grad():
        broken.lm_head.weight.zero_()  # every logit equal: greedy decoding says token 0 alone
    saved(tmp_path, cfg, list(broken.named_parameters()), version=7)
    line = evaluator.score(tmp_path, 7)
    assert line["eval/accuracy"] == 0.0


def test_a_version_of_another_shape_is_refused_naming_the_tensor(tmp_path, demo_model, evaluator_and_cfg):
    from transformers import AutoModelForCausalLM

    evaluator, cfg = evaluator_and_cfg
    named = list(AutoModelForCausalLM.from_pretrained(demo_model).named_parameters())
    name, tensor = named[1]
    named[1] = (name, tensor[:1])
    saved(tmp_path, cfg, named, version=9)
    with pytest.raises(ValueError, match=f"version 9: {name}"):
        evaluator.score(tmp_path, 9)
    saved(tmp_path, cfg, named[:-1], version=11)
    with pytest.raises(ValueError, match="version 11 has"):
        evaluator.score(tmp_path, 11)


def test_also_dtypes_scores_the_same_version_in_another_dtype(tmp_path, demo_model):
    from transformers import AutoModelForCausalLM

    overrides = [f"model.path={demo_model}", "eval.size=32", "eval.batch_size=32"]
    cfg = load_config(ROOT / "configs/demo.yaml", [*overrides, "eval.also_dtypes=[bfloat16]"])
    saved(tmp_path, cfg, list(AutoModelForCausalLM.from_pretrained(demo_model).named_parameters()))
    line = Evaluator(cfg).score(tmp_path, 5)
    in_bf16 = score_saved_model(load_config(ROOT / "configs/demo.yaml", [*overrides, "actors.engine.dtype=bfloat16"]),
                                str(demo_model), threads=1).line
    assert line["eval/accuracy@bfloat16"] == in_bf16["eval/accuracy"]
    assert line["eval/response_len_mean@bfloat16"] == in_bf16["eval/response_len_mean"]
    assert line["eval/accuracy"] == score_saved_model(cfg, str(demo_model), threads=1).line["eval/accuracy"]


def test_also_dtypes_needs_the_evaluator():
    with pytest.raises(Exception, match="eval.also_dtypes"):
        load_config(ROOT / "configs/demo.yaml", ["eval.also_dtypes=[float32]", "eval.placement=actors"])
