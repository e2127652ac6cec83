"""metrics.py: the per-step histograms, the markdown table of sample generations, and the
logger's TensorBoard histograms, texts and custom-scalars layout next to a flat
metrics.jsonl. (A real run's TensorBoard output: tests/integration/test_observability_run.py.)"""
import json

import numpy as np
from conftest import layout_categories, read_tensorboard, text_at

from async_rl.run.metrics import CUSTOM_SCALARS, GENERATIONS_TAG, MetricsLogger, batch_histograms, generations_table
from async_rl.wire import ExperienceGroup, Response


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) if i < 26 else "|" for i in ids)


def fake_group(version=1, rewards=(1.0, 0.0), truncated=(0, 1)):
    return ExperienceGroup.from_responses(
        [Response([2, 30], [-0.5] * 2, [version] * 2), Response([4, 5, 6], [-0.5] * 3, [version] * 3)],
        actor_id=0, group=0, prompt_id=0, version=version, prompt_tokens=np.array([0, 1], np.int32),
        rewards=np.array(rewards, np.float32), truncated=np.array(truncated, np.uint8), gen_seconds=0.0)


def test_batch_histograms_have_one_value_per_sample():
    hist = batch_histograms([fake_group(), fake_group(rewards=(0.5, 0.25))], staleness=[0, 2])
    assert hist["staleness/per_sample"].tolist() == [0, 0, 2, 2]
    assert hist["train/response_len"].tolist() == [2, 3, 2, 3]
    assert hist["train/reward"].tolist() == [1.0, 0.0, 0.5, 0.25]


def test_generations_table_is_markdown_with_escaped_cells():
    from async_rl.tasks.prompt_format import CUT_MARK, PromptFormat

    fmt = PromptFormat(FakeTokenizer(), False)
    table = generations_table([fake_group(version=3)] * 5 + [fake_group(truncated=(1, 0))], fmt)
    lines = table.splitlines()
    assert len(lines) == 2 + 4  # header, separator, the first 4 groups
    assert lines[2] == "| ab | c\\| | 1 | 3 |"  # a "|" in a response does not split the row
    cut = generations_table([fake_group(truncated=(1, 0))], fmt).splitlines()[2]
    assert cut == f"| ab | c\\|{CUT_MARK} | 1 | 1 |"  # a response cut at the length limit is marked


def test_logger_writes_histograms_texts_and_layout_but_keeps_jsonl_flat(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=2)
    record = {"step": 1, "version": 1, "train/reward_mean": 0.5, "staleness/mean": 1.0, "staleness/max": 1,
              "throughput/samples_per_s": 10.0, "loss/total": 0.1}
    logger.log(record, histograms={"is/weight": np.array([0.5, 1.0, 2.0]), "train/reward": []},
               texts={GENERATIONS_TAG: "| a | b |\n|---|---|\n| 1 | 2 |"})
    logger.log({"step": 1, "version": 1, "eval/accuracy": 0.5, "eval/reward_mean": 0.5})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[0]) == {"time", *record}
    acc = read_tensorboard(tmp_path / "tb")
    assert acc.Tags()["histograms"] == ["is/weight"]  # an empty histogram is skipped
    weights = acc.Histograms("is/weight")[0].histogram_value
    assert (weights.num, weights.min, weights.max, weights.sum) == (3, 0.5, 2.0, 3.5)
    assert text_at(acc, 1).startswith("| a | b |")
    assert layout_categories(acc) == list(CUSTOM_SCALARS)
