"""Loading Hugging Face models and tokenizers the way every role does."""
from __future__ import annotations

import warnings
from pathlib import Path


def quiet_libraries(log_file: Path | None = None) -> None:
    """Per-load progress bars from transformers would drown the run's own progress bar.
    Other libraries' deprecation notices (transformers' FutureWarning on every SmolLM2
    load) are addressed to code that calls those libraries, not to the run's user: they
    go to `log_file` (the run's logs), not the console; our own, and every other kind of
    warning, still reach the console."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if log_file is not None:
        warnings.showwarning = _deprecations_to(log_file, warnings.showwarning)


DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _deprecations_to(log_file: Path, show):
    package = str(Path(__file__).resolve().parents[1])  # async_rl/

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, DEPRECATIONS) or str(filename).startswith(package):
            return show(message, category, filename, lineno, file, line)
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(log_file, "a") as out:
                out.write(warnings.formatwarning(message, category, filename, lineno, line))
        except OSError:  # a full disk must not turn a notice into a failure
            pass

    return showwarning


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
