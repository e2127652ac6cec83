"""ReservingCache: the same keys and values as transformers' DynamicCache, written in place."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from async_rl.actor.engines.kv_cache import ReservedLayer, ReservingCache
from async_rl.actor.engines.torch_engine import TorchEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_reserved_layer_holds_what_concatenation_holds() -> None:
    """Prefill, repeat, reserve, append, drop rows, run past the reservation: at every point
    the layer's keys and values equal DynamicLayer's, and appends within the reservation
    write into one buffer instead of making a new tensor."""
    reserved, plain = ReservedLayer(), transformers.cache_utils.DynamicLayer()
    for layer in (reserved, plain):
        layer.update(*states(2, 5, 0))
        layer.batch_repeat_interleave(3)
    reserved.reserve(2)
    buffer = reserved._key_buffer
    for step in range(4):  # 2 within the reservation, then 2 past it
        new = states(6 if step < 2 else 4, 1, 10 + step)
        got, want = reserved.update(*new), plain.update(*new)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        if step == 0:
            assert reserved.keys.data_ptr() == buffer.data_ptr()
        if step == 1:
            keep = torch.tensor([0, 2, 3, 5])
            reserved.batch_select_indices(keep)
            plain.batch_select_indices(keep)
    assert reserved._key_buffer is None and reserved.get_seq_length() == plain.get_seq_length() == 9


def test_cache_reserves_full_attention_layers_only() -> None:
    config = transformers.MistralConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=2, intermediate_size=32, sliding_window=4)
    assert not any(isinstance(layer, ReservedLayer) for layer in ReservingCache(config).layers)
    llama = transformers.LlamaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, intermediate_size=32)
    assert all(type(layer) is ReservedLayer for layer in ReservingCache(llama).layers)
    cache = ReservingCache(None)  # layers made on first use
    cache.update(*states(1, 3, 0), layer_idx=0)
    assert type(cache.layers[0]) is ReservedLayer


def test_engine_generates_the_same_with_dynamic_cache(tmp_path, monkeypatch) -> None:
    """The torch engine's tokens and log-probs with ReservingCache equal those with
    transformers' DynamicCache, for the same seed (rows stop and leave the batch).
    The same keys and values, in buffers of other strides, for which kernels may sum in
    other orders: the model runs in float64, where that moves a result by ~1e-16. The
    engine's softmax takes float32 logits, and transformers' RMSNorm computes in float32,
    so a rounding may land on either side: a few float32 epsilons of the logits' scale."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                      initializer_range=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    engine = TorchEngine(transformers.LlamaForCausalLM(config), eos_token_id=[3], dtype=torch.float64)
    prompts = [[1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 4, 5, 6, 7, 8, 9, 10, 5], [7, 8]]

    def run():
        return engine.generate(prompts, n=3, max_new_tokens=10, temperature=1.0,
                               generator=torch.Generator().manual_seed(1))

    reserved = run()
    class Concatenating(DynamicCache):
        def reserve(self, extra: int) -> None:
            pass

    monkeypatch.setattr(engine, "_new_cache", lambda: Concatenating(config=config))
    plain = run()
    assert any(not c.finished for group in plain for c in group) and any(c.finished for group in plain for c in group)
    for prompt, group_a, group_b in zip(prompts, reserved, plain):
        for a, b in zip(group_a, group_b):
            assert torch.equal(a.tokens, b.tokens)
            with torch.no_grad():
                scale = float(engine.model(input_ids=torch.tensor([prompt + a.tokens.tolist()])).logits.abs().max())
            bound = 16 * torch.finfo(torch.float32).eps * scale
            assert float((a.logprobs - b.logprobs).abs().max()) <= bound
