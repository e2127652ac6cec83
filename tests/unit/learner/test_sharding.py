"""The learner's policy under FSDP2 in a one-process gloo world, on a tiny Llama: the
attention kernel it is loaded with (learner.attention)."""

import pytest
import torch
from workers.fsdp_step import synthetic_groups

from async_rl.config import build_config
from async_rl.learner.batching import build_batch
from async_rl.learner.models import build_models
from async_rl.learner.sharding import full_parameters
from async_rl.learner.step import train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trained(model_dir, one_rank_mesh, attention):
    cfg = build_config({"model": {"path": str(model_dir)},
                        "train": {"batch_groups": 4, "group_size": 4, "lr": 0.01},
                        "learner": {"ranks": 1, "micro_batch_size": 4, "attention": attention}})
    models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    stats = [train_step(cfg, models, build_batch(synthetic_groups(4, 4, seed=seed), pad_id=0), [])
             for seed in (1, 2)]
    return cfg, models, stats


def test_eager_attention_trains_as_the_default_kernel_with_shared_prompts(one_rank_mesh, tiny_llama_dir):
    cfg, sdpa, sdpa_stats = _trained(tiny_llama_dir, one_rank_mesh, None)
    cfg_eager, eager, eager_stats = _trained(tiny_llama_dir, one_rank_mesh, "eager")
    assert sdpa.policy.config._attn_implementation == "sdpa"
    assert eager.policy.config._attn_implementation == "eager"
    # Eager takes the shared-prompt mask (as an additive one): the prompts stay shared.
    assert cfg.learner.share_prompt and cfg_eager.learner.share_prompt
    for want, got in zip(sdpa_stats, eager_stats):
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-5)
        assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=1e-4)
        assert want["learner/grad_norm"] > 0
    for (name, want), (_, got) in zip(full_parameters(sdpa.policy), full_parameters(eager.policy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)
