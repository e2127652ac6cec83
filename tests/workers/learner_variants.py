"""torchrun worker (2 ranks): the learner's train_step under several learner options,
each from the same initial weights and batch; writes every run's update of each
parameter and its diagnostics to one safetensors file, `RUN/<name>` keys. The test
compares runs: packed (shared prompts, and not) vs padded micro-batches, activation
checkpointing vs none, bf16 vs full precision, DAPO's overlong filter and penalty.

The runs compute in float64, except the bf16 one (whose fp32 master weights are under
test): packed and padded forwards sum in different orders, which in float32 moves
their results by amounts that depend on the CPU's kernels, in float64 by ~1e-16."""
import sys

import torch
from fsdp_step import VARIANTS, full_state, init_world, synthetic_groups
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from async_rl.config import build_config
from async_rl.learner.batching import scatter_batch
from async_rl.learner.models import Models
from async_rl.learner.process import shutdown_world
from async_rl.learner.sharding import shard_model
from async_rl.learner.step import train_step
from async_rl.models.critic import ValueModel
from async_rl.run.processes import exit_now

PACKED = {"pack": True, "micro_batch_tokens": 40}  # a token budget: micro-batches of 1-3 groups
# (name, train variant, learner options)
RUNS = [(f"{v}-{kind}", v, opts) for v in ("gae", "reinforce_pp", "opmd")
        for kind, opts in (("padded", {}), ("packed", PACKED))] + [
    ("gae-ac", "gae", {"activation_checkpointing": True}),
    ("gae-packed-ac", "gae", {**PACKED, "activation_checkpointing": True}),
    ("ppo-padded", "ppo", {}),
    ("ppo-packed-unshared", "ppo", {**PACKED, "share_prompt": False}),
    ("ppo-packed", "ppo", PACKED),
    ("ppo-bf16", "ppo", {"precision": "bf16"}),
    ("ppo-overlong", "ppo", {"overlong": {"filter": True, "penalty_tokens": 2}}),
]


def run(name: str, variant: str, opts: dict, model_dir: str, mesh, rank: int, world: int) -> dict:
    train = {"batch_groups": 4, "group_size": 4, "grad_clip": 1e9, **VARIANTS[variant],
             **({"overlong": opts.pop("overlong")} if "overlong" in opts else {})}
    cfg = build_config({"train": train, "actors": {"max_new_tokens": 5},
                        "learner": {"ranks": 2, "micro_batch_size": 4, "pack": False, **opts}})
    lc = cfg.learner
    dtype = torch.float32 if lc.precision == "bf16" else torch.float64
    shard = dict(precision=lc.precision, activation_checkpointing=lc.activation_checkpointing)
    policy = shard_model(LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype), mesh, **shard)
    models = Models(policy, torch.optim.SGD(policy.parameters(), lr=1.0))
    if cfg.train.kl.coef > 0:
        reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).requires_grad_(False)
        models.reference = shard_model(reference, mesh, precision=lc.precision)
        with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
            for p in models.policy.parameters():
                p.add_(0.05 * torch.ones_like(p))
    if cfg.train.advantage.name == "gae":
        models.critic = shard_model(ValueModel(model_dir, dtype=dtype), mesh, **shard)
        models.critic_optimizer = torch.optim.SGD(models.critic.parameters(), lr=1.0)
    dtypes = []  # (param, grad) dtypes the optimizer sees: the master weights
    step = models.optimizer.step
    models.optimizer.step = lambda: (dtypes.extend(
        (p.dtype, p.grad.dtype) for p in models.policy.parameters() if p.grad is not None), step())[1]
    before = full_state(models)
    groups = synthetic_groups(4, 4, seed=1) if rank == 0 else None
    stats = train_step(cfg, models, scatter_batch(groups, 0, rank, world, cfg.train.minibatches, torch.device("cpu")))
    out = {f"{name}/{n}": (after - before[n]).contiguous() for n, after in full_state(models).items()}
    for key, value in stats.items():
        out[f"{name}/stat:{key}"] = torch.tensor([value], dtype=torch.float64)
    # The one dtype of every parameter and gradient the optimizer stepped (bool: none, or several).
    master = dtypes[0][0] if dtypes and all(d == (dtypes[0][0],) * 2 for d in dtypes) else torch.bool
    out[f"{name}/master"] = torch.zeros(1, dtype=master)
    return out


def main(out_path: str, model_dir: str) -> None:
    rank, world, mesh = init_world(model_dir)
    tensors = {}
    for name, variant, opts in RUNS:
        tensors.update(run(name, variant, opts, model_dir, mesh, rank, world))
    if rank == 0:
        save_file(tensors, out_path)
    shutdown_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now(0)
