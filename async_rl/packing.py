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
positions: log-probs agree to float rounding (tests/test_learner_efficiency.py).

Row capacity. sdpa and eager materialize that mask and do not skip the masked
blocks, so a packed row of C tokens costs O(C^2) attention however many sequences it
holds. Rows are therefore as long as the micro-batch's longest sequence (never more
attention work than the padded forward) unless `learner.pack_row_tokens` asks for
longer ones; with flash-attention (varlen, cost sum(len^2)) one row holds all.

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

from .batching import Batch


def micro_batches(attention: torch.Tensor, start: int, stop: int, group_size: int, rows: int,
                  tokens: int | None, pack: bool) -> list[tuple[int, int]]:
    """[start, stop) cut into (start, stop) micro-batches of whole groups: `rows` rows
    each (a multiple of group_size), or, with a token budget, as many groups as fit
    it (at least one)."""
    if tokens is None:
        return [(s, min(s + rows, stop)) for s in range(start, stop, rows)]
    lengths = attention[start:stop].sum(-1).tolist()
    out, first, used, width = [], start, 0, 0
    for g in range(start, stop, group_size):
        glen = lengths[g - start:g - start + group_size]
        # Padded forwards compute rows x longest row; packed ones only real tokens.
        cost = (used + sum(glen)) if pack else (g + group_size - first) * max(width, *glen)
        if g > first and cost > tokens:
            out.append((first, g))
            first, used, width = g, 0, 0
        used, width = used + sum(glen), max(width, *glen)
    out.append((first, stop))
    return out


@dataclass
class Packed:
    tokens: torch.Tensor     # int64 [R, C] sequences end to end, pad id in the tails
    positions: torch.Tensor  # int64 [R, C] restarting at 0 per sequence (and per tail)
    keep: torch.Tensor       # int64 [K] columns whose logits are needed
    source: torch.Tensor     # int64 [T] flat index into the [R, K] kept logits, per scored token
    need: torch.Tensor       # bool [n, L-1] the scored positions of the padded layout
    targets: torch.Tensor    # int64 [T] the token each scored position predicts


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


def pack(batch: Batch, pad_id: int = 0, row_tokens: int | None = None, one_row: bool = False) -> Packed:
    """Lay the micro-batch's sequences (right-padded rows) out in packed rows."""
    n, L = batch.tokens.shape
    dev = batch.tokens.device
    lengths = batch.attention.sum(-1)
    len_list = lengths.tolist()
    total = max(sum(len_list), 1)
    # Never longer than all the tokens: a longer row would only add tail padding.
    capacity = total if one_row else max(max(len_list), min(row_tokens or 0, total), 1)
    row, offset, used = _first_fit_decreasing(len_list, capacity)
    R = len(used)
    start = torch.from_numpy(row * capacity + offset).to(dev)          # flat start of each sequence
    cols = torch.arange(L, device=dev)
    dest = start[:, None] + cols[None, :]                                # [n, L] flat packed index
    real = cols[None, :] < lengths[:, None]
    tokens = torch.full((R * capacity,), pad_id, dtype=torch.long, device=dev)
    tokens[dest[real]] = batch.tokens[real]
    # Tails count from 0 too: a pseudo-sequence of padding that attends only to itself.
    positions = (torch.arange(capacity, device=dev)[None, :] - torch.from_numpy(used).to(dev)[:, None]).reshape(-1)
    positions[dest[real]] = cols.expand(n, L)[real]
    need = batch.loss_mask > 0
    flat = dest[:, :-1][need]                                            # packed position predicting each target
    keep, col = torch.unique(flat % capacity, return_inverse=True)
    return Packed(tokens.view(R, capacity), positions.view(R, capacity).clamp(min=0), keep,
                  (flat // capacity) * keep.numel() + col, need, batch.tokens[:, 1:][need])


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def packed_logits(model, batch: Batch, row_tokens: int | None = None) -> tuple[torch.Tensor, Packed]:
    """[T, V] logits at the scored positions (response predictors), and the layout."""
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    p = pack(batch, row_tokens=row_tokens, one_row="flash" in attn)
    kwargs = {"logits_to_keep": p.keep} if _accepts_logits_to_keep(model) else {}
    # use_cache=False: with a KV cache, create_causal_mask does not look for packed sequences.
    logits = model(input_ids=p.tokens, position_ids=p.positions, attention_mask=None, use_cache=False,
                   **kwargs).logits
    if not kwargs:
        logits = logits[:, p.keep]
    return logits.reshape(-1, logits.shape[-1])[p.source], p


def scatter_scored(values: torch.Tensor, p: Packed) -> torch.Tensor:
    """[T] values at the scored positions -> the padded [n, L-1] layout, 0 elsewhere (differentiable)."""
    out = values.new_zeros(p.need.shape)
    return out.masked_scatter(p.need, values)


@torch.no_grad()
def packing_error(model) -> float:
    """Max |logit difference| between a padded and a packed forward of two short random
    sequences sharing one packed row. Packing is only sound where the architecture builds
    its attention mask with transformers' `create_causal_mask` (packed-sequence aware);
    one whose layers carry state across tokens by other means (linear attention,
    recurrent/Mamba layers, custom masks) would leak across the boundary. Run once on the
    unsharded fp32 model, where a leak (~1e-2) stands far above rounding (~1e-6)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = int(getattr(model.config, "vocab_size", 16))
    lengths = (5, 7)
    tokens = torch.zeros(2, max(lengths), dtype=torch.long)
    attention = torch.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(0, vocab, (n,), generator=gen)
        attention[i, :n] = 1
    tokens, attention = tokens.to(device), attention.to(device)
    padded = model(input_ids=tokens, attention_mask=attention, use_cache=False).logits.float()
    row = torch.cat([tokens[i, :n] for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    packed = model(input_ids=row, position_ids=positions, attention_mask=None, use_cache=False).logits.float()[0]
    model.train(was_training)
    return float((torch.cat([padded[i, :n] for i, n in enumerate(lengths)]) - packed).abs().max())
