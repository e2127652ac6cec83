"""`async-rl train` as real processes on loopback: 2 FSDP2 learner ranks + actors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_tree, read_metrics, subprocess_env, survivors, train

from async_rl.run.directory import RunDir
from async_rl.run.metrics import EVAL_KEYS, STEP_KEYS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smoke
def test_two_ranks_one_actor_train_a_few_steps(tmp_path, demo_model):
    run = tmp_path / "run"
    proc = train(run, demo_model, "train.max_steps=4", "max_staleness=2", "checkpoint.every=2", "learner.ranks=2")
    steps, evals = read_metrics(run)
    # The one-screen summary at the end, from metrics.jsonl.
    summary = [line for line in proc.stderr.splitlines() if line.startswith("async-rl: ")][-8:]
    assert [line.split()[1] for line in summary] == ["steps", "learner", "staleness", "off-policy", "actors",
                                                     "memory", "eval", "outputs"]
    assert f"{steps[-1]['train/samples']} samples" in summary[0] and "dropped 0" in summary[2]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert set(STEP_KEYS) <= s.keys()
        assert s["staleness/max"] <= 2 and s["staleness/dropped"] == 0 and s["actors/live"] == 1
        assert s["wire/rejected"] == 0
    # The actors evaluate each round at the first version they hold at or after the request.
    assert [e["step"] for e in evals][0] == 0 and sorted(e["step"] for e in evals)[-1] == 4 and len(evals) == 3
    assert 2 <= sorted(e["step"] for e in evals)[1] <= 3 and all(set(EVAL_KEYS) <= e.keys() for e in evals)
    assert all(e["eval/prompts"] == 32 for e in evals)
    assert steps[-1]["data/prompts_consumed"] == 4 * 8
    assert list((run / "tb").glob("events.out.tfevents.*"))
    cfg_text = (run / "config.yaml").read_text()
    assert "max_staleness: 2" in cfg_text and f"path: {demo_model}" in cfg_text
    endpoints = RunDir(run).endpoints()
    assert endpoints["hub"].startswith("tcp://127.0.0.1:") and endpoints["learner_pid"] > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert json.loads((run / "checkpoints" / "step_000004" / "coordinator.json").read_text())["version"] == 4

    table = subprocess.run([sys.executable, str(ROOT / "analysis/summarize.py"), str(run), "--target", "0.0"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "| run | 2 | 4 | 0 steps" in table and "| 0 |" in table

    # final/ is a Hugging Face directory that transformers loads and that generates.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    out = model.generate(**tok("12+34=", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > len(tok("12+34=")["input_ids"])
    # analysis/eval_model.py scores final/ as the actors scored its version at the end.
    scored = subprocess.run([sys.executable, str(ROOT / "analysis/eval_model.py"), str(run / "config.yaml"),
                             str(run / "final"), "--threads", "1"], capture_output=True, text=True, timeout=120,
                            check=True, env=subprocess_env()).stdout.splitlines()
    last = max(evals, key=lambda e: e["step"])
    assert json.loads(scored[0])["eval/accuracy"] == pytest.approx(last["eval/accuracy"])
    assert json.loads(scored[0])["eval/prompts"] == 32


def test_cut_responses_are_flagged_to_the_learner_and_a_run_that_cannot_learn_says_so(tmp_path, demo_model):
    """One new token allowed: a response is cut unless that token is the stop token. The
    flag travels with every sample over the wire into the learner's buffer and its
    metrics (train/truncated_frac), and the evaluation counts it too. With one-token
    responses and a reward that never varies, the learner warns once about each, in
    one line with the likely cause, and trains on."""
    from conftest import read_tensorboard, text_at

    from async_rl.tasks.prompt_format import CUT_MARK

    run = tmp_path / "cut"
    (tmp_path / "never.py").write_text("def score(prompt, response, answer):\n    return 0.0\n")
    proc = train(run, demo_model, "train.max_steps=3", "learner.ranks=1", "eval.every=0", "eval.size=16",
                 "actors.max_new_tokens=1", "metrics.warn_after_steps=2", "metrics.text_every=1",
                 f"task.reward={tmp_path / 'never.py'}:score")
    for needle, cause in (("most responses are one token long for 2 steps", "actors.max_new_tokens is 1"),
                          ("every group has the same reward for all its samples for 2 steps",
                           "are cut at actors.max_new_tokens=1")):
        lines = [line for line in proc.stderr.splitlines() if needle in line]
        assert len(lines) == 1 and cause in lines[0], proc.stderr[-2000:]
    steps, evals = read_metrics(run)
    assert len(steps) == 3 and all(s["train/response_len_max"] == 1 for s in steps)
    # The barely trained demo model seldom stops at once: most samples are cut.
    assert all(0.5 < s["train/truncated_frac"] <= 1.0 for s in steps)
    assert all(e["eval/response_len_mean"] == 1 and e["eval/truncated_frac"] > 0.5 for e in evals)
    # Samples as the learner received them (every step's table of generations): cut iff
    # the one token is not the stop token (<eos> in the demo tokenizer).
    acc = read_tensorboard(run / "tb")
    rows = [line.split(" | ")[1] for step in (1, 2, 3) for line in text_at(acc, step).splitlines()[2:]]
    assert rows and all(r.endswith(CUT_MARK) == (r.removesuffix(CUT_MARK) != "<eos>") for r in rows), rows


def test_synchronous_baseline_has_zero_staleness(tmp_path, demo_model):
    run = tmp_path / "sync"
    train(run, demo_model, "train.max_steps=3", "max_staleness=0", "actors.count=2", "learner.ranks=1",
          "train.loss=opmd")
    steps, _ = read_metrics(run)
    assert len(steps) == 3
    assert all(s["staleness/max"] == 0 and s["staleness/mean"] == 0 for s in steps)
    assert steps[-1]["actors/live"] == 2




def test_ctrl_c_stops_every_process_after_a_checkpoint(tmp_path, demo_model):
    import signal
    import time

    run = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "train.max_steps=100000", "actors.count=2"]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if RunDir(run).last_step() >= 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no training step within 120 s")
        endpoints = RunDir(run).endpoints()
        pids = [endpoints["learner_pid"]] + [a["pid"] for a in endpoints["actors"]]
        assert len(pids) == 3
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 130, err[-2000:]
    assert list((run / "checkpoints").glob("step_*/coordinator.json"))
    assert (run / "final" / "config.json").exists()
    assert not survivors(pids), "orphan processes left behind"


def test_jsonl_task_with_reward_function_and_rloo(tmp_path, demo_model):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10, 30) for b in range(40, 45)))
    run = tmp_path / "jsonl"
    train(run, demo_model, "train.max_steps=2", "learner.ranks=1", "task.name=jsonl", f"task.train_path={data}",
          "task.reward=async_rl.tasks.arithmetic:exact_match", "train.advantage=rloo")
    steps, evals = read_metrics(run)
    assert len(steps) == 2 and evals and 0.0 <= evals[-1]["eval/accuracy"] <= 1.0


def test_a_parquet_dataset_with_extra_columns_feeds_the_environment(tmp_path, demo_model):
    """Written by `datasets` with its own column names, trained on with no conversion and
    no reward: the environment scores each episode from a column of its row."""
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"{a}+{b}=", "db_id": f"db{a}", "expected": str(a + b)}
            for a in range(10, 30) for b in range(40, 45)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    (tmp_path / "field_env.py").write_text(
        "from async_rl.actor.environments import Turn\n\n\n"
        "class ReadsItsRow:\n"
        "    def __init__(self, prompt):\n"
        "        self.db = prompt.fields['db_id']\n"
        "        self.right = prompt.fields['db_id'] == 'db' + prompt.text.split('+')[0]\n\n"
        "    def step(self, action):\n"
        "        return Turn(reward=1.0 if self.right else 0.0, done=True)\n\n\n"
        "def make(prompt):\n"
        "    return ReadsItsRow(prompt)\n")
    run = tmp_path / "dataset"
    train(run, demo_model, "train.max_steps=2", "learner.ranks=1", "task.name=dataset",
          f"task.path={tmp_path / 'rows.parquet'}", "task.prompt_column=question", "task.answer_column=expected",
          f"env.name={tmp_path / 'field_env.py'}:make", "env.max_turns=1")
    steps, evals = read_metrics(run)
    # Every episode the environment saw scored 1; a turn cut at max_new_tokens never reaches step().
    assert len(steps) == 2 and all(s["train/reward_mean"] == 1.0 - s["train/truncated_frac"] for s in steps)
    assert not any(k.startswith("env/errors") and v for s in steps for k, v in s.items())
    assert evals[-1]["eval/accuracy"] == 1.0
