"""Compiled transformer blocks (learner.compile, actors.engine.compile) compute what the
eager ones do: the engine samples the same greedy tokens with log-probs equal to float32
rounding, the sharded learner's loss and gradients agree, and a run with both compiled
trains to its end."""
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, read_metrics, subprocess_env

# float32 kernels that fuse differently (inductor's C++ against ATen) differ in the last bits
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def test_a_compiled_engine_samples_what_the_eager_one_does(demo_model):
    from async_rl.actor.engines.torch_engine import TorchEngine

    prompts = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 5, 6, 2]]  # rows of different lengths: dynamic shapes
    out = [TorchEngine(str(demo_model), compile=compiled).generate(prompts, n=2, max_new_tokens=6, greedy=True)
           for compiled in (False, True)]
    for eager_group, compiled_group in zip(*out, strict=True):
        for eager, compiled in zip(eager_group, compiled_group, strict=True):
            assert torch.equal(eager.tokens, compiled.tokens)
            torch.testing.assert_close(compiled.logprobs, eager.logprobs, **TOLERANCE)


def test_the_compiled_learner_computes_the_eager_loss_and_gradients(demo_model, one_rank_mesh):
    from transformers import AutoModelForCausalLM

    from async_rl.learner.sharding import shard_model

    tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = shard_model(AutoModelForCausalLM.from_pretrained(demo_model), one_rank_mesh, compile=compiled)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), [p.grad.full_tensor() for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, **TOLERANCE)
    for eager, compiled in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-3, atol=1e-5)


@pytest.mark.extended  # about 40 s on 2 cores: each process compiles its blocks first
def test_a_run_with_both_compiled_trains_to_its_end(tmp_path, demo_model):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"),
                           f"run_dir={run_dir}", f"model.path={demo_model}", "train.max_steps=3",
                           "learner.compile=true", "actors.engine.compile=true", "checkpoint.every=0"],
                          capture_output=True, text=True, timeout=240, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps, evals = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3] and [e["step"] for e in evals] == [0, 3]
    assert "compiling the blocks included (learner.compile)" in proc.stderr  # each role says what compiling cost
    assert "compiling the blocks included (actors.engine.compile)" in (run_dir / "logs/actor-0.log").read_text()
