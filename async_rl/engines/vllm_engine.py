"""A generation engine on vLLM (optional dependency: `pip install 'async-rl[vllm]'`, CUDA only).

Sampling: `LLM(..., logprobs_mode="processed_logprobs")` and `SamplingParams(logprobs=0)`.
vLLM documents processed log-probs as "the values after applying all processors,
including temperature and top_k/top_p" (ModelConfig.logprobs_mode, docs.vllm.ai
engine args `--logprobs-mode`), and `logprobs=0` returns only the sampled token's
entry; so every recorded value is the log-probability under the distribution the
token was actually drawn from, as with `TorchEngine`. Greedy calls use temperature 0
(their log-probs are whatever vLLM reports there; only ReMax's rewards use them).

Versions: `LLM.generate` blocks, and the actor applies weight updates only between
its calls (weight_sync/vllm.py: `VLLMWeightReceiver`), so nothing is in
flight during an update and every token of a response carries the version current
when `generate` began; the pause/resume API (`pause_generation(mode="keep")`) is
only needed by callers that generate concurrently with updates. When the installed
vLLM reports per-span weight versions (`CompletionOutput.weight_versions`, labels
set with `update_weight_version`; docs/training/async_rl.md) and their labels are
our integer versions, those spans are used instead.

Weights live in vLLM's worker processes: `parameters_for_sync()` is unavailable;
the actor builds its receiver with `engine.weight_receiver(...)`.
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Sequence

import torch
from torch import nn

from async_rl.engines.base import Completion, GenerationEngine
from async_rl.weight_sync.plan import Spec
from async_rl.weight_sync.vllm import VLLMWeightReceiver
from async_rl.weight_sync.vllm_api import require_vllm


def hf_parameter_specs(model_path: str, dtype: torch.dtype = torch.float32) -> list[Spec]:
    """(name, shape, wire dtype) of the HF model's parameters in `named_parameters()`
    order, from a meta-device skeleton (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape), dtype) for name, p in skeleton.named_parameters()]


def sampled_logprobs(token_ids: Sequence[int], steps: Sequence[Any] | None) -> torch.Tensor:
    """float32 [L]: the sampled token's log-prob at each step of a vLLM sample log
    (one mapping token id -> Logprob per output token)."""
    if steps is None or len(steps) != len(token_ids):
        raise RuntimeError("vLLM returned no per-token log-probs (SamplingParams.logprobs must be set)")
    out = torch.empty(len(token_ids), dtype=torch.float32)
    for t, (tok, step) in enumerate(zip(token_ids, steps)):
        entry = step.get(tok) if step is not None else None
        if entry is None:
            raise RuntimeError(f"vLLM's log-probs at step {t} lack the sampled token {tok}")
        out[t] = float(entry.logprob)
    return out


def token_versions(length: int, version: int, spans: Sequence[Any] | None = None) -> torch.Tensor:
    """int32 [L] policy version of each token: `version`, overridden by vLLM weight-version
    spans (`start`, `end`, `version` label) whose labels are integers."""
    out = torch.full((length,), int(version), dtype=torch.int32)
    for span in spans or ():
        label = str(getattr(span, "version", ""))
        if label.lstrip("-").isdigit():
            out[max(0, int(span.start)):min(length, int(span.end))] = int(label)
    return out


def completion_from_output(output: Any, version: int) -> Completion:
    """Our `Completion` from one vLLM `CompletionOutput`."""
    tokens = list(output.token_ids)
    return Completion(
        tokens=torch.tensor(tokens, dtype=torch.long),
        logprobs=sampled_logprobs(tokens, output.logprobs),
        versions=token_versions(len(tokens), version, getattr(output, "weight_versions", None)),
        finished=output.finish_reason == "stop",
    )


class VLLMEngine(GenerationEngine):
    """Sampling engine around one offline `vllm.LLM` (tensor-parallel size 1).

    The GPU is the one vLLM sees (choose it with CUDA_VISIBLE_DEVICES); `device` only
    has to be a CUDA device. `gpu_memory_utilization` is low by default because a local
    run shares the GPU with the learner. Extra keyword arguments go to `vllm.LLM`.
    """

    def __init__(
        self,
        model_or_path: str | os.PathLike,
        *,
        device: str | torch.device = "cuda",
        dtype: str = "auto",
        sync_dtype: torch.dtype = torch.float32,
        eos_token_id: int | list[int] | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer: Any = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(model_or_path, nn.Module):
            raise TypeError("the vLLM engine loads a model directory, not an in-memory module")
        if torch.device(device).type != "cuda":
            raise ValueError(f"the vLLM engine needs a CUDA device, got {device}")
        if int(llm_kwargs.get("tensor_parallel_size", 1)) != 1:
            raise ValueError("the vLLM engine supports tensor_parallel_size=1 (one NCCL rank per actor)")
        vllm = require_vllm()
        from vllm.config import WeightTransferConfig  # vLLM >= 0.16

        path = str(model_or_path)
        self._sampling_params = vllm.SamplingParams
        self.llm = vllm.LLM(model=path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                            logprobs_mode="processed_logprobs",
                            weight_transfer_config=WeightTransferConfig(backend="nccl"), **llm_kwargs)
        self.version = 0
        # Same EOS rule as TorchEngine: the explicit id(s), else the model config's.
        if eos_token_id is None:
            from transformers import AutoConfig

            eos_token_id = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.eos_token_ids = [int(e) for e in eos]
        self.stop_strings = [s for s in stop_strings if s]  # vLLM detokenizes itself: `tokenizer` is not needed
        self.specs: list[Spec] = hf_parameter_specs(path, sync_dtype)
        self._label = self._version_labeller()
        self.set_version(0)

    # ----------------------------------------------------------------- protocol

    def set_version(self, version: int) -> None:
        self.version = int(version)
        if self._label is not None:
            self._label(str(self.version))

    def parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        raise RuntimeError("the vLLM engine's weights live in vLLM's worker processes; "
                           "build the receiver with engine.weight_receiver(...)")

    def sync_specs(self) -> list[Spec]:
        """(HF name, shape, wire dtype) of the synced parameters, in the learner's order."""
        return list(self.specs)

    def weight_receiver(self, *, bucket_mb: float, backend: str, timeout_s: float) -> VLLMWeightReceiver:
        """The actor's receiver for this engine (same interface as `WeightReceiver`)."""
        return VLLMWeightReceiver(self.llm, self.specs, bucket_mb=bucket_mb, backend=backend, timeout_s=timeout_s)

    def _generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                  greedy: bool, generator: torch.Generator | None) -> list[list[Completion]]:
        # One seed per call drawn from the actor's generator: reproducible, and distinct per batch.
        seed = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        params = self._sampling_params(
            n=n, max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p, seed=seed, logprobs=0,
            # Stop exactly on our stop ids (as TorchEngine), not on generation-config extras.
            ignore_eos=True, stop_token_ids=self.eos_token_ids or None,
            # Stop strings need vLLM's detokenizer; the token that completes one is kept, as in TorchEngine.
            stop=self.stop_strings or None, include_stop_str_in_output=True, detokenize=bool(self.stop_strings))
        version = self.version  # nothing changes the weights while generate runs (module docstring)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} prompts")
        groups = []
        for request in outputs:
            samples = sorted(request.outputs, key=lambda o: o.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            groups.append([completion_from_output(o, version) for o in samples])
        return groups

    # ------------------------------------------------------------------ helpers

    def _version_labeller(self) -> Any:
        """`llm.update_weight_version(label)` where this vLLM has it (per-span versions in
        outputs), else None."""
        fn = getattr(self.llm, "update_weight_version", None)
        if fn is None:
            return None
        try:
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD]
        except (TypeError, ValueError):
            return None
        return fn if len(params) == 1 else None
