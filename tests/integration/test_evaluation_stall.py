"""Evaluation in a real run, on the actors and on the evaluator: an evaluation longer
than the learner's timeout stalls no rank."""
import pytest
from conftest import read_metrics, train

# Every reward call takes this long: an evaluation of N samples takes at least N times
# as long on any machine, a fast one too.
REWARD_S = 0.025
SLOW_REWARD = f"""import time


def score(prompt, response, answer):
    time.sleep({REWARD_S})
    return float(response.strip() == answer)
"""


@pytest.mark.parametrize("placement", ["actors", "evaluator"])
def test_an_evaluation_longer_than_the_learner_timeout_stalls_no_rank(tmp_path, demo_model, placement):
    """On the actors, the step-0 evaluation keeps the only actor busy for longer than
    learner.timeout_s before it generates anything, while both learner ranks wait; on
    the evaluator, the final one keeps both ranks waiting as long. Nobody times out
    (the learner waits in short collectives and counts each chunk scored as progress)."""
    run = tmp_path / "long_eval"
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    # 200 prompts x 2 samples: at least 10 s of evaluation against a 6 s timeout, in
    # chunks of at least 1 s (each result is progress), however fast the machine.
    prompts, samples, chunk, timeout_s = 200, 2, 20, 6
    assert prompts * samples * REWARD_S > timeout_s + 3 and chunk * samples * REWARD_S < timeout_s / 3
    train(run, demo_model, "train.max_steps=2", "learner.ranks=2", f"learner.timeout_s={timeout_s}", "eval.every=0",
          f"task.eval_size={prompts}", f"eval.size={prompts}", f"eval.batch_size={chunk}", f"eval.pass_k={samples}",
          "eval.temperature=1.0", f"task.reward={reward}:score", "reward.workers=1", f"eval.placement={placement}",
          timeout=180)
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    assert all(e["eval/prompts"] == prompts and f"eval/pass@{samples}" in e for e in evals)
    assert evals[0]["eval/seconds"] > timeout_s and evals[-1]["eval/seconds"] > timeout_s
