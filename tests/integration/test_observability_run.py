"""Observability of a real run: the timeline (trace.json, Chrome trace format, read by
async_rl/run/directory.py), TensorBoard's histograms, sample generations and custom-scalars
layout, and every documented metric on every step line. One tiny `async-rl train` run."""
import json

import pytest
from conftest import layout_categories, read_metrics, read_tensorboard, text_at, train

from async_rl.run.directory import load_run, read_trace
from async_rl.run.metrics import GENERATIONS_TAG, HISTOGRAM_TAGS, STEP_KEYS


@pytest.fixture(scope="module")
def observed(tmp_path_factory, demo_model):
    """The run directory and the run's log (stderr)."""
    path = tmp_path_factory.mktemp("observed") / "run"
    proc = train(path, demo_model, "train.max_steps=3", "learner.ranks=1", "metrics.text_every=2")
    return path, proc.stderr


@pytest.fixture(scope="module")
def run(observed):
    return observed[0]


def test_a_run_writes_a_timeline_of_learner_and_actor(observed):
    run, log = observed
    doc = json.loads((run / "trace.json").read_text())
    dropped = doc["otherData"]["dropped_spans"]
    assert doc["displayTimeUnit"] == "ms" and dropped.pop("learner") == 0
    spans = read_trace(run / "trace.json")
    learner = [s for s in spans if s.track == "learner"]
    actor = [s for s in spans if s.track == "actor-0"]
    names = {s.name for s in learner}
    assert {"wait-for-data", "train-step", "sync", "save-version", "eval", "checkpoint", "export"} == names
    assert [s.args["step"] for s in learner if s.name == "train-step"] == [1, 2, 3]
    # One wall clock: the tracks line up.
    start, end = min(s.start_s for s in learner), max(s.start_s + s.dur_s for s in learner)
    assert all(start - 60 < s.start_s < end + 60 and s.dur_s >= 0 for s in actor)
    assert {s.name for s in actor} <= {"generate", "score", "push", "sync", "wait-for-admission", "wait-for-rewards",
                                       "eval"}
    # An actor's spans reach the learner with its heartbeats (one a second: this whole run
    # may take less) and, all it still holds, on its request socket just before its
    # goodbye. The end of a run waits for goodbyes a bounded time only: on a loaded machine
    # the goodbye can come too late, and the learner logs that the actor's last spans are
    # lost. Its track then holds what its heartbeats shipped, if anything, none of it dropped.
    if "actor 0 (actor-0) removed: said goodbye" not in log:
        assert set(dropped) <= {"actor-0"} and not any(dropped.values()), dropped
        assert {s.track for s in spans} <= {"learner", "actor-0"}
        return
    # The goodbye came: every span of the actor's is here.
    assert dropped == {"actor-0": 0}
    assert {s.track for s in spans} == {"learner", "actor-0"}
    # The evaluator scores the rounds (the learner's "save-version" spans hand it the
    # weights, its "eval" span is the wait for the final round): the actor only generates.
    assert {"generate", "score", "push", "sync"} <= {s.name for s in actor} and "eval" not in {s.name for s in actor}
    generated = [s for s in actor if s.name == "generate"]
    assert all(s.args["groups"] == 4 and s.args["tokens"] > 0 for s in generated)
    # Every group the learner trained on was generated (and pushed) by the actor.
    assert sum(s.args["groups"] for s in generated) >= 3 * 8
    assert sum(s.args["groups"] for s in actor if s.name == "push") >= 3 * 8
    # The actor generated while the learner waited.
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
        # One learner rank holds every response token: one weight per token it trained,
        # all of them unless groups without a gradient were left out.
        trained_all = line["train/zero_adv_group_frac"] == 0
        assert 0 < by_tag["is/weight"].num <= by_tag["train/response_len"].sum
        assert trained_all <= (by_tag["is/weight"].num == by_tag["train/response_len"].sum)
        assert by_tag["is/weight"].min > 0
        # One sequence log-ratio per response trained, each the log of its tokens' product.
        assert 0 < by_tag["is/seq_log_ratio"].num <= 32
        assert trained_all <= (by_tag["is/seq_log_ratio"].num == 32)
        # The jsonl lines keep their flat scalar keys only.
        assert set(STEP_KEYS) <= line.keys() and not set(HISTOGRAM_TAGS) & line.keys()
    assert [e.step for e in acc.Tensors(f"{GENERATIONS_TAG}/text_summary")] == [2]
    table = text_at(acc, 2).splitlines()
    assert table[0] == "| prompt | response | reward | version |" and len(table) == 2 + 4
    assert all(row.split("|")[1].strip().endswith("=") for row in table[2:])  # the arithmetic prompts "a+b="
    assert layout_categories(acc) == ["staleness", "throughput", "off-policy", "losses", "sync", "memory"]


def test_every_step_line_has_the_documented_metrics(run):
    """docs/observability.md's step metrics (the algorithm diagnostics aside), each
    with the meaning it documents for this run: 8 groups of 4 per step, nothing dropped."""
    from async_rl.wire.messages import FAILURE_REASONS as REASONS

    documented = {
        "train/reward_mean", "train/samples", "train/response_len_mean", "train/response_len_max",
        "train/truncated_frac", "loss/total", "staleness/mean", "staleness/max", "staleness/dropped", "is/ess",
        "is/clip_frac", "throughput/samples_per_s", "throughput/gen_tokens_per_s", "learner/idle_frac",
        "sync/seconds", "sync/broadcast_seconds", "learner/grad_norm", "learner/lr", "learner/skipped_steps",
        "wire/rejected", "actors/live", "data/prompts_admitted", "data/prompts_consumed", "data/prompts_skipped",
        "actors/gen_seconds_per_group", "actors/gen_tokens_per_s", "actors/mixed_version_frac",
        "actors/token_staleness_mean", "memory/learner_peak_rss_gb", "memory/actor_peak_rss_gb",
        "reward/errors", "reward/error_frac", *(f"reward/errors_{reason}" for reason in REASONS)}
    steps, _ = read_metrics(run)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert documented <= s.keys(), documented - s.keys()
        counts = {k: v for k, v in s.items() if k.startswith("staleness/count_")}
        assert sum(counts.values()) == 32 and s["staleness/max"] == max(int(k.rsplit("_", 1)[1]) for k in counts)
        assert s["train/samples"] == 32 * s["step"] and s["data/prompts_consumed"] == 8 * s["step"]
        assert s["data/prompts_admitted"] >= s["data/prompts_consumed"] and s["staleness/dropped"] == 0
        assert s["actors/live"] == 1 and s["wire/rejected"] == 0 and s["learner/skipped_steps"] == 0
        assert s["reward/errors"] == 0 and s["reward/error_frac"] == 0 and s["data/prompts_skipped"] == 0
        assert 0 <= s["learner/idle_frac"] <= 1 and s["throughput/samples_per_s"] > 0
        assert s["memory/learner_peak_rss_gb"] > 0 and s["learner/lr"] > 0
