"""Models for the tests that run real vLLM: the demo's architecture with heads vLLM's CPU
attention implements (4 x 32) and a tied output head, and the learner's weights after
some training."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from async_rl.models.demo import VLLM_HEAD_DIM, build_config, build_tokenizer

PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 4, 9, 3]]


def save_model(path, seed: int, head_dim: int = VLLM_HEAD_DIM) -> str:
    """A random model (with the demo tokenizer) in `path`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(build_config(head_dim))
    with torch.no_grad():  # a peakier, less uniform random model: greedy outputs differ between seeds
        model.model.embed_tokens.weight.mul_(30)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def learner_like(model_dir: str, seed: int) -> LlamaForCausalLM:
    """The learner's policy after some training: the base model's weights, moved."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model
