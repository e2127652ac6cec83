"""Learner efficiency options change speed, not results, in a real 2-rank FSDP2 train_step
(tests/workers/learner_variants.py): packed micro-batches give the padded update,
activation checkpointing the same gradients, bf16 mixed precision keeps fp32 master
weights. Plus the learner benchmark's --tiny preset."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, subprocess_env
from safetensors.torch import load_file

WORKER = Path(__file__).parents[1] / "workers" / "learner_variants.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("variants")
    out = tmp / "runs.safetensors"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out), str(tmp / "model")],
                          timeout=180, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tensors = load_file(out)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        run, _, name = key.partition("/")
        grouped.setdefault(run, {})[name] = value
    return grouped


@pytest.mark.parametrize("variant", ["gae", "reinforce_pp", "opmd", "ppo"])
def test_packed_train_step_equals_padded(runs, variant):
    """Updated policy (and critic) parameters and every diagnostic: packed micro-batches
    (shared prompts) under a token budget vs padded fixed-size ones, 2 FSDP2 ranks, SGD lr=1."""
    assert_same_run(runs[f"{variant}-padded"], runs[f"{variant}-packed"], atol=1e-5)


def test_packed_without_shared_prompts_equals_padded(runs):
    assert_same_run(runs["ppo-padded"], runs["ppo-packed-unshared"], atol=1e-5)


def test_overlong_filter_and_penalty_change_the_update(runs):
    """Samples at the length limit (flagged truncated) lose their loss and long ones are
    penalized: the update differs from the plain one (the batch has such samples)."""
    plain, overlong = runs["ppo-padded"], runs["ppo-overlong"]
    assert float(overlong["stat:learner/grad_norm"]) != pytest.approx(float(plain["stat:learner/grad_norm"]))
    assert any(not torch.equal(plain[n], overlong[n]) for n in plain if not n.startswith("stat:"))


def test_activation_checkpointing_same_gradients(runs):
    assert_same_run(runs["gae-padded"], runs["gae-ac"], atol=1e-6)
    assert_same_run(runs["gae-packed"], runs["gae-packed-ac"], atol=1e-6)


def test_bf16_mixed_precision_keeps_fp32_master_weights(runs):
    fp32, bf16, init = runs["ppo-padded"], runs["ppo-bf16"], runs["init"]
    assert bool(bf16.pop("fp32_master")) and bool(fp32.pop("fp32_master"))
    assert all(t.dtype == torch.float32 for n, t in bf16.items() if not n.startswith("stat:"))
    # The bf16 update is the fp32 one up to bf16 rounding of activations (~1e-2 relative).
    update = torch.cat([(fp32[n] - init[n]).flatten() for n in init])
    update_bf16 = torch.cat([(bf16[n] - init[n]).flatten() for n in init])
    assert update.norm() > 0 and (update_bf16 - update).norm() / update.norm() < 0.1
    assert abs(float(bf16["stat:loss/total"]) - float(fp32["stat:loss/total"])) < 0.05


def test_bench_learner_tiny_prints_schema():
    proc = subprocess.run([sys.executable, str(ROOT / "analysis/bench_learner.py"), "--tiny", "--cpu", "--ranks", "2",
                           "--steps", "1", "--warmup", "0", "--variants", "padded,packed+ac", "--attention", "eager"],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    learner = [line for line in lines if line["kind"] == "learner"]
    assert [line["variant"] for line in learner] == ["padded", "packed+ac"]
    for line in learner:
        assert line["device"] == "cpu" and line["ranks"] == 2 and line["precision"] == "fp32" and line["attention"] == "eager"
        assert line["scored_tokens"] < line["tokens"] <= line["padded_tokens"] and line["step_s"] > 0 and len(line["steps_s"]) == 1
        assert abs(line["tokens_per_s"] - line["tokens"] / line["step_s"]) < 1e-6 * line["tokens_per_s"]
        # 6 FLOPs per parameter and token, the tied V x H head on scored tokens only; attention on top.
        head = 16 * 64
        assert line["flops_per_step"] > 6 * (line["params"] - head) * line["tokens"] + 6 * head * line["scored_tokens"]
        assert line["matmul_peak_tflops"] > 0 and line["mfu"] == pytest.approx(line["tflops"] / line["matmul_peak_tflops"])
    (gen,) = [line for line in lines if line["kind"] == "generate"]
    assert gen["tokens"] == gen["prompts"] * gen["new_tokens"] and gen["tokens_per_s"] > 0


def assert_same_run(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if name.startswith("stat:"):  # diagnostics: float64 sums, some of them large
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=atol, msg=name)
        else:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


def test_step_flops_by_hand():
    sys.path.insert(0, str(ROOT / "analysis"))
    from bench_learner import step_flops

    tied = SimpleNamespace(vocab_size=10, hidden_size=4, num_hidden_layers=2, tie_word_embeddings=True)
    lengths = torch.tensor([3, 5])
    # forward: 2 * (1000 - 40) * 8 tokens + 2 * 40 * 4 scored + 4 * 2 layers * 4 * (9 + 25) = 16768
    assert step_flops(tied, 1000, lengths, scored=4) == 3 * 16768
    assert step_flops(tied, 1000, lengths, scored=4, no_grad_forwards=1) == 4 * 16768
    untied = SimpleNamespace(**{**vars(tied), "tie_word_embeddings": False})
    assert step_flops(untied, 1000, lengths, scored=4) == 3 * (2 * 920 * 8 + 2 * 40 * 4 + 4 * 2 * 4 * 34)
