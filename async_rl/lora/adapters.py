"""Adapters on a model, the same on the learner and on the actors: one peft LoraConfig
made from `model.lora`, so that both sides name every adapter tensor alike (the weight
sync pairs them by name and order)."""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

ADAPTER_MARK = ".lora_"  # in the name of every adapter tensor peft makes (lora_A, lora_B)


def peft_config(lora):
    """peft's LoraConfig for the config section `model.lora`."""
    from peft import LoraConfig, TaskType

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type=TaskType.CAUSAL_LM)


def with_adapters(model: torch.nn.Module, lora) -> torch.nn.Module:
    """`model` wrapped in fresh adapters (peft zero-initializes lora_B, so the wrapped
    model computes what the base does); only the adapters require grad."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora))


@contextlib.contextmanager
def base_only(model: torch.nn.Module):
    """Within: `model` computes its base exactly (every adapter's scale 0: base + 0), the
    KL reference. Not peft's disable_adapter(): it also switches the adapters'
    requires_grad off and on, and FSDP2 keeps what it sees at its lazy initialization,
    which may fall inside (then the policy would never get a gradient again)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.scale_layer(0.0)
    try:
        yield model
    finally:
        for layer in layers:
            layer.unscale_layer()  # back to alpha / rank


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors, in registration order (the order both sides sync in)."""
    return [(name, p) for name, p in model.named_parameters() if is_adapter(name)]


def check_targets(model_path: str, target_modules: Iterable[str]) -> str | None:
    """None when every target names linear layers of the model at `model_path`, else why
    not, in one line. The model is built on the meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in target_modules if t not in linear]
    if missing:
        return (f"model.lora.target_modules: {type(model).__name__} has no linear layer named "
                f"{', '.join(repr(t) for t in missing)} (it has {', '.join(sorted(linear))})")
    return None


def adapter_specs(model_path: str, lora) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the adapters `with_adapters` gives the model at
    `model_path`, in the learner's order, from a model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = with_adapters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)), lora)
    return [(name, tuple(p.shape), torch.float32) for name, p in adapter_parameters(model)]


def save_adapter(params: Iterable[tuple[str, torch.Tensor]], lora, base_path: str, tokenizer, out_dir: Path) -> None:
    """Write a peft adapter directory, atomically: adapter_config.json (the base named by
    `base_path`) and adapter_model.safetensors from the (name, full tensor) stream
    `params` (its adapter tensors, under the names peft saves: no adapter name), plus
    the tokenizer. `PeftModel.from_pretrained(base, out_dir)` loads it."""
    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name.replace(".default.", "."): t.detach().cpu().contiguous() for name, t in params if is_adapter(name)}
    save_file(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    config = peft_config(lora)
    config.base_model_name_or_path = str(Path(base_path).resolve())
    config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def save_merged(adapter_dir: Path, base_path: str, tokenizer, out_dir: Path) -> None:
    """The base at `base_path` with the adapter of `adapter_dir` merged into its weights,
    as a plain HF model directory (atomically): what a user without peft loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def save_lora_final(params: Iterable[tuple[str, torch.Tensor]], lora, base_path: str, tokenizer, out_dir: Path) -> None:
    """final/ of a LoRA run: the adapter, and with model.lora.merged_final the merged model
    in final/merged."""
    save_adapter(params, lora, base_path, tokenizer, out_dir)
    if lora.merged_final:
        save_merged(out_dir, base_path, tokenizer, out_dir / "merged")
