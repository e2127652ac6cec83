"""Micro-batch planning and padding-free ("packed") policy forwards for the learner.

Micro-batches. A micro-batch is a run of whole prompt groups (OPMD's per-group loss
and the group-relative statistics need every response of a group together), either a
fixed number of rows (`learner.micro_batch_size`) or as many groups as fit a token
budget (`learner.micro_batch_tokens`): real tokens when packing, rows x longest row
when padding (what the forward actually computes).

Packing. The sequences of a micro-batch are laid end to end in a few rows, first-fit
decreasing, with `position_ids` restarting at 0 for every sequence and no attention
mask. transformers 5 (`masking_utils.find_packed_sequence_indices`, called from
`create_causal_mask` when `attention_mask is None` and there is no KV cache) reads
the restarts as sequence boundaries and builds a block-diagonal causal mask for
sdpa/eager; flash-attention's varlen path reads the same position_ids. So each
token sees exactly the prefix it sees in the padded forward, and RoPE gets the same
positions: log-probs agree to float rounding (tests/unit/test_packing.py). Each
micro-batch is laid out once per step (`layout`), and every forward over it
(proximal, reference, policy) uses that layout.

Row capacity. sdpa and eager materialize that mask and do not skip the masked
blocks, so a packed row of C tokens costs O(C^2) attention however many sequences it
holds. Rows are therefore as long as the micro-batch's longest sequence (never more
attention work than the padded forward) unless `learner.pack_row_tokens` asks for
longer ones; with flash-attention (varlen, cost sum(len^2)) one row holds all.

Shared prompts (`learner.share_prompt`, sdpa/eager attention). The G responses of a
group share one prompt, and in RL fine-tuning of chat models the prompt (template,
system turn, question) is often longer than a response: G copies of it are most of
the batch's tokens. So each group is laid out once as a tree, `prompt r_1 ... r_G`,
with the positions each token has in its own padded row (r_j continues after the
prompt) and a custom 4-D attention mask (transformers passes one through as is):
a token sees the prompt and the earlier tokens of its own response, nothing else.
Every response token then sees exactly what it sees in its padded row, so log-probs
and gradients are those of the padded forward (the prompt's activations receive the
gradients of all G responses, which is what the G copies receive in sum), at the cost
of P + sum(R_j) tokens per group instead of G * P + sum(R_j). The one token that
predicts every response's first token is the prompt's last: its logits are used G
times.

Only the positions that predict a response token reach the vocabulary projection
(`logits_to_keep`) and the log-softmax: on a 150k vocabulary the [tokens, V] logits
are the largest activation of the step. Log-probs elsewhere are 0; every consumer
masks them (they are finite garbage in the padded path too).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from async_rl.learner.batching import Batch


def micro_batches(attention: torch.Tensor, start: int, stop: int, group_size: int, rows: int,
                  tokens: int | None, pack: bool, prompt_len: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """[start, stop) cut into (start, stop) micro-batches of whole groups: `rows` rows
    each (a multiple of group_size), or, with a token budget, as many groups as fit
    it (at least one). `prompt_len` (packed, shared prompts): a group's prompt counts once."""
    if tokens is None:
        return [(s, min(s + rows, stop)) for s in range(start, stop, rows)]
    lengths = attention[start:stop].sum(-1).tolist()
    shared = [0] * (stop - start) if prompt_len is None else prompt_len[start:stop].tolist()
    out, first, used, width = [], start, 0, 0
    for g in range(start, stop, group_size):
        glen = lengths[g - start:g - start + group_size]
        real = sum(glen) - (group_size - 1) * shared[g - start]
        # Padded forwards compute rows x longest row; packed ones only real tokens.
        cost = (used + real) if pack else (g + group_size - first) * max(width, *glen)
        if g > first and cost > tokens:
            out.append((first, g))
            first, used, width = g, 0, 0
        used, width = used + real, max(width, *glen)
    out.append((first, stop))
    return out


@dataclass
class Packed:
    """A micro-batch's packed layout, made once per step and used by each of its forwards
    (proximal, reference, policy)."""

    tokens: torch.Tensor     # int64 [R, C] sequences end to end, pad id in the tails
    positions: torch.Tensor  # int64 [R, C] restarting at 0 per sequence (and per tail)
    keep: torch.Tensor       # int64 [K] columns whose logits are needed
    source: torch.Tensor     # int64 [T] flat index into the [R, K] kept logits, per scored token
    need: torch.Tensor       # bool [n, L-1] the scored positions of the padded layout
    targets: torch.Tensor    # int64 [T] the token each scored position predicts
    tree: torch.Tensor | None = None  # int64 [R, C] shared prompts: each position's group, -1 in tails
    part: torch.Tensor | None = None  # int64 [R, C] 0 = the prompt, j + 1 = response j, -1 in tails

    def attention_mask(self, additive: bool = False) -> torch.Tensor | None:
        """Shared prompts: [R, 1, C, C], causal within one tree, where a response sees its
        prompt and itself (True = attends; `additive`: eager's 0 / -inf form). Built for
        each forward from the [R, C] ids: only one micro-batch's O(C^2) mask is alive."""
        if self.tree is None:
            return None
        C = self.tree.shape[1]
        idx = torch.arange(C, device=self.tree.device)
        causal = idx[None, :] <= idx[:, None]
        tree, part = self.tree, self.part
        same_tree = (tree[:, :, None] == tree[:, None, :]) & (tree[:, :, None] >= 0)
        sees = (part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :])
        # Padding attends to itself only: every query row needs one key, or softmax is 0/0.
        mask = ((causal[None] & same_tree & sees) | torch.eye(C, dtype=torch.bool, device=tree.device)[None])[:, None]
        if not additive:
            return mask
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)


def _first_fit_decreasing(lengths: list[int], capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, offset) per sequence and each row's used length."""
    row, offset = np.zeros(len(lengths), np.int64), np.zeros(len(lengths), np.int64)
    free = np.zeros(0, np.int64)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = np.flatnonzero(free >= lengths[i])
        r = int(fits[0]) if fits.size else len(free)
        if r == len(free):
            free = np.append(free, capacity)
        row[i], offset[i] = r, capacity - free[r]
        free[r] -= lengths[i]
    return row, offset, capacity - free


def pack(batch: Batch, pad_id: int = 0, row_tokens: int | None = None, one_row: bool = False,
         group_size: int | None = None) -> Packed:
    """Lay the micro-batch's sequences (right-padded rows) out in packed rows; with
    `group_size`, each run of that many rows (one group, one prompt) as one tree."""
    n, L = batch.tokens.shape
    dev = batch.tokens.device
    lengths = batch.attention.sum(-1)
    cols = torch.arange(L, device=dev)
    real = cols[None, :] < lengths[:, None]
    if group_size is None:  # every row its own sequence, placed whole
        units, within, prompt = lengths.tolist(), torch.zeros(n, dtype=torch.long, device=dev), None
    else:
        prompt = batch.prompt_len
        resp = lengths - prompt
        groups = resp.view(-1, group_size)
        # A response starts after its group's prompt and the responses before it.
        within = (groups.cumsum(-1) - groups).reshape(-1)
        units = (prompt.view(-1, group_size)[:, 0] + groups.sum(-1)).tolist()
    total = max(sum(units), 1)
    # Never longer than all the tokens: a longer row would only add tail padding.
    capacity = total if one_row else max(max(units), min(row_tokens or 0, total), 1)
    row, offset, used = _first_fit_decreasing(units, capacity)
    R = len(used)
    unit_start = torch.from_numpy(row * capacity + offset).to(dev)     # flat start of each sequence or tree
    start = unit_start if group_size is None else unit_start.repeat_interleave(group_size)
    # Flat packed index of every padded (row, col): a prompt column lands on its group's
    # one copy of the prompt, a response column after the responses before it.
    shift = within if prompt is None else torch.where(cols[None, :] < prompt[:, None], 0, within[:, None])
    dest = start[:, None] + cols[None, :] + (shift if shift.dim() == 2 else shift[:, None])  # [n, L]
    tokens = torch.full((R * capacity,), pad_id, dtype=torch.long, device=dev)
    tokens[dest[real]] = batch.tokens[real]
    # Tails count from 0 too: a pseudo-sequence of padding that attends only to itself.
    positions = (torch.arange(capacity, device=dev)[None, :] - torch.from_numpy(used).to(dev)[:, None]).reshape(-1)
    positions[dest[real]] = cols.expand(n, L)[real]
    need = batch.loss_mask > 0
    flat = dest[:, :-1][need]                                            # packed position predicting each target
    keep, col = torch.unique(flat % capacity, return_inverse=True)
    tree, part = (None, None) if prompt is None else _tree_ids(dest, real, prompt, group_size, R, capacity)
    return Packed(tokens.view(R, capacity), positions.view(R, capacity).clamp(min=0), keep,
                  (flat // capacity) * keep.numel() + col, need, batch.tokens[:, 1:][need], tree, part)


def _tree_ids(dest: torch.Tensor, real: torch.Tensor, prompt: torch.Tensor, group_size: int, R: int,
              capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed position [R, C]: its tree (group) and its part of the tree (0 = prompt,
    j + 1 = response j); -1 in the tails."""
    n, L = dest.shape
    dev = dest.device
    tree = torch.full((R * capacity,), -1, dtype=torch.long, device=dev)
    part = torch.full((R * capacity,), -1, dtype=torch.long, device=dev)
    row_tree = torch.arange(n, device=dev) // group_size
    row_part = torch.arange(n, device=dev) % group_size + 1
    in_prompt = torch.arange(L, device=dev)[None, :] < prompt[:, None]
    tree[dest[real]] = row_tree[:, None].expand(n, L)[real]
    part[dest[real]] = torch.where(in_prompt, 0, row_part[:, None]).expand(n, L)[real]
    return tree.view(R, capacity), part.view(R, capacity)


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def attention_kind(model) -> str:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or ""


def shares_prompt(model) -> bool:
    """Shared-prompt trees need a custom mask: sdpa and eager take one, flash-attention does not."""
    return attention_kind(model) in ("sdpa", "eager")


def layout(model, batch: Batch, row_tokens: int | None = None, group_size: int | None = None) -> Packed:
    """The packed layout of `batch` for `model`'s attention (flash-attention: one row);
    `group_size`: shared-prompt trees (sdpa/eager only, see shares_prompt)."""
    return pack(batch, row_tokens=row_tokens, one_row="flash" in attention_kind(model), group_size=group_size)


def packed_logits(model, p: Packed) -> torch.Tensor:
    """[T, V] logits at the scored positions (response predictors) of layout `p`."""
    kwargs = {"logits_to_keep": p.keep} if _accepts_logits_to_keep(model) else {}
    # use_cache=False: with a KV cache, create_causal_mask does not look for packed sequences.
    logits = model(input_ids=p.tokens, position_ids=p.positions, use_cache=False, **kwargs,
                   attention_mask=p.attention_mask(additive=attention_kind(model) == "eager")).logits
    if not kwargs:
        logits = logits[:, p.keep]
    return logits.reshape(-1, logits.shape[-1])[p.source]


def scatter_scored(values: torch.Tensor, p: Packed) -> torch.Tensor:
    """[T] values at the scored positions -> the padded [n, L-1] layout, 0 elsewhere (differentiable)."""
    out = values.new_zeros(p.need.shape)
    return out.masked_scatter(p.need, values)


@torch.no_grad()
def packing_error(model, shared: bool = False) -> float:
    """Max |logit difference| at the scored positions between the padded forward and the
    packed one, on two groups of two short random responses, all in one packed row.
    Packing is only sound where the architecture builds its attention from transformers'
    mask (packed-sequence aware) or, `shared` (shared prompts), honours a custom
    4-D mask; one whose layers carry state across tokens by other means (linear attention,
    recurrent/Mamba layers, sliding windows with masks of their own) would leak across
    the boundaries. Run once on the unsharded fp32 model, where a leak (~1e-2) stands far
    above rounding (~1e-6)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = int(getattr(model.config, "vocab_size", 16))
    prompts, responses = (3, 3, 5, 5), (2, 4, 3, 1)  # rows 0-1 and 2-3 share a prompt
    group_prompts = [torch.randint(0, vocab, (5,), generator=gen) for _ in range(2)]
    n, L = len(prompts), max(p + r for p, r in zip(prompts, responses))
    batch = Batch(tokens=torch.zeros(n, L, dtype=torch.long), attention=torch.zeros(n, L, dtype=torch.long),
                  loss_mask=torch.zeros(n, L - 1), logp_behav=torch.zeros(n, L - 1), rewards=torch.zeros(n),
                  baselines=torch.zeros(n), group=torch.tensor([0, 0, 1, 1]), prompt_len=torch.tensor(prompts),
                  truncated=torch.zeros(n, dtype=torch.long), step_rewards=torch.full((n, L - 1), float("nan")))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        batch.tokens[i, :p] = group_prompts[i // 2][:p]
        batch.tokens[i, p:p + r] = torch.randint(0, vocab, (r,), generator=gen)
        batch.attention[i, :p + r] = 1
        batch.loss_mask[i, p - 1:p - 1 + r] = 1.0
    batch = batch.to(device)
    padded = model(input_ids=batch.tokens, attention_mask=batch.attention, use_cache=False).logits[:, :-1]
    p = layout(model, batch, row_tokens=10**6, group_size=2 if shared else None)
    packed = packed_logits(model, p)
    model.train(was_training)
    return float((padded[p.need].float() - packed.float()).abs().max())
