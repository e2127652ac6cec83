"""final/'s card: the precision its weights were written and measured in, the run's last
evaluation of them, the scores added when the run ended, and the summary's lines."""
import json

from async_rl.run.model_card import FINAL_SCORE, add_scores, card_text, final_dtype
from async_rl.run.summary import summary_lines


def test_the_card_names_the_precision_and_the_evaluation_of_these_weights():
    text = card_text(dtype="bfloat16", step=7, last_eval={"step": 7, "eval/accuracy": 0.8, "eval/prompts": 100},
                     engine="torch", master=True)
    assert "Weights: **bfloat16**" in text and "**0.800** at step 7 (100 prompts)" in text
    assert "../final-master/" in text
    # An evaluation of an earlier version does not describe these weights.
    stale = card_text(dtype="float32", step=7, last_eval={"step": 5, "eval/accuracy": 0.8}, engine="torch",
                      master=True)
    assert "No evaluation of step 7's weights finished" in stale and "final-master" not in stale


def test_scores_at_the_end_go_to_the_card_and_the_summary(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"")
    (final / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (final / "README.md").write_text("card\n")
    add_scores(final, {"bfloat16": 0.8, "float32": 0.82})
    assert "0.800 in bfloat16, 0.820 in float32" in (final / "README.md").read_text()
    assert final_dtype(final) == "bfloat16" and final_dtype(tmp_path) is None
    step = {"time": 1.0, "step": 7, "loss/total": 0.0, "train/samples": 8, "learner/idle_frac": 0.0,
            "sync/seconds": 0.0, "staleness/mean": 0.0, "staleness/max": 0, "staleness/dropped": 0,
            "throughput/gen_tokens_per_s": 1.0, "actors/live": 1, "data/prompts_admitted": 2,
            "data/prompts_consumed": 2, "wire/rejected": 0}
    lines = [step, {"step": 7, "eval/accuracy": 0.8}, {"step": 7, f"{FINAL_SCORE}float32": 0.82}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = summary_lines(tmp_path)
    assert any("final" in line and "0.820 in float32" in line for line in summary)
    assert any("(bfloat16, as the actors ran it)" in line for line in summary if "outputs" in line)
