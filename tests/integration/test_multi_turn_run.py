"""Multi-turn episodes end to end: `async-rl train` with a user environment from a file
(env.name), a tiny chat model with a ChatML template, real actors, wire and learner,
process rewards (train.advantage=grpo_process). The episodes take several turns, the
environment's tokens reach the learner as context (env/policy_token_frac < 1), and the
evaluation scores episodes too. A bad env.name is one line before anything starts."""
import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, subprocess_env, train

ENV = '''
from async_rl.actor.environments import Turn


class TwoQuestions:
    """Asks a follow-up once; rewards each turn by its length (something to learn)."""

    def __init__(self, prompt):
        self.turns = 0

    def step(self, action):
        self.turns += 1
        reward = min(len(action), 20) / 20
        if self.turns == 2:
            return Turn(reward=reward, done=True)
        return Turn([{"role": "user", "content": "And then?"}], reward=reward)


def make(prompt):
    return TwoQuestions(prompt)
'''


@pytest.mark.smoke
def test_a_run_trains_on_multi_turn_episodes_of_a_users_environment(tmp_path, chat_model):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV)
    run = tmp_path / "run"
    # The random model samples "e" often: it ends a turn (actors.stop), so episodes go on.
    train(run, chat_model, "task.name=word_problems", f"env.name={env_file}:make", "env.max_turns=3",
          "env.max_tokens=40", "actors.max_new_tokens=6", "actors.stop=[e]", "train.advantage=grpo_process",
          "train.loss=cispo", "train.correction=icepop",  # corrections read the policy's tokens only
          "train.max_steps=3", "learner.ranks=1", "eval.size=8", "eval.batch_size=8",
          "metrics.samples_every=1", "metrics.samples_per_dump=8")
    steps, evals = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3]
    # Every step's first 8 samples, whole; a two-turn one shown as its conversation and
    # checked against the chat template by the documented script.
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8 + [3] * 8
    for s in samples:
        assert len(s["response_ids"]) == len(s["policy_mask"]) == len(s["logprobs"]) == len(s["token_versions"])
    step, index = next((s["step"], i % 8) for i, s in enumerate(samples) if 0 in s["policy_mask"])
    shown = subprocess.run([sys.executable, str(ROOT / "analysis/show_sample.py"), str(run), "--step", str(step),
                            "--index", str(index)], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "--- environment (" in shown.stdout and "And then?" in shown.stdout
    for check in ("prompt   ok", "turns    ok", "tokens   ok"):
        assert check in shown.stdout, shown.stdout
    assert max(s["env/turns_max"] for s in steps) == 2 and all(s["env/policy_token_frac"] < 1 for s in steps)
    assert max(s["env/multi_turn_frac"] for s in steps) > 0
    assert all(math.isfinite(s["loss/total"]) and s["reward/errors"] == 0 for s in steps)
    assert all(0.0 <= s["is/masked_frac"] <= 1.0 and s["is/ratio_max"] >= s["is/ratio_min"] for s in steps)
    assert evals and all(0.0 <= e["eval/reward_mean"] <= 1.0 for e in evals)


def test_a_bad_environment_is_one_line_before_the_run_starts(tmp_path, chat_model):
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'r'}",
           f"model.path={chat_model}", "task.name=word_problems", f"env.name={tmp_path}/missing.py:make"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "env.name" in lines[0] and "no file" in lines[0], proc.stderr


@pytest.mark.extended
def test_the_environment_in_the_docs_trains(tmp_path, chat_model):
    """docs/environments.md's example, as a user copies it: its environment file, a JSONL
    task of numbers to guess, and the documented overrides (on a tiny chat model)."""
    import json
    import re

    doc = (ROOT / "docs" / "environments.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if "def make(prompt)" in block)
    (tmp_path / "guess_env.py").write_text(code)
    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Guess my number between 1 and 100.", "answer": str(n)}) + "\n"
                            for n in range(1, 41)))
    run = tmp_path / "run"
    train(run, chat_model, "task.name=jsonl", f"task.train_path={data}", "task.reward=exact_match",
          f"env.name={tmp_path / 'guess_env.py'}:make", "env.max_turns=6", "env.max_tokens=128",
          "actors.max_new_tokens=6", "actors.stop=[e]", "train.max_steps=2", "learner.ranks=1", "eval.every=0")
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2] and max(s["env/turns_max"] for s in steps) >= 2
