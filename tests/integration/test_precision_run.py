"""bf16 end to end: `async-rl train` with a bf16 learner on eager attention and bf16
torch-engine actors (real actors, wire and FSDP2 learner, a tiny chat model): the
weights travel in bf16, the actors' log-probs are scored by the learner, and the held-out
evaluation runs on the bf16 actors."""
from conftest import read_metrics, train

from async_rl.run.directory import RunDir


def test_a_bf16_run_sends_bf16_weights_and_trains(tmp_path, chat_model):
    run = tmp_path / "run"
    train(run, chat_model, "task.name=word_problems", "learner.precision=bf16", "learner.attention=eager",
          "actors.engine.dtype=bfloat16", "actors.max_new_tokens=6", "train.max_steps=3", "learner.ranks=1")
    steps, evals = read_metrics(run)
    from transformers import AutoModelForCausalLM

    fp32_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(chat_model).parameters())
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["sync/bytes"] == fp32_bytes // 2 for s in steps)
    assert all(0.0 <= s["is/mismatch_kl"] < 1.0 for s in steps)  # bf16 against bf16: finite, small
    assert [e["step"] for e in evals] == [0, 2, 3] and all(0.0 <= e["eval/accuracy"] <= 1.0 for e in evals)


def test_final_is_the_model_the_bf16_actors_ran_and_scores_what_the_run_measured(tmp_path, demo_model):
    """final/ holds the weights as the bf16 actors held them (the float32 masters, which no
    actor ran, go to final-master/ on request), says so in its card, and scored again as
    the run ends it gives the run's last evaluation in bf16, and nearly so in float32."""
    import json

    import torch
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = train(run, demo_model, "learner.precision=bf16", "actors.engine.dtype=bfloat16", "train.max_steps=6",
                 "learner.ranks=1", "task.eval_size=128", "eval.size=128", "checkpoint.final_master=true",
                 "eval.final_dtypes=[bfloat16,float32]")
    steps, evals = read_metrics(run)
    last = max(evals, key=lambda e: e["step"])
    assert last["step"] == 6
    final = load_file(run / "final" / "model.safetensors")
    master = load_file(run / "final-master" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert all(torch.equal(final[name], master[name].to(torch.bfloat16)) for name in master)
    assert json.loads((run / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    scores = next(r for r in RunDir(run).metrics() if "final/accuracy_float32" in r)
    assert scores["final/accuracy_bfloat16"] == last["eval/accuracy"]
    assert abs(scores["final/accuracy_float32"] - last["eval/accuracy"]) <= 0.05
    card = (run / "final" / "README.md").read_text()
    assert "**bfloat16**" in card and f"**{last['eval/accuracy']:.3f}** at step 6" in card
    assert f"{scores['final/accuracy_float32']:.3f} in float32" in card
    summary = [line for line in proc.stderr.splitlines() if line.startswith("async-rl: final")]
    assert summary and "in float32" in summary[0]
