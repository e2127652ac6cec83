"""Evaluation on the actors, in a real run: an evaluation longer than the learner's
timeout stalls no rank."""
from conftest import read_metrics, train


def test_an_evaluation_longer_than_the_learner_timeout_stalls_no_rank(tmp_path, demo_model):
    """The step-0 evaluation keeps the only actor busy for longer than learner.timeout_s
    before it generates anything, while both learner ranks wait: nobody times out (the
    learner waits in short collectives and counts evaluation results as progress)."""
    run = tmp_path / "long_eval"
    # About 9 s of evaluation on a quiet 2-core machine (more under load), against a 6 s
    # timeout: a margin for faster machines, while every collective still gets 6 s.
    train(run, demo_model, "train.max_steps=2", "learner.ranks=2", "learner.timeout_s=6", "eval.every=0",
          "task.eval_size=1000", "eval.size=1000", "eval.batch_size=50", "eval.pass_k=144", "eval.temperature=1.0",
          timeout=180)
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    assert all(e["eval/prompts"] == 1000 and "eval/pass@144" in e for e in evals)
    assert evals[0]["eval/seconds"] > 6
