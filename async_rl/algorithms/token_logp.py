"""Log-probability of each chosen token, and optionally the entropy of its distribution,
from `[T, V]` logits at a sampling temperature, without the float32 `[T, V]` tensors.

The plain way (log_softmax of the float32 logits, gather, then exp * log for the
entropy) keeps several float32 `[T, V]` tensors alive at once: on a 152k vocabulary and
a 16k-token micro-batch each is 9 GiB, and autograd keeps the log_softmax for the
backward. Here the logits are read in chunks of rows, each chunk made float32 only while
it is used, and the backward recomputes the softmax from the saved logits (in their own
dtype) and the saved log-normalizers: memory is the logits, their gradient and one chunk.
Chunks also run faster on a CPU, where one fits in the cache.
Peers fuse the same computation (verl's chunked entropy and flash-attn cross-entropy,
Liger's fused linear cross-entropy); this is the unfused torch version.

With x = logits / temperature, lse = logsumexp(x), q = softmax(x), the chosen token t:
    logp_t = x_t - lse                       d logp_t / dx_j = [j = t] - q_j
    H      = -sum_j q_j log q_j = lse - sum_j q_j x_j
                                             dH / dx_j = -q_j (log q_j + H)
and d/dlogits = d/dx / temperature. Tokens with zero probability (a logit of -inf)
contribute 0 to H and its gradient: their log q is clamped to the lowest finite value
before it is multiplied by q = 0, as in entropy.py.
"""

from __future__ import annotations

import torch

# float32 bytes of one chunk of rows. On a CPU a chunk that stays in a core's L2 cache
# makes the chunk's several passes cheap, faster than one log_softmax over the whole
# tensor (docs/performance.md); on a GPU large chunks keep the kernel launches few.
CHUNK_BYTES = {"cpu": 1 << 21}
DEFAULT_CHUNK_BYTES = 1 << 27


def _rows_per_chunk(logits: torch.Tensor) -> int:
    return max(1, CHUNK_BYTES.get(logits.device.type, DEFAULT_CHUNK_BYTES) // (4 * logits.shape[-1]))


def _math_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """x = logits / temperature in at least float32, always a new tensor (updated in place)."""
    x = logits.to(_math_dtype(logits))
    return x / temperature if temperature != 1.0 else x.clone()


class _ChosenLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool):
        rows = logits.shape[0]
        dtype = _math_dtype(logits)
        logp = logits.new_empty(rows, dtype=dtype)
        entropy = logits.new_empty(rows, dtype=dtype) if with_entropy else None
        lse = logits.new_empty(rows, dtype=dtype)
        step = _rows_per_chunk(logits)
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            x = _scaled(logits[start:stop], temperature)
            lse_c = lse[start:stop] = torch.logsumexp(x, dim=-1)
            logp[start:stop] = x.gather(-1, targets[start:stop, None]).squeeze(-1) - lse_c
            if with_entropy:
                x.sub_(lse_c[:, None])  # log q
                q = x.exp()
                entropy[start:stop] = -(q * x.clamp_(min=torch.finfo(x.dtype).min)).sum(dim=-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        step = _rows_per_chunk(logits)
        for start in range(0, logits.shape[0], step):
            stop = min(logits.shape[0], start + step)
            x = _scaled(logits[start:stop], t).sub_(lse[start:stop, None])  # log q
            q = x.exp()
            g_logp = grad_logp[start:stop, None] if grad_logp is not None else None
            g = -q * g_logp if g_logp is not None else torch.zeros_like(q)
            if g_logp is not None:
                g.scatter_add_(-1, targets[start:stop, None], g_logp)
            if grad_entropy is not None:
                x.clamp_(min=torch.finfo(x.dtype).min)
                h = -(q * x).sum(dim=-1, keepdim=True)
                g.sub_(grad_entropy[start:stop, None] * q * (x + h))
            grad[start:stop] = g / t if t != 1.0 else g
        return grad, None, None, None


def chosen_logp(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[..., V]` logits and `[...]` chosen token ids -> `[...]` log-probs of the chosen
    tokens under softmax(logits / temperature), and the entropies of those distributions
    when `entropy` (else None); both differentiable w.r.t. the logits, and float32 (float64
    for float64 logits)."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    # reshape copies a non-contiguous input; callers pass contiguous logits to avoid it.
    logp, ent = _ChosenLogp.apply(logits.reshape(-1, vocab), targets.reshape(-1), float(temperature), entropy)
    return logp.view(lead), ent.view(lead) if ent is not None else None
