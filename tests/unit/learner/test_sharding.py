"""The learner's policy under FSDP2 in a one-process gloo world, on a tiny Llama: the
attention kernel it is loaded with (learner.attention)."""

import pytest
import torch
from workers.fsdp_step import synthetic_groups

from async_rl.config import build_config
from async_rl.learner import packing
from async_rl.learner.batching import build_batch
from async_rl.learner.models import build_models
from async_rl.learner.step import forward_logp, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A float32 result that depends on a kernel's order of summation agrees with another
# order to about 12 of float32's 24 significant bits over sums this size; no constant
# fitted to one CPU's kernels.
FLOAT32_AGREEMENT = 2.0 ** -12


def within_float32_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal but for float32 rounding in one step: a few float32 epsilons of the tensor's scale."""
    bound = 16 * torch.finfo(torch.float32).eps * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound, what


def _trained(model_dir, one_rank_mesh, attention):
    cfg = build_config({"model": {"path": str(model_dir)},
                        "train": {"batch_groups": 4, "group_size": 4, "lr": 0.01},
                        "learner": {"ranks": 1, "micro_batch_size": 4, "attention": attention}})
    models = build_models(cfg, torch.device("cpu"), one_rank_mesh)
    stats = [train_step(cfg, models, build_batch(synthetic_groups(4, 4, seed=seed), pad_id=0), {})
             for seed in (1, 2)]
    return cfg, models, stats


def _float64_step(model_dir, attention):
    """Log-probs and gradients of one shared-prompt packed forward and backward, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation=attention)
    batch = build_batch(synthetic_groups(4, 4, seed=1), pad_id=0)
    layout = packing.layout(model, batch, None, 4)
    logp, _ = forward_logp(model, batch, 1.0, layout=layout)
    (logp * batch.loss_mask).sum().backward()
    return logp.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_eager_attention_trains_as_the_default_kernel_with_shared_prompts(one_rank_mesh, tiny_llama_dir):
    cfg, sdpa, sdpa_stats = _trained(tiny_llama_dir, one_rank_mesh, None)
    cfg_eager, eager, eager_stats = _trained(tiny_llama_dir, one_rank_mesh, "eager")
    assert sdpa.policy.config._attn_implementation == "sdpa"
    assert eager.policy.config._attn_implementation == "eager"
    # Eager takes the shared-prompt mask (as an additive one): the prompts stay shared.
    assert cfg.learner.share_prompt and cfg_eager.learner.share_prompt
    # The same computation: in float64 the two kernels agree up to the one float32 step
    # of eager (transformers' eager attention takes its softmax in float32)...
    logp, grads = _float64_step(tiny_llama_dir, "sdpa")
    eager_logp, eager_grads = _float64_step(tiny_llama_dir, "eager")
    within_float32_rounding(eager_logp, logp, "log-probs")
    for name, grad in grads.items():
        within_float32_rounding(eager_grads[name], grad, name)
    # ... and the float32 steps (AdamW's, which scale every update to about lr, so a
    # rounding difference in a tiny gradient moves weights by as much as a large one:
    # their weights are compared in float64 above, not here) to float32's.
    for want, got in zip(sdpa_stats, eager_stats):
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=FLOAT32_AGREEMENT, abs=1e-7)
        assert got["learner/grad_norm"] == pytest.approx(want["learner/grad_norm"], rel=FLOAT32_AGREEMENT)
        assert want["learner/grad_norm"] > 0
