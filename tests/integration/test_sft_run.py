"""`async-rl sft` as a user runs it (a subprocess; under torchrun with two ranks): a few
hundred demonstrations teach a tiny random chat model a format, and `async-rl train`
starts from the model it writes; two ranks train as one; LoRA writes the adapter and the
merged model; bad demonstrations are one line, exit 2."""
import json
import os
import random
import re
import signal
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, subprocess_env, train, wait_for

FORMAT = re.compile(r"The answer is \d+\.<\|im_end\|>")


def write_demos(path, n: int, seed: int = 0):
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            out.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                               {"role": "assistant", "content": f"The answer is {a + b}."}]}) + "\n")
    return path


def sft(run_dir, model, *overrides, timeout=180):
    cmd = [sys.executable, "-m", "async_rl.cli", "sft", str(ROOT / "configs/demo.yaml"), f"run_dir={run_dir}",
           f"model.path={model}", "learner.threads=1", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())


def format_rate(model_dir) -> float:
    """Greedy replies in the demonstrations' format, on ten questions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    hits = 0
    for a in range(10):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {9 - a}?"}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2)
        hits += bool(FORMAT.fullmatch(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=False)))
    return hits / 10


def sft_losses(run_dir) -> list[float]:
    return [r["sft/loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "sft/loss" in r]


def test_demonstrations_teach_a_tiny_model_a_format_and_rl_starts_from_it(chat_model, tmp_path):
    demos = write_demos(tmp_path / "demos.jsonl", 300)
    proc = sft(tmp_path / "sft", chat_model, f"sft.data={demos}", "sft.lr=1e-2", "sft.epochs=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "sft" / "model"
    assert f"supervised model in {out}" in proc.stderr
    assert re.search(r"sft: epoch 8/8 .* held-out loss", proc.stderr)
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    held = [r["sft/held_out_loss"] for r in records if "sft/held_out_loss" in r]
    assert len(held) == 8 and held[-1] < 0.5 * held[0], held
    assert format_rate(chat_model) == 0.0
    assert format_rate(out) >= 0.9
    train(tmp_path / "rl", out, "train.max_steps=2", "eval.every=0")
    steps, _ = read_metrics(tmp_path / "rl")
    assert [s["step"] for s in steps] == [1, 2] and (tmp_path / "rl" / "final" / "model.safetensors").exists()


def test_two_ranks_train_as_one(chat_model, tmp_path):
    demos = write_demos(tmp_path / "demos.jsonl", 40)
    common = (f"sft.data={demos}", "sft.batch_size=8", "sft.eval_fraction=0", "learner.micro_batch_size=2",
              "sft.lr=1e-3")
    one = sft(tmp_path / "one", chat_model, *common, "learner.ranks=1")
    two = sft(tmp_path / "two", chat_model, *common, "learner.ranks=2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = sft_losses(tmp_path / "one"), sft_losses(tmp_path / "two")
    assert len(a) == len(b) == 10
    # The same batches: float32 sums in another order, Adam steps that follow them.
    assert b[0] == pytest.approx(a[0], rel=1e-5)
    assert b == pytest.approx(a, rel=1e-3)
    assert (tmp_path / "two" / "model" / "model.safetensors").exists()


def test_lora_writes_the_adapter_and_the_merged_model(chat_model, tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    demos = write_demos(tmp_path / "demos.jsonl", 40)
    proc = sft(tmp_path / "lora", chat_model, f"sft.data={demos}", "model.lora.rank=4", "sft.lr=1e-2",
               "sft.eval_fraction=0", f"sft.out={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.adapter" / "adapter_config.json").exists()
    base, merged = load_file(chat_model / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    changed = [name for name in base if not (base[name] == merged[name]).all()]
    assert changed and all("proj" in name for name in changed)  # the adapted linear layers alone


@pytest.mark.parametrize(("data", "says"), [
    (None, "sft.data: required"),
    ("missing.jsonl", "sft.data: .*missing.jsonl: no such file or folder"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"sft.data: .*demos.jsonl:1: no assistant turn"),
])
def test_bad_demonstrations_are_one_line_and_exit_2(chat_model, tmp_path, data, says):
    overrides = []
    if data == "missing.jsonl":
        overrides.append(f"sft.data={tmp_path / data}")
    elif data is not None:
        (tmp_path / "demos.jsonl").write_text(data + "\n")
        overrides.append(f"sft.data={tmp_path / 'demos.jsonl'}")
    proc = sft(tmp_path / "run", chat_model, *overrides, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(says, lines[0]), lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("ranks", "stop"), [(1, signal.SIGINT), (2, signal.SIGINT), (2, signal.SIGTERM),
                                             (1, signal.SIGHUP)])
def test_a_stop_ends_every_rank_in_one_line_and_writes_no_model(chat_model, tmp_path, ranks, stop):
    """Ctrl-C at a terminal (SIGINT to the launcher's whole process group), SIGTERM or
    SIGHUP: one line, exit 128 + the signal as `async-rl train`, no traceback from a rank
    or torchrun."""
    demos = write_demos(tmp_path / "demos.jsonl", 300)
    cmd = [sys.executable, "-m", "async_rl.cli", "sft", str(ROOT / "configs/demo.yaml"), f"run_dir={tmp_path / 'run'}",
           f"model.path={chat_model}", "learner.threads=1", f"learner.ranks={ranks}", f"sft.data={demos}",
           "sft.epochs=200"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=subprocess_env(), start_new_session=True)
    try:
        assert wait_for(lambda: sft_losses(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists()
                        else False, timeout=90)
        os.killpg(proc.pid, stop)  # as a terminal does: to every process of the launcher's group
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + stop, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"async-rl: sft interrupted ({stop.name}); no model written")
    for noise in ("Traceback", "KeyboardInterrupt", "SignalException", "Error"):
        assert noise not in err, err[-3000:]
    assert not (tmp_path / "run" / "model").exists()
