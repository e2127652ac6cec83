"""packing.py: packed micro-batches give the padded log-probs, the shared-prompt layout
counts each prompt once with the same gradients, models that would leak across packed
sequences are caught, and micro-batches are whole groups within the token budget.
(The full train_step, packed vs padded on 2 FSDP2 ranks: tests/integration/test_learner_variants.py.)"""

import pytest
import torch

# The models run in float64, where packed and padded orders of summation differ by
# ~1e-16. A few steps stay float32 (transformers' RMSNorm, eager attention's softmax), and
# a rounding to float32 there may land on either side: a few float32 epsilons of the
# scale of the result (in float32, the difference depends on the CPU's kernels).
ROUNDING = 16 * torch.finfo(torch.float32).eps


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach(), want.detach()
    bound = ROUNDING * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound, what


def tiny_models():
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from async_rl.models.demo import build_config

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64))
    return {"demo": LlamaForCausalLM(build_config()), "qwen2": qwen}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logp_equal_padded(attn):
    """Response-token log-probs and entropies of the packed forward = the padded forward,
    with rows as long as the longest sequence and with everything in one row."""
    from workers.fsdp_step import synthetic_groups

    from async_rl.learner.batching import build_batch
    from async_rl.learner.packing import layout, packing_error
    from async_rl.learner.step import forward_logp

    batch = build_batch(synthetic_groups(6, 4, seed=3), pad_id=0)
    mask = batch.loss_mask.bool()
    for name, model in tiny_models().items():
        model = model.to(torch.float64)
        model.config._attn_implementation = attn
        padded, h_padded = forward_logp(model, batch, 0.7, entropy=True)
        for row_tokens in (None, 10_000):
            packed, h_packed = forward_logp(model, batch, 0.7, entropy=True, layout=layout(model, batch, row_tokens))
            assert_within_rounding(packed[mask], padded[mask], name)
            assert_within_rounding(h_packed[mask], h_padded[mask], name)
            assert (packed[~mask] == 0).all()
            shared, h_shared = forward_logp(model, batch, 0.7, entropy=True,
                                            layout=layout(model, batch, row_tokens, group_size=4))
            assert_within_rounding(shared[mask], padded[mask], name)
            assert_within_rounding(h_shared[mask], h_padded[mask], name)
            assert (shared[~mask] == 0).all()
        # The check's figure is a difference of logits, at most about 1 in these models.
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention).logits
        scale = max(1.0, float(logits.detach().abs().max()))
        assert packing_error(model) <= ROUNDING * scale and packing_error(model, shared=True) <= ROUNDING * scale


def test_shared_prompt_layout_counts_each_prompt_once_and_has_the_same_gradients():
    """Each group's prompt is in the packed rows once, and the gradient of a loss on the
    shared layout equals the padded one (the prompt's activations collect all G responses')."""
    from workers.fsdp_step import synthetic_groups

    from async_rl.learner.batching import build_batch
    from async_rl.learner.packing import pack
    from async_rl.learner.step import forward_logp

    groups = synthetic_groups(3, 4, seed=5)
    batch = build_batch(groups, pad_id=0)
    layout = pack(batch, row_tokens=10_000, group_size=4)
    real = sum(len(g.prompt_tokens) + int(g.response_lengths.sum()) for g in groups)
    assert int((layout.positions.flatten() > 0).sum()) + len(groups) == real  # one position 0 per prompt
    C = layout.tokens.shape[1]
    assert layout.tree.shape == layout.part.shape == (1, C) and layout.attention_mask().shape == (1, 1, C, C)
    model = tiny_models()["qwen2"].to(torch.float64)
    weights = torch.randn(batch.loss_mask.shape)
    grads = []
    for packed in (None, layout):  # the same layout serves a second forward too (train_step reuses it)
        model.zero_grad()
        logp, _ = forward_logp(model, batch, 1.0, layout=packed)
        (logp * weights * batch.loss_mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # One scale for all parameters: a single tensor's gradient can cancel far below the
    # gradients flowing through the network, where the float32 roundings happen.
    assert_within_rounding(grads[1], grads[0], "gradients")


def test_a_model_that_ignores_custom_masks_fails_the_shared_prompt_check():
    from async_rl.learner.packing import packing_error

    model = tiny_models()["qwen2"]
    forward = model.forward
    model.forward = lambda **kw: forward(**{**kw, "attention_mask": None})  # drops our tree mask
    assert packing_error(model, shared=True) > 1e-3


def test_packing_check_catches_a_leaking_model():
    """A model that ignores the packed layout (here: a full 2-D mask, so attention
    crosses sequence boundaries) fails the learner's one-time packing check."""
    from async_rl.learner.packing import packing_error

    model = tiny_models()["qwen2"]
    forward = model.forward
    model.forward = lambda **kw: forward(**{**kw, "attention_mask": kw.get("attention_mask")
                                           if kw.get("attention_mask") is not None
                                           else torch.ones_like(kw["input_ids"])})
    assert packing_error(model) > 1e-3


def test_micro_batches_whole_groups_within_token_budget():
    from async_rl.learner.packing import micro_batches

    attention = torch.zeros(8, 10, dtype=torch.long)
    for i, n in enumerate([3, 5, 9, 2, 4, 4, 10, 1]):
        attention[i, :n] = 1
    assert micro_batches(attention, 0, 8, 2, 4, None, True) == [(0, 4), (4, 8)]
    # Groups of 2 rows: 8, 11, 8, 11 real tokens; budget 20 -> 8+11, 8+11
    assert micro_batches(attention, 0, 8, 2, 4, 20, True) == [(0, 4), (4, 8)]
    # Padded cost = rows x longest: 2*5=10, 4*9=36 > 20 -> cut; a group over budget still goes alone
    assert micro_batches(attention, 0, 8, 2, 4, 20, False) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert micro_batches(attention, 2, 8, 2, 4, 1, True) == [(2, 4), (4, 6), (6, 8)]
    # Shared prompts of 2 tokens: a group costs its rows' tokens minus one prompt: 6, 9, 6, 9.
    assert micro_batches(attention, 0, 8, 2, 4, 15, True, torch.full((8,), 2)) == [(0, 4), (4, 8)]
    assert micro_batches(attention, 0, 8, 2, 4, 15, True) == [(0, 2), (2, 4), (4, 6), (6, 8)]
