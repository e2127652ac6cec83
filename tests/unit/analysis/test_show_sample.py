"""analysis/show_sample.py on damaged files and on text its tokenizer cannot write: one
line per damaged row, no traceback, and no check that says ok when it is not."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, load_script

from async_rl.config import load_config, to_yaml
from async_rl.models.demo import build_tokenizer
from async_rl.run.samples import read_samples

unknown_tokens = load_script("show_sample").unknown_tokens


def sample(**changes) -> dict:
    line = {"step": 1, "prompt_id": 0, "sample": 0, "actor_id": 0, "version": 0, "reward": 1.0, "truncated": False,
            "prompt_ids": [1, 5], "response_ids": [6, 7], "policy_mask": [1, 1], "token_versions": [0, 0],
            "logprobs": [-0.1, -0.2], "prompt_text": "1+1=", "response_text": "2"}
    line.update(changes)
    return line


def damaged_file(path: Path) -> None:
    good = json.dumps(sample()).encode()
    missing = json.dumps({k: v for k, v in sample().items() if k != "prompt_ids"}).encode()
    path.write_bytes(b"\n".join([
        good,
        b'{"step": 1, "prompt_id": ',  # cut off
        b'{"step": 1, "prompt_text": "\xff\xfe"}',  # not UTF-8
        missing,
        json.dumps(sample(policy_mask=[1])).encode(),  # lengths disagree
        json.dumps(sample(step="two")).encode(),
    ]) + b"\n")


def test_each_damaged_line_is_one_note_and_the_whole_ones_are_read(tmp_path):
    damaged_file(tmp_path / "samples.jsonl")
    rows, notes = read_samples(tmp_path / "samples.jsonl")
    assert [r["step"] for r in rows] == [1] and rows[0]["prompt_ids"] == [1, 5]
    assert [n.split(":")[0] for n in notes] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert "prompt_ids" in notes[2] and "differ in length" in notes[3] and "$.step" in notes[4]
    assert all("\n" not in n for n in notes)


def test_the_script_skips_damaged_lines_in_one_line_each_and_shows_the_whole_one(tmp_path, demo_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(ROOT / "configs/demo.yaml", [f"model.path={demo_model}"])))
    damaged_file(run / "samples.jsonl")
    out = subprocess.run([sys.executable, str(ROOT / "analysis/show_sample.py"), str(run)], capture_output=True,
                         text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 5 and all("; skipped" in line for line in out.stderr.splitlines())
    assert out.stdout.startswith("step 1, prompt 0, sample 0")
    as_file = subprocess.run([sys.executable, str(ROOT / "analysis/show_sample.py"), str(run / "samples.jsonl")],
                             capture_output=True, text=True, timeout=120)
    assert as_file.stdout == out.stdout  # the samples file names its run
    other = subprocess.run([sys.executable, str(ROOT / "analysis/show_sample.py"), str(run / "config.yaml")],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and other.stderr.strip() == (
        f"show_sample: {run / 'config.yaml'} is not a run directory "
        "(give RUN, which holds samples.jsonl and config.yaml)")
    (run / "config.yaml").write_text("model: [\n")
    broken = subprocess.run([sys.executable, str(ROOT / "analysis/show_sample.py"), str(run)], capture_output=True,
                            text=True, timeout=120)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert broken.stderr.strip().splitlines()[-1].startswith(f"show_sample: {run}: cannot read its config or model")


def test_text_the_tokenizer_cannot_write_fails_the_check():
    tokenizer = build_tokenizer()
    unk = tokenizer.unk_token_id
    said = tokenizer("Wrong, try again", add_special_tokens=False)["input_ids"]  # letters: not the demo's words
    assert unk in said
    assert unknown_tokens(tokenizer, [1, 5], [[6, 7]]) == "ok"
    verdict = unknown_tokens(tokenizer, [1, unk], [said])
    assert verdict.startswith(f"1 prompt and {said.count(unk)} environment tokens are '<unk>'")
