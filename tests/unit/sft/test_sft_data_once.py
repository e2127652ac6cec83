"""The demonstrations are tokenized once: the launcher's check encodes them into the run
directory, and every rank reads them from there."""
import json
from pathlib import Path

from async_rl.config import load_config
from async_rl.sft import run as sft_run
from async_rl.sft.trainer import load_split

ROOT = Path(__file__).resolve().parents[3]


def test_the_check_leaves_the_encoded_split_and_the_ranks_read_it(tmp_path, chat_model, monkeypatch):
    demos = tmp_path / "demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                                                      {"role": "assistant", "content": f"It is {a + 1}."}]}) + "\n"
                             for a in range(20)))
    cfg = load_config(ROOT / "configs/demo.yaml", [f"model.path={chat_model}", f"sft.data={demos}",
                                                   f"run_dir={tmp_path / 'run'}", "sft.eval_fraction=0.1"])
    (tmp_path / "run").mkdir()
    assert sft_run._count(cfg) == 18
    encoded = load_split(tmp_path / "run" / sft_run.DEMONSTRATIONS_FILE)
    assert encoded == sft_run.encode_demonstrations(cfg)  # saved as encoded, ids and masks alike

    def tokenize_again(cfg):
        raise AssertionError("a rank tokenized the demonstrations again")

    monkeypatch.setattr(sft_run, "encode_demonstrations", tokenize_again)
    assert sft_run.demonstrations(cfg) == encoded
