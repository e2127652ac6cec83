"""Give each learner rank its prompt groups and turn them into its padded token rows.

Row layout (one row per response): `prompt ++ response ++ pad`. Token-level tensors
that score predictions (`loss_mask`, `logp_behav`) have length L-1: position t holds
the prediction of token t+1, matching `logits[:, :-1]`.
Rank 0 sends every other rank its whole groups in the sample format (ragged, as they
came from the actors) and keeps its own; each rank builds its own rows. Every rank gets whole groups because
`batch_groups` is a multiple of the learner world size, so group advantages can be
computed on each rank (see step.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from async_rl.wire import ExperienceGroup, decode, encode

T = TypeVar("T")


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
    # float32 [N, L-1]: each step's reward at the position predicting the step's last
    # token, NaN elsewhere; a response that names no steps has one, its reward at its
    # last policy token (process rewards, algorithms/advantages.py).
    step_rewards: torch.Tensor

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    def take(self, index: torch.Tensor | slice) -> Batch:
        """The rows at `index` (int64 row numbers, in that order, or a slice)."""
        return Batch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def build_batch(groups, pad_id: int) -> Batch:
    """The learner's rows of `groups` (ExperienceGroup messages): the one conversion
    from the ragged sample format to the padded row layout. Only the policy's tokens
    are scored (`loss_mask`); an environment's tokens in a multi-turn response are
    context."""
    rows, excluded = [], []
    for g_index, g in enumerate(groups):
        prompt = np.asarray(g.prompt_tokens, dtype=np.int64)
        left_out = unscorable(g)
        for j, response in enumerate(g.responses()):
            rows.append((prompt, response, float(g.rewards[j]), g_index, g.greedy_reward, int(g.truncated[j])))
            excluded.append(bool(left_out[j]))
    N = len(rows)
    L = max(len(p) + len(r.tokens) for p, r, *_ in rows)
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
    step_rewards = np.full((N, L - 1), np.nan, dtype=np.float32)
    for i, (prompt, resp, reward, g_index, greedy_reward, cut) in enumerate(rows):
        P, R = len(prompt), len(resp.tokens)
        tokens[i, :P] = prompt
        tokens[i, P:P + R] = resp.tokens
        attention[i, :P + R] = 1
        # Response token k sits at position P+k and is predicted at position P+k-1.
        loss_mask[i, P - 1:P - 1 + R] = 1.0 if resp.policy_mask is None else resp.policy_mask
        logp_behav[i, P - 1:P - 1 + R] = resp.logprobs
        rewards[i], group[i], prompt_len[i], truncated[i] = reward, g_index, P, cut
        if greedy_reward is not None:
            baselines[i] = greedy_reward
        if resp.step_ends is not None:
            step_rewards[i, P - 1 + resp.step_ends] = resp.step_rewards
        elif R:
            scored = np.flatnonzero(loss_mask[i])
            if scored.size:
                step_rewards[i, scored[-1]] = reward
    # Unscorable samples train nothing and take no part in their group's statistics: no
    # loss tokens, and a group id of their own (a group of one has advantage 0).
    for i in np.flatnonzero(excluded):
        loss_mask[i] = 0.0
        rewards[i], group[i] = 0.0, len(groups) + i
        step_rewards[i] = np.nan
    t = torch.from_numpy
    return Batch(t(tokens), t(attention), t(loss_mask), t(logp_behav), t(rewards), t(baselines), t(group),
                 t(prompt_len), t(truncated), t(step_rewards))


def unscorable(group: ExperienceGroup) -> np.ndarray:
    """The samples of `group` the learner leaves out (bool [G]): those whose reward or
    environment failed (reward.on_failure=exclude), and all of them when fewer than two
    are left, which leave nothing to compare (the group is dropped)."""
    flags = np.zeros(len(group.rewards), dtype=bool)
    if len(group.unscorable):
        flags = group.unscorable.astype(bool)
        if len(flags) - flags.sum() < 2:
            flags[:] = True
    return flags


def assign_to_ranks(groups: Sequence[T], world: int, minibatches: int) -> list[list[T]]:
    """Whole groups for each rank, in the order that gives every rank, in its k-th slice,
    its share of global minibatch k = the k-th run of consecutive groups (admission
    order). The optimizer steps then see the same groups whatever the number of
    learner ranks."""
    per_mb = len(groups) // minibatches
    per_rank = per_mb // world
    return [[groups[k * per_mb + r * per_rank + i] for k in range(minibatches) for i in range(per_rank)]
            for r in range(world)]


_SHARE_ENCODER = msgspec.msgpack.Encoder()
_SHARE_DECODER = msgspec.msgpack.Decoder(list[list[bytes]])  # each group's wire frames


def encode_share(groups: Sequence[ExperienceGroup]) -> bytes:
    """One rank's groups as bytes: each group's wire frames (nothing pickled)."""
    return _SHARE_ENCODER.encode([encode(g) for g in groups])


def decode_share(data: bytes) -> list[ExperienceGroup]:
    """encode_share's groups, each validated like any received message."""
    return [decode(frames) for frames in _SHARE_DECODER.decode(data)]


def scatter_batch(groups: Sequence[ExperienceGroup] | None, pad_id: int, rank: int, world: int, minibatches: int,
                  device: torch.device) -> Batch:
    """Rank 0 passes the step's groups (admission order) and the pad id, the others None
    and anything: every rank returns the rows of its own groups (assign_to_ranks) on
    `device`, padded to its own longest. The other ranks' groups travel in the sample
    format, one byte tensor per rank (encode_share); rank 0 keeps its own as they are
    (NCCL collectives need CUDA tensors, gloo takes CPU ones)."""
    shares = assign_to_ranks(groups, world, minibatches) if rank == 0 else None
    if world == 1:
        return build_batch(shares[0], pad_id).to(device)
    header = torch.zeros(world + 1, dtype=torch.int64, device=device)  # pad id, then bytes per rank
    blobs = None
    if rank == 0:
        blobs = [b""] + [encode_share(share) for share in shares[1:]]
        header[0] = pad_id
        header[1:] = torch.tensor([len(blob) for blob in blobs])
    dist.broadcast(header, src=0)
    sizes = header[1:].tolist()
    width = max(sizes)
    local = torch.empty(width, dtype=torch.uint8, device=device)
    chunks = None
    if rank == 0:
        chunks = [torch.frombuffer(bytearray(blob.ljust(width, b"\0")), dtype=torch.uint8).to(device)
                  for blob in blobs]
    dist.scatter(local, chunks, src=0)
    mine = shares[0] if rank == 0 else decode_share(local[:sizes[rank]].cpu().numpy().tobytes())
    return build_batch(mine, int(header[0])).to(device)
