"""Observability of a real run: the timeline (trace.json, Chrome trace format, read by
analysis/rundata.py) and TensorBoard's histograms, sample generations and custom-scalars
layout. One tiny `async-rl train` run (real processes) and unit tests of the logger."""
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, read_metrics, train

from async_rl.metrics import (CUSTOM_SCALARS, GENERATIONS_TAG, HISTOGRAM_TAGS, STEP_KEYS, MetricsLogger,
                              batch_histograms, generations_table)

sys.path.insert(0, str(ROOT / "analysis"))
from rundata import load_run, read_trace  # noqa: E402  (analysis scripts import their sibling module this way)


def read_tensorboard(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"histograms": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def layout_categories(acc) -> list[str]:
    from tensorboard.plugins.custom_scalar import layout_pb2

    assert "custom_scalars__config__" in acc.PluginTagToContent("custom_scalars")
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    return [c.title for c in layout.category]


def text_at(acc, step: int) -> str:
    events = [e for e in acc.Tensors(f"{GENERATIONS_TAG}/text_summary") if e.step == step]
    assert len(events) == 1
    return events[0].tensor_proto.string_val[0].decode()


# ------------------------------------------------------------------ a real run


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_model):
    path = tmp_path_factory.mktemp("observed") / "run"
    train(path, demo_model, "train.max_steps=3", "learner.ranks=1", "metrics.text_every=2")
    return path


def test_a_run_writes_a_timeline_of_learner_and_actor(run):
    doc = json.loads((run / "trace.json").read_text())
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["dropped_spans"] == {"learner": 0, "actor-0": 0}
    spans = read_trace(run / "trace.json")
    assert {s.track for s in spans} == {"learner", "actor-0"}
    learner = [s for s in spans if s.track == "learner"]
    actor = [s for s in spans if s.track == "actor-0"]
    names = {s.name for s in learner}
    assert {"wait-for-data", "train-step", "sync", "eval", "checkpoint", "export"} == names
    assert [s.args["step"] for s in learner if s.name == "train-step"] == [1, 2, 3]
    # The actor also evaluates (the learner's "eval" span is its wait for the final round).
    assert {"generate", "score", "push", "sync", "eval"} <= {s.name for s in actor} <= {
        "generate", "score", "push", "sync", "wait-for-admission", "eval"}
    generated = [s for s in actor if s.name == "generate"]
    assert all(s.args["groups"] == 4 and s.args["tokens"] > 0 for s in generated)
    # Every group the learner trained on was generated (and pushed) by the actor.
    assert sum(s.args["groups"] for s in generated) >= 3 * 8
    assert sum(s.args["groups"] for s in actor if s.name == "push") >= 3 * 8
    # One wall clock: the tracks line up, and the actor generated while the learner waited.
    start, end = min(s.start_s for s in learner), max(s.start_s + s.dur_s for s in learner)
    assert all(start - 60 < s.start_s < end + 60 and s.dur_s >= 0 for s in actor)
    first_step = min(s.start_s for s in learner if s.name == "train-step")
    assert min(s.start_s for s in generated) < first_step
    assert load_run(run).spans("actor") == actor  # what the analysis scripts get


def test_a_run_writes_histograms_texts_and_the_layout_to_tensorboard(run):
    acc = read_tensorboard(run / "tb")
    assert set(HISTOGRAM_TAGS) <= set(acc.Tags()["histograms"])
    steps, _ = read_metrics(run)
    for tag in HISTOGRAM_TAGS:
        assert [e.step for e in acc.Histograms(tag)] == [1, 2, 3], tag
    for line in steps:
        by_tag = {tag: next(e.histogram_value for e in acc.Histograms(tag) if e.step == line["step"])
                  for tag in HISTOGRAM_TAGS}
        assert by_tag["staleness/per_sample"].num == 32  # one value per sample: 8 groups x 4
        counts = {int(k.rsplit("_", 1)[1]): v for k, v in line.items() if k.startswith("staleness/count_")}
        assert by_tag["staleness/per_sample"].sum == sum(k * v for k, v in counts.items())
        assert by_tag["train/reward"].num == 32
        assert by_tag["train/response_len"].sum == pytest.approx(32 * line["train/response_len_mean"])
        # One learner rank holds every response token: one weight per token.
        assert by_tag["is/weight"].num == by_tag["train/response_len"].sum
        assert by_tag["is/weight"].min > 0
        # The jsonl lines keep their flat scalar keys only.
        assert set(STEP_KEYS) <= line.keys() and not set(HISTOGRAM_TAGS) & line.keys()
    assert [e.step for e in acc.Tensors(f"{GENERATIONS_TAG}/text_summary")] == [2]
    table = text_at(acc, 2).splitlines()
    assert table[0] == "| prompt | response | reward | version |" and len(table) == 2 + 4
    assert all(row.split("|")[1].strip().endswith("=") for row in table[2:])  # the arithmetic prompts "a+b="
    assert layout_categories(acc) == ["staleness", "throughput", "losses", "sync", "memory"]


# ------------------------------------------------------------------ the logger alone


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) if i < 26 else "|" for i in ids)


def fake_group(version=1, rewards=(1.0, 0.0), truncated=(0, 1)):
    return SimpleNamespace(prompt_tokens=np.array([0, 1], np.int32), version=version,
                           response_tokens=np.array([[2, 30, 3], [4, 5, 6]], np.int32),
                           response_lengths=np.array([2, 3], np.int32), rewards=np.array(rewards, np.float32),
                           truncated=np.array(truncated, np.uint8))


def test_batch_histograms_have_one_value_per_sample():
    hist = batch_histograms([fake_group(), fake_group(rewards=(0.5, 0.25))], staleness=[0, 2])
    assert hist["staleness/per_sample"].tolist() == [0, 0, 2, 2]
    assert hist["train/response_len"].tolist() == [2, 3, 2, 3]
    assert hist["train/reward"].tolist() == [1.0, 0.0, 0.5, 0.25]


def test_generations_table_is_markdown_with_escaped_cells():
    from async_rl.prompting import CUT_MARK, PromptFormat

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
