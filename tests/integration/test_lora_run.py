"""LoRA end to end: `async-rl train` with model.lora on a tiny chat model (real actors,
wire, FSDP2 learner): only the adapters travel (sync/bytes), final/ is a peft adapter
that loads on the base, a target the model lacks is one line before anything starts,
and benchmarks/bench_generate.py's LoRA variants."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, subprocess_env, train

pytest.importorskip("peft")


def test_a_lora_run_syncs_only_the_adapters_and_leaves_an_adapter(tmp_path, chat_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    train(run, chat_model, "task.name=word_problems", "model.lora.rank=4", "model.lora.merged_final=true",
          "train.correction=m2po", "train.kl.coef=0.05", "actors.max_new_tokens=6", "train.max_steps=3",
          "learner.ranks=1", "eval.every=0")
    steps, _ = read_metrics(run)
    # float64: the merged and the unmerged forward differ by the float32 rounding of the
    # merged weights alone, not by what the CPU's kernels make of two float32 paths.
    base = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float64)
    full_bytes = 4 * sum(p.numel() for p in base.parameters())  # float32, as the run trains
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(0 < s["sync/bytes"] < 0.5 * full_bytes for s in steps)
    assert steps[-1]["policy/kl_ref"] > 0  # the adapters moved the policy off its base
    adapted = PeftModel.from_pretrained(base, run / "final").eval()
    # model.lora.merged_final
    merged = AutoModelForCausalLM.from_pretrained(run / "final" / "merged", dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    x = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        with adapted.disable_adapter():
            plain = adapted(input_ids=x).logits
        want = adapted(input_ids=x).logits
        assert not torch.equal(want, plain)
        # Each merged weight rounded once to float32: a few float32 epsilons of the logits' scale.
        bound = 16 * torch.finfo(torch.float32).eps * float(want.abs().max())
        assert float((merged(input_ids=x).logits - want).abs().max()) <= bound
        answer = adapted.generate(x, max_new_tokens=4, do_sample=False)  # it answers through the chat template
    assert answer.shape[1] > x.shape[1]


def test_a_target_the_model_lacks_is_one_line(tmp_path, chat_model):
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'r'}",
           f"model.path={chat_model}", "model.lora.rank=4", "model.lora.target_modules=[q_proj,c_attn]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.lora.target_modules" in lines[0] and "'c_attn'" in lines[0], proc.stderr


@pytest.mark.extended
def test_bench_generate_times_the_engine_with_folded_and_unmerged_adapters(tmp_path, chat_model):
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "configs/smollm2.yaml").read_text().replace("models/smollm2-135m", str(chat_model)))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_generate.py"), "--config", str(config),
                           "--variants", "torch:float32:lora4,torch:float32:lora4-unmerged",
                           "--calls", "2", "--prompts", "2", "--n", "2", "--max-new-tokens", "4"],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [json.loads(line) for line in lines]
    assert [r["dtype"] for r in results] == ["float32:lora4", "float32:lora4-unmerged"]
    assert all(r["tokens_per_s"] > 0 for r in results)
    assert "torch:float32:lora4-unmerged:" in proc.stdout
