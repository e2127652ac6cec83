"""torchrun worker: one learner train_step on a fixed synthetic batch, in float64; writes
the step's update of every full parameter and its diagnostics. Run with 1 and with 2
ranks; FSDP2 must give the same result.

float64, because the two runs sum in different orders (a reduce-scatter of two halves,
other padded shapes): in float32 their results differ in the last bits, by amounts that
depend on the CPU's kernels; in float64 by ~1e-16 of their size, far below any error of
the sharding math."""
import sys

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from async_rl.config import build_config
from async_rl.learner.batching import scatter_batch
from async_rl.learner.models import Models
from async_rl.learner.process import shutdown_world
from async_rl.learner.sharding import full_parameters, shard_model
from async_rl.learner.step import train_step
from async_rl.models.critic import ValueModel
from async_rl.run.processes import exit_now
from async_rl.wire import ExperienceGroup, Response

# Named variants of the train section; each exercises a different cross-rank path.
VARIANTS = {
    "ppo": {"loss": "ppo"},
    # the second rank's groups all scored alike: it trains nothing and must still run as
    # many forwards and backwards as the first rank (learner.skip_zero_advantage)
    "ppo-flat": {"loss": "ppo"},
    "opmd": {"loss": {"name": "opmd", "length_norm": True}},
    # global whitening all-reduces its moments; KL in the reward needs the reference model
    "reinforce_pp": {"loss": "ppo", "advantage": "reinforce_pp", "minibatches": 2,
                     "kl": {"coef": 0.1, "estimator": "k2", "mode": "reward"}},
    # critic sharded too; KL in the loss, entropy bonus, per-sequence aggregation
    "gae": {"loss": {"name": "ppo", "dual_clip": 3.0}, "advantage": "gae", "agg": "seq-mean-token-sum",
            "entropy_coef": 0.01, "kl": {"coef": 0.1, "estimator": "k3", "mode": "loss"}},
}


def synthetic_groups(n_groups: int, G: int, seed: int):
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_groups):
        P = int(rng.integers(3, 7))
        T = int(rng.integers(2, 6))
        lengths = rng.integers(1, T + 1, size=G)
        prompt = rng.integers(3, 16, size=P)
        tokens = rng.integers(3, 16, size=(G, T))  # each response: a row's first `lengths` tokens
        logprobs = -rng.random((G, T)) * 3
        groups.append(ExperienceGroup.from_responses(
            [Response(tokens[j, :n], logprobs[j, :n], np.zeros(n)) for j, n in enumerate(lengths)],
            actor_id=0, group=len(groups), prompt_id=0, version=0, prompt_tokens=prompt.astype(np.int32),
            rewards=rng.integers(0, 2, size=G).astype(np.float32), truncated=(lengths == T).astype(np.uint8),
            gen_seconds=0.0))
    return groups


def init_world(model_dir: str):
    """Join the gloo world; rank 0 writes the tiny Llama every rank then loads. (rank, world, mesh)"""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if rank == 0:
        LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64,
                                     tie_word_embeddings=True)).save_pretrained(model_dir)
    dist.barrier()
    return rank, world, init_device_mesh("cpu", (world,))


def full_state(models: Models) -> dict[str, torch.Tensor]:
    """Copies of the full policy (and critic) parameters; a collective on every rank."""
    state = {name: t.clone() for name, t in full_parameters(models.policy)}
    if models.critic is not None:
        state.update({f"critic.{name}": t.clone() for name, t in full_parameters(models.critic)})
    return state


def main(out_path: str, variant: str, model_dir: str) -> None:
    rank, world, mesh = init_world(model_dir)
    train = {"batch_groups": 4, "group_size": 4, "grad_clip": 1e9, **VARIANTS[variant]}
    cfg = build_config({"train": train, "learner": {"ranks": 2, "micro_batch_size": 4}})
    policy = shard_model(LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64), mesh)
    models = Models(policy, torch.optim.SGD(policy.parameters(), lr=1.0))
    if cfg.train.kl.coef > 0:
        reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float64).requires_grad_(False)
        models.reference = shard_model(reference, mesh)
        with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
            for p in models.policy.parameters():
                p.add_(0.05 * torch.ones_like(p))
    if cfg.train.advantage.name == "gae":
        models.critic = shard_model(ValueModel(model_dir, dtype=torch.float64), mesh)
        models.critic_optimizer = torch.optim.SGD(models.critic.parameters(), lr=1.0)
    before = full_state(models)
    groups = synthetic_groups(4, 4, seed=1) if rank == 0 else None
    if groups is not None and variant == "ppo-flat":
        for g in groups[2:]:  # with 2 ranks, rank 1's share
            g.rewards[:] = g.rewards[0]
    local = scatter_batch(groups, 0, rank, world, cfg.train.minibatches, torch.device("cpu"))
    stats = train_step(cfg, models, local)
    out = {name: (after - before[name]).contiguous() for name, after in full_state(models).items()}
    if rank == 0:
        out["__loss__"] = torch.tensor([stats["loss/total"]], dtype=torch.float64)
        out["__stats__"] = torch.tensor([stats[k] for k in sorted(stats)], dtype=torch.float64)
        save_file(out, out_path)
    shutdown_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    exit_now(0)
