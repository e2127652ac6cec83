"""Loading Hugging Face models and tokenizers the way every role does."""
from __future__ import annotations

from pathlib import Path


def quiet_libraries() -> None:
    """Per-load progress bars from transformers would drown the run's own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def preload_model_libraries() -> None:
    """Import transformers' model and tokenizer machinery now, seconds of imports that
    loading a model would otherwise do: an actor started alongside its learner does it
    while the learner starts up, not after joining."""
    import importlib

    for module in ("modeling_utils", "models.auto.modeling_auto", "models.auto.tokenization_auto"):
        importlib.import_module(f"transformers.{module}")


def load_tokenizer(path: str, quick: bool = False):
    """The model directory's tokenizer. `quick`: where the directory has a tokenizer.json,
    load it as the plain fast tokenizer, without transformers' auto classes, whose import
    takes seconds (torch's among them): for the launcher's checks, which only render and
    encode sample prompts."""
    if quick and (Path(path) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
