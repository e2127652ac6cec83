"""Generation engines: `make_engine("torch" | "vllm", **kw)`."""

from __future__ import annotations

from typing import Any

from async_rl.actor.engines.base import Completion, GenerationEngine

__all__ = ["Completion", "GenerationEngine", "make_engine"]


def make_engine(name: str, **kw: Any) -> GenerationEngine:
    """Build the engine called `name`; keyword arguments go to its constructor."""
    if name == "torch":
        # Imported lazily so that importing the package stays cheap (no transformers).
        from async_rl.actor.engines.torch_engine import TorchEngine

        return TorchEngine(**kw)
    if name == "vllm":
        from async_rl.actor.engines.vllm_engine import VLLMEngine
        from async_rl.weight_transfer.vllm.api import require_vllm

        require_vllm()  # first: a missing or old vLLM is one line (VLLMUnavailable), whatever the arguments
        return VLLMEngine(**kw)
    raise ValueError(f"unknown engine {name!r}; expected 'torch' or 'vllm'")
