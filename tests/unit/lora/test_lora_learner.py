"""The learner's side of LoRA in a one-process gloo world, on a tiny Llama under FSDP2:
only the adapters train (and the optimizer holds only their state), the KL reference
is the base (the adapters switched off), and a checkpoint restores the adapters and
their optimizer exactly."""

import pytest
import torch

pytest.importorskip("peft")

from workers.fsdp_step import synthetic_groups  # noqa: E402

from async_rl.config import build_config  # noqa: E402
from async_rl.learner.batching import build_batch  # noqa: E402
from async_rl.learner.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from async_rl.learner.models import build_models  # noqa: E402
from async_rl.learner.sharding import full_parameters  # noqa: E402
from async_rl.learner.step import train_step  # noqa: E402
from async_rl.lora.adapters import is_adapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def _cfg(model_dir, **train):
    return build_config({"model": {"path": str(model_dir), "lora": {"rank": 4, "alpha": 8}},
                         "train": {"batch_groups": 4, "group_size": 4, "lr": 0.05, **train},
                         "learner": {"ranks": 1, "micro_batch_size": 4}})


def _params(models):
    return {n: t.clone() for n, t in full_parameters(models.policy)}


def _step(cfg, models, seed):
    return train_step(cfg, models, build_batch(synthetic_groups(4, 4, seed=seed), pad_id=0), {})


def test_only_the_adapters_train_against_the_base_as_reference(one_rank_mesh, model_dir):
    cfg = _cfg(model_dir, kl={"coef": 0.1})
    models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    assert models.reference is None and models.reference_is_base  # no second model in memory
    optimized = {id(p) for group in models.optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for n, p in models.policy.named_parameters() if is_adapter(n)}
    assert optimized == trainable and trainable
    before = _params(models)
    first = _step(cfg, models, seed=1)
    second = _step(cfg, models, seed=2)
    after = _params(models)
    assert first["policy/kl_ref"] == pytest.approx(0.0, abs=1e-9)  # fresh adapters: the policy is the base
    assert second["policy/kl_ref"] > 1e-6  # the adapters moved the policy off the base
    assert all(torch.equal(value, before[name]) for name, value in after.items() if not is_adapter(name))
    assert all(not torch.equal(value, before[name]) for name, value in after.items() if ".lora_B." in name)


def test_a_checkpoint_restores_the_adapters_and_their_optimizer_exactly(one_rank_mesh, model_dir, tmp_path):
    cfg = _cfg(model_dir)
    models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    for seed in (1, 2):
        _step(cfg, models, seed)
    save_checkpoint(tmp_path / "step_000002", {"model": (models.policy, models.optimizer)}, {"version": 2})
    resumed = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    assert load_checkpoint(tmp_path / "step_000002", {"model": (resumed.policy, resumed.optimizer)})["version"] == 2
    for (name, want), (_, got) in zip(full_parameters(models.policy), full_parameters(resumed.policy)):
        assert torch.equal(want, got), name
    _step(cfg, models, seed=3)
    _step(cfg, resumed, seed=3)
    for (name, want), (_, got) in zip(full_parameters(models.policy), full_parameters(resumed.policy)):
        assert torch.equal(want, got), name


@pytest.mark.parametrize("train", [{"advantage": "gae"}, {"loss": "opmd", "kl": {"coef": 0.1, "mode": "reward"}},
                                   {"minibatches": 2, "entropy_coef": 0.01}], ids=["gae", "opmd-kl-reward", "ppo-mb"])
def test_the_other_losses_and_the_critic_train_the_adapters(one_rank_mesh, model_dir, train):
    cfg = _cfg(model_dir, **train)
    models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    before = _params(models)
    stats = [_step(cfg, models, seed) for seed in (1, 2)]
    after = _params(models)
    assert all(torch.isfinite(torch.tensor(v)) for s in stats for v in s.values())
    assert all(torch.equal(value, before[name]) for name, value in after.items() if not is_adapter(name))
    assert any(not torch.equal(value, before[name]) for name, value in after.items() if is_adapter(name))
    if cfg.train.advantage.name == "gae":  # the critic is a model of its own, fully trained
        assert models.critic is not None and "loss/value" in stats[-1]
