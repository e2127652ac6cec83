"""bf16 end to end: `async-rl train` with a bf16 learner on eager attention and bf16
torch-engine actors (real actors, wire and FSDP2 learner, a tiny chat model): the
weights travel in bf16, the actors' log-probs are scored by the learner, and the held-out
evaluation runs on the bf16 actors."""
from conftest import read_metrics, train


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
