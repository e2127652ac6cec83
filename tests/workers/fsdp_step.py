"""torchrun worker: one learner train_step on a fixed synthetic batch; writes the updated
full parameters. Run with 1 and with 2 ranks; FSDP2 must give the same result."""
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

from async_rl import algorithms
from async_rl.batching import build_batch, scatter_batch
from async_rl.config import build_config
from async_rl.runtime import exit_now
from async_rl.roles.learner import full_parameters, global_denominator, shard_model, shutdown_world, train_step


def synthetic_groups(n_groups: int, G: int, seed: int):
    rng = np.random.default_rng(seed)
    groups = []
    for _ in range(n_groups):
        P = int(rng.integers(3, 7))
        T = int(rng.integers(2, 6))
        lengths = rng.integers(1, T + 1, size=G).astype(np.int32)
        groups.append(SimpleNamespace(
            prompt_tokens=rng.integers(3, 16, size=P).astype(np.int32),
            response_tokens=rng.integers(3, 16, size=(G, T)).astype(np.int32),
            response_lengths=lengths,
            logprobs=(-rng.random((G, T)) * 3).astype(np.float32),
            rewards=rng.integers(0, 2, size=G).astype(np.float32)))
    return groups


def main(out_path: str, loss: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True))
    cfg = build_config({"train": {"loss": loss, "batch_groups": 4, "group_size": 4, "grad_clip": 1e9},
                        "learner": {"ranks": 2, "micro_batch_size": 4}})
    model = shard_model(model, init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    batch, denom = None, torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        groups = synthetic_groups(4, 4, seed=1)
        batch = build_batch(groups, pad_id=0)
        batch.advantages = algorithms.group_advantages(batch.rewards, batch.group, method="grpo")
        denom[0] = global_denominator(cfg, batch, len(groups))
    dist.broadcast(denom, src=0)
    local = scatter_batch(batch, rank, world, torch.device("cpu"))
    stats = train_step(cfg, model, optimizer, local, float(denom), world)
    params = {name: t.clone().contiguous() for name, t in full_parameters(model)}
    if rank == 0:
        params["__loss__"] = torch.tensor([stats["loss/total"]])
        save_file(params, out_path)
    shutdown_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_now(0)
