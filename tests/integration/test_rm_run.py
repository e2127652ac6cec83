"""`async-rl rm` as a user runs it (a subprocess; under torchrun with two ranks): pairs
of a hidden preference of our own (the answer in a sentence over a bare or evasive
one) train a tiny random chat model's head well above chance, and `async-rl train`
scores with the model it writes, in the reward server; two ranks train as one; LoRA merges into the head's
model; bad pairs are one line, exit 2; Ctrl-C is one line, exit 130."""
import json
import random
import re
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, subprocess_env, train, wait_for


def write_pairs(path, n: int, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            worse = rng.choice([str(a + b), "I don't know.", f"{a} + {b}"])
            out.write(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f"The answer is {a + b}.",
                                  "rejected": worse}) + "\n")
    return path


def rm(run_dir, model, *overrides, timeout=180):
    cmd = [sys.executable, "-m", "async_rl.cli", "rm", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={model}", "learner.threads=1", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def metrics(run_dir, key) -> list[float]:
    return [r[key] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


def test_pairs_train_a_reward_model_well_above_chance_and_a_run_scores_with_it(chat_model, demo_model, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 300)
    proc = rm(tmp_path / "rm", chat_model, f"rm.data={pairs}", "rm.lr=3e-3", "rm.epochs=3", "rm.batch_size=16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = metrics(tmp_path / "rm", "rm/held_out_accuracy")
    assert len(held) == 3 and held[-1] >= 0.9, held  # 30 held-out pairs; chance is 0.5
    assert metrics(tmp_path / "rm", "rm/held_out_margin")[-1] > 0
    out = tmp_path / "rm" / "model"
    assert "reward model in" in proc.stderr.strip().splitlines()[-1]
    normalization = json.loads((out / "reward_normalization.json").read_text())
    assert normalization["pairs"] == 270 and normalization["std"] > 0
    run = tmp_path / "run"  # the demo policy, scored by the chat reward model with its own template, in the server
    train(run, demo_model, "train.max_steps=2", "eval.every=0",
          f"reward.components=[{{name: rm, reward: reward_model, model: {out}, placement: server}}, "
          "{name: exact, reward: task, weight: 0}]")
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2] and all(s["reward/rm/error_frac"] == 0.0 for s in steps)
    assert all(s["train/reward_mean"] == pytest.approx(s["reward/rm/mean"], rel=1e-5) for s in steps)
    version = json.loads((run / "reward_server.json").read_text())["versions"]["rm"]
    assert f"version {version}" in (run / "logs" / "actor-0.log").read_text()
    assert "stopped (SIGTERM)" in (run / "logs" / "reward-server.log").read_text()


def test_two_ranks_train_as_one(chat_model, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 40)
    # 5 pairs a step, 2 a micro-batch: one rank takes 3, the other 2 and a padding micro-batch.
    common = (f"rm.data={pairs}", "rm.batch_size=5", "rm.eval_fraction=0", "learner.micro_batch_size=2", "rm.lr=1e-3")
    one = rm(tmp_path / "one", chat_model, *common, "learner.ranks=1")
    two = rm(tmp_path / "two", chat_model, *common, "learner.ranks=2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = metrics(tmp_path / "one", "rm/loss"), metrics(tmp_path / "two", "rm/loss")
    assert len(a) == len(b) == 8
    assert b[0] == pytest.approx(a[0], rel=1e-5)  # the same pairs; float32 sums in another order
    assert b == pytest.approx(a, rel=1e-3)


def test_lora_is_merged_into_the_written_reward_model(chat_model, tmp_path):
    pytest.importorskip("peft")
    from async_rl.rewards.reward_model import RewardModel

    pairs = write_pairs(tmp_path / "pairs.jsonl", 40)
    proc = rm(tmp_path / "lora", chat_model, f"rm.data={pairs}", "model.lora.rank=4", "rm.lr=1e-2",
              "rm.eval_fraction=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    scorer = RewardModel(tmp_path / "lora" / "model")
    assert not any(".lora_" in name for name, _ in scorer.model.named_parameters())
    assert len(scorer.score_batch(["What is 1 + 2?"], ["The answer is 3."])) == 1


@pytest.mark.parametrize(("row", "says"), [
    (None, "rm.data: required"),
    ('{"prompt": "q", "chosen": "a"}', r"rm.data: .*pairs.jsonl:1: a pair needs a 'chosen' and a 'rejected' side"),
])
def test_bad_pairs_are_one_line_and_exit_2(chat_model, tmp_path, row, says):
    overrides = []
    if row is not None:
        (tmp_path / "pairs.jsonl").write_text(row + "\n")
        overrides.append(f"rm.data={tmp_path / 'pairs.jsonl'}")
    proc = rm(tmp_path / "run", chat_model, *overrides, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(says, lines[0]), lines


def test_ctrl_c_stops_at_once_in_one_line_and_writes_no_model(chat_model, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 300)
    cmd = [sys.executable, "-m", "async_rl.cli", "rm", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'run'}",
           f"model.path={chat_model}", "learner.threads=1", f"rm.data={pairs}", "rm.epochs=200"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists()
                        and metrics(tmp_path / "run", "rm/loss"), timeout=60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("async-rl: rm interrupted (SIGINT); no model written"), err[-2000:]
    assert not (tmp_path / "run" / "model").exists()


def test_ppo_s_critic_starts_from_a_reward_model(demo_model, reward_model_dir, tmp_path):
    run = tmp_path / "run"
    train(run, demo_model, "train.max_steps=2", "eval.every=0", "train.advantage.name=gae",
          f"train.advantage.critic_init={reward_model_dir}")
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["loss/value"] > 0 and s["critic/grad_norm"] > 0 for s in steps)
