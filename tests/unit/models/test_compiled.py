import pytest
import torch

from async_rl.models.compiled import compile_blocks, decoder_layers


def test_every_decoder_layer_is_compiled_in_place_with_its_names_kept(demo_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model)
    names = [name for name, _ in model.named_parameters()]
    layers = decoder_layers(model)
    assert layers is model.model.layers and len(layers) == model.config.num_hidden_layers
    assert compile_blocks(model) == len(layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert [name for name, _ in model.named_parameters()] == names  # weight sync and checkpoints key on them


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="no transformer blocks found in Linear"):
        compile_blocks(torch.nn.Linear(2, 2))
