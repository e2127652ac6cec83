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
# The runs compute in float64 (tests/workers/learner_variants.py), where packed and padded
# orders of summation differ by ~1e-16. A few steps stay float32 on every path (the
# batch's log-probs and rewards, advantages, the critic's values, transformers' RMSNorm),
# and a rounding to float32 there may land on either side: a shared prompt receives its
# responses' gradients summed, G padded copies each their own (measured: ~1 float32
# epsilon of the update). A few float32 epsilons of the scale (assert_same_run).
FLOAT64_RUN = 16 * torch.finfo(torch.float32).eps
# bf16 keeps 8 significant bits: activations, log-probs and gradients each carry about
# one bf16 rounding (measured: the update moves by ~0.6% of its size, under 1 epsilon).
BF16_RUN = 4 * torch.finfo(torch.bfloat16).eps


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
    """The update of the policy (and critic) parameters and every diagnostic: packed micro-batches
    (shared prompts) under a token budget vs padded fixed-size ones, 2 FSDP2 ranks, SGD lr=1."""
    assert_same_run(runs[f"{variant}-padded"], runs[f"{variant}-packed"])


def test_packed_without_shared_prompts_equals_padded(runs):
    assert_same_run(runs["ppo-padded"], runs["ppo-packed-unshared"])


def test_overlong_filter_and_penalty_change_the_update(runs):
    """Samples at the length limit (flagged truncated) lose their loss and long ones are
    penalized: the update differs from the plain one (the batch has such samples)."""
    plain, overlong = runs["ppo-padded"], runs["ppo-overlong"]
    assert float(overlong["stat:learner/grad_norm"]) != pytest.approx(float(plain["stat:learner/grad_norm"]))
    assert any(not torch.equal(plain[n], overlong[n]) for n in plain if not n.startswith("stat:"))


def test_activation_checkpointing_same_gradients(runs):
    assert_same_run(runs["gae-padded"], runs["gae-ac"])
    assert_same_run(runs["gae-packed"], runs["gae-packed-ac"])


def test_bf16_mixed_precision_keeps_fp32_master_weights(runs):
    full, bf16 = runs["ppo-padded"], runs["ppo-bf16"]
    # What the optimizer stepped: fp32 under bf16 compute; the probe reads the full-precision run's float64.
    assert bf16.pop("master").dtype == torch.float32 and full.pop("master").dtype == torch.float64
    assert all(t.dtype == torch.float32 for n, t in bf16.items() if not n.startswith("stat:"))
    # The bf16 update is the full-precision one up to bf16 rounding.
    names = [n for n in full if not n.startswith("stat:")]
    update = torch.cat([full[n].flatten() for n in names])
    update_bf16 = torch.cat([bf16[n].double().flatten() for n in names])
    assert update.norm() > 0 and (update_bf16 - update).norm() / update.norm() < BF16_RUN
    # The loss: a mean of per-token figures of order 1 (ratios, advantages of 0/1 rewards).
    loss = float(full["stat:loss/total"])
    assert abs(float(bf16["stat:loss/total"]) - loss) < BF16_RUN * max(abs(loss), 1.0)


def test_bench_learner_tiny_prints_schema():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_learner.py"), "--tiny", "--cpu", "--ranks", "2",
                           "--steps", "1", "--warmup", "0", "--variants", "padded,packed+ac", "--attention", "eager"],
                          capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    learner = [line for line in lines if line["kind"] == "learner"]
    assert [line["variant"] for line in learner] == ["padded", "packed+ac"]
    for line in learner:
        assert line["device"] == "cpu" and line["ranks"] == 2
        assert line["precision"] == "fp32" and line["attention"] == "eager"
        assert line["scored_tokens"] < line["tokens"] <= line["padded_tokens"]
        assert line["step_s"] > 0 and len(line["steps_s"]) == 1
        assert abs(line["tokens_per_s"] - line["tokens"] / line["step_s"]) < 1e-6 * line["tokens_per_s"]
        # 6 FLOPs per parameter and token, the tied V x H head on scored tokens only; attention on top.
        head = 16 * 64
        assert line["flops_per_step"] > 6 * (line["params"] - head) * line["tokens"] + 6 * head * line["scored_tokens"]
        assert line["matmul_peak_tflops"] > 0
        assert line["mfu"] == pytest.approx(line["tflops"] / line["matmul_peak_tflops"])
    (gen,) = [line for line in lines if line["kind"] == "generate"]
    assert gen["tokens"] == gen["prompts"] * gen["new_tokens"] and gen["tokens_per_s"] > 0


def assert_same_run(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    updates = [name for name in a if name != "master" and not name.startswith("stat:")]
    # Rounding is relative to the gradients flowing through the network, and one tensor's
    # update can cancel far below them (layer 1's k_proj under reinforce_pp: 1e-10): the
    # scale is the run's largest update.
    scale = max(float(a[name].abs().max()) for name in updates)
    assert scale > 0
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        if name in updates:
            assert float((b[name] - a[name]).abs().max()) <= FLOAT64_RUN * scale, name
        elif name.startswith("stat:"):
            # Diagnostics are means and norms of per-token figures of order 1 (log-probs,
            # ratios, advantages of 0/1 rewards): their rounding is relative to at least 1.
            want = float(a[name])
            assert abs(float(b[name]) - want) <= FLOAT64_RUN * max(abs(want), 1.0), (name, float(b[name]), want)


def test_step_flops_by_hand():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_learner import step_flops

    tied = SimpleNamespace(vocab_size=10, hidden_size=4, num_hidden_layers=2, tie_word_embeddings=True)
    lengths = torch.tensor([3, 5])
    # forward: 2 * (1000 - 40) * 8 tokens + 2 * 40 * 4 scored + 4 * 2 layers * 4 * (9 + 25) = 16768
    assert step_flops(tied, 1000, lengths, scored=4) == 3 * 16768
    assert step_flops(tied, 1000, lengths, scored=4, no_grad_forwards=1) == 4 * 16768
    untied = SimpleNamespace(**{**vars(tied), "tie_word_embeddings": False})
    assert step_flops(untied, 1000, lengths, scored=4) == 3 * (2 * 920 * 8 + 2 * 40 * 4 + 4 * 2 * 4 * 34)
