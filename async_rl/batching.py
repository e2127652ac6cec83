"""Turn prompt groups into padded token tensors and scatter them to learner ranks.

Row layout (one row per response): `prompt ++ response ++ pad`. Token-level tensors
that score predictions (`loss_mask`, `logp_behav`) have length L-1: position t holds
the prediction of token t+1, matching `logits[:, :-1]`.
Rank 0 builds the whole batch, then scatters equal row blocks; every rank gets whole
groups because `batch_groups` is a multiple of the learner world size, so group
advantages can be computed on each rank (see train_step.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Batch:
    tokens: torch.Tensor       # int64 [N, L]
    attention: torch.Tensor    # int64 [N, L]
    loss_mask: torch.Tensor    # float32 [N, L-1]
    logp_behav: torch.Tensor   # float32 [N, L-1]
    rewards: torch.Tensor      # float32 [N]
    baselines: torch.Tensor    # float32 [N], ReMax greedy-response reward (NaN when not computed)
    group: torch.Tensor        # int64 [N], group index within the batch
    prompt_len: torch.Tensor   # int64 [N], prompt tokens at the start of the row
    truncated: torch.Tensor    # int64 [N], 1 = the response was cut at the length limit

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


def build_batch(groups, pad_id: int) -> Batch:
    """The learner's rows of `groups` (ExperienceGroup messages): the one conversion
    from the ragged sample format to the padded row layout."""
    rows = []
    for g_index, g in enumerate(groups):
        prompt = np.asarray(g.prompt_tokens, dtype=np.int64)
        for j, response in enumerate(g.responses()):
            rows.append((prompt, response.tokens.astype(np.int64), response.logprobs,
                         float(g.rewards[j]), g_index, g.greedy_reward, int(g.truncated[j])))
    N = len(rows)
    L = max(len(p) + len(r) for p, r, *_ in rows)
    L = max(L, 2)
    tokens = np.full((N, L), pad_id, dtype=np.int64)
    attention = np.zeros((N, L), dtype=np.int64)
    loss_mask = np.zeros((N, L - 1), dtype=np.float32)
    logp_behav = np.zeros((N, L - 1), dtype=np.float32)
    rewards = np.zeros(N, dtype=np.float32)
    baselines = np.full(N, np.nan, dtype=np.float32)
    group = np.zeros(N, dtype=np.int64)
    prompt_len = np.zeros(N, dtype=np.int64)
    truncated = np.zeros(N, dtype=np.int64)
    for i, (prompt, resp, lp, reward, g_index, greedy_reward, cut) in enumerate(rows):
        P, R = len(prompt), len(resp)
        tokens[i, :P] = prompt
        tokens[i, P:P + R] = resp
        attention[i, :P + R] = 1
        # Response token k sits at position P+k and is predicted at position P+k-1.
        loss_mask[i, P - 1:P - 1 + R] = 1.0
        logp_behav[i, P - 1:P - 1 + R] = lp
        rewards[i], group[i], prompt_len[i], truncated[i] = reward, g_index, P, cut
        if greedy_reward is not None:
            baselines[i] = greedy_reward
    t = torch.from_numpy
    return Batch(t(tokens), t(attention), t(loss_mask), t(logp_behav), t(rewards), t(baselines), t(group),
                 t(prompt_len), t(truncated))


def order_for_ranks(batch: Batch, group_size: int, world: int, minibatches: int) -> Batch:
    """Permute whole groups so that scattering equal row blocks gives every rank, in
    its k-th slice, its share of global minibatch k = the k-th run of consecutive
    groups (admission order). The optimizer steps then see the same groups whatever
    the number of learner ranks."""
    n_groups = batch.tokens.shape[0] // group_size
    per_mb = n_groups // minibatches
    per_rank = per_mb // world
    order = [k * per_mb + r * per_rank + i for r in range(world) for k in range(minibatches) for i in range(per_rank)]
    rows = torch.tensor([g * group_size + j for g in order for j in range(group_size)])
    return Batch(**{f.name: getattr(batch, f.name)[rows] for f in fields(batch)})


def scatter_batch(batch: Batch | None, rank: int, world: int, device: torch.device) -> Batch:
    """Rank 0 passes the full batch, others None; every rank returns its row block on `device`
    (NCCL collectives need CUDA tensors, gloo takes CPU ones)."""
    header = torch.zeros(2, dtype=torch.int64, device=device)
    if rank == 0:
        assert batch is not None
        header[0], header[1] = batch.tokens.shape
    dist.broadcast(header, src=0)
    N, L = int(header[0]), int(header[1])
    per_rank = N // world
    shapes = {"tokens": (L,), "attention": (L,), "loss_mask": (L - 1,), "logp_behav": (L - 1,),
              "rewards": (), "baselines": (), "group": (), "prompt_len": (), "truncated": ()}
    dtypes = {"tokens": torch.int64, "attention": torch.int64, "group": torch.int64, "prompt_len": torch.int64,
              "truncated": torch.int64}
    out = {}
    for name, tail in shapes.items():
        local = torch.empty((per_rank, *tail), dtype=dtypes.get(name, torch.float32), device=device)
        chunks = list(getattr(batch, name).to(device).contiguous().split(per_rank)) if rank == 0 else None
        dist.scatter(local, chunks, src=0)
        out[name] = local
    return Batch(**out)
