"""LoRA on vLLM actors: vLLM serves an adapter per request (`LoRARequest`), loaded from a
peft adapter directory; vLLM 0.32 takes adapters from a path only, so each version the
actor receives becomes a small directory (the adapters alone) that the next requests name.

The adapters reach the actor over the plain weight sync (the gloo chain on a CPU, as for
the torch engine) into tensors this object holds, not through vLLM's weight transfer,
which writes the base model's weights. A new version gets a new adapter id, so vLLM
loads it once and its prefix cache never mixes versions; the previous directory is
deleted when the next is written (between generate calls, no request names it then).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from async_rl.lora.adapters import adapter_specs, save_adapter

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


def vllm_lora_options(lora) -> dict:
    """vLLM.LLM keyword arguments for adapters of `lora.rank` (one adapter at a time)."""
    if lora.rank > VLLM_RANKS[-1]:
        raise ValueError(f"model.lora.rank: vLLM serves ranks up to {VLLM_RANKS[-1]}, got {lora.rank}")
    return {"enable_lora": True, "max_lora_rank": next(r for r in VLLM_RANKS if r >= lora.rank), "max_loras": 1}


class VLLMAdapters:
    def __init__(self, lora, model_path: str, device: torch.device | str = "cpu") -> None:
        self.lora, self.model_path = lora, model_path
        self.tensors = [(name, torch.zeros(shape, dtype=dtype, device=device))
                        for name, shape, dtype in adapter_specs(model_path, lora)]
        self.workdir = Path(tempfile.mkdtemp(prefix="async-rl-lora-"))
        self.request = None  # None: the base model, as fresh adapters compute (lora_B = 0)
        self._current: Path | None = None

    def publish(self, version: int):
        """The received adapters as version `version`'s directory; its LoRARequest."""
        from vllm.lora.request import LoRARequest

        path = self.workdir / f"v{version}"
        save_adapter(iter(self.tensors), self.lora, self.model_path, None, path)
        if self._current is not None and self._current != path:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = path
        # Ids must be >= 1 and unique per adapter: versions are, shifted past 0.
        self.request = LoRARequest(f"async-rl-v{version}", version + 1, str(path))
        return self.request

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
