"""chosen_logp against the plain float64 log_softmax / entropy, chunked or not."""

import pytest
import torch

from async_rl.algorithms import token_logp
from async_rl.algorithms.token_logp import chosen_logp


def reference(logits, targets, temperature):
    logq = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logq.gather(-1, targets[..., None]).squeeze(-1), -(logq.exp() * logq).sum(-1)


@pytest.fixture(params=[3, None], ids=["chunks-of-3-rows", "one-chunk"])
def chunk_rows(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(token_logp, "CHUNK_BYTES", {"cpu": 4 * 11 * request.param})


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    assert float((got.detach().double() - want.detach().double()).abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_log_softmax(chunk_rows, dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 5, 11, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(0, 11, (4, 5), generator=gen)
    w_logp, w_ent = torch.randn(4, 5, generator=gen).double(), torch.randn(4, 5, generator=gen).double()

    logp, ent = chosen_logp(logits, targets, temperature, entropy=True)
    ref_logp, ref_ent = reference(logits, targets, temperature)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Log-probs and entropies are differences of terms as large as the scaled logits: a
    # few epsilons of the math dtype (float32 for a bfloat16 input) at that scale.
    eps = torch.finfo(logp.dtype).eps
    scale = float((logits.detach().double() / temperature).abs().max())
    assert_within(logp, ref_logp, 16 * eps * scale)
    assert_within(ent, ref_ent, 16 * eps * scale)

    w_max = float(torch.cat([w_logp, w_ent]).abs().max())
    for with_entropy in (True, False):
        logp, ent = chosen_logp(logits, targets, temperature, entropy=with_entropy)
        loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if with_entropy else 0)
        ref = (ref_logp * w_logp).sum() + ((ref_ent * w_ent).sum() if with_entropy else 0)
        (grad,) = torch.autograd.grad(loss, logits)
        (ref_grad,) = torch.autograd.grad(ref, logits, retain_graph=True)
        assert grad.dtype == dtype
        # The same rounding times the loss weights, and each gradient rounded once to the
        # logits' dtype (bfloat16 keeps 8 bits).
        bound = 16 * eps * scale * w_max + torch.finfo(dtype).eps * float(ref_grad.abs().max())
        assert_within(grad, ref_grad, bound)


def test_gradcheck_in_float64(chunk_rows):
    logits = torch.randn(7, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    assert torch.autograd.gradcheck(lambda x: chosen_logp(x, targets, 0.7, entropy=True), (logits,))


def test_impossible_tokens_add_nothing_and_make_no_nan():
    logits = torch.tensor([[0.0, 0.0, -float("inf"), 0.0]], requires_grad=True)
    logp, ent = chosen_logp(logits, torch.tensor([1]), entropy=True)
    (logp.sum() + ent.sum()).backward()
    torch.testing.assert_close(ent, torch.tensor([torch.log(torch.tensor(3.0))]))
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0


def test_backward_keeps_only_the_logits_and_a_value_per_row():
    """The memory claim: autograd saves the logits themselves (no float32 copy of a
    bf16 input, no [T, V] softmax) and per-row figures."""
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chosen_logp(logits, torch.zeros(rows, dtype=torch.long), 0.7, entropy=True)
    big = [t for t in saved if t.numel() >= rows * vocab]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t.numel() < rows * vocab) <= 2 * rows
