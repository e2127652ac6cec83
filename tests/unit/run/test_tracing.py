"""The timeline (async_rl/run/tracing.py): bounded span recorders, the Chrome-trace file that
the run reader (async_rl/run/directory.py) reads, actors' spans shipped over the wire and
accepted (or rejected and counted) by a real coordinator."""
import json
import time

import numpy as np
import pytest
import zmq
from conftest import ask, dealer, running_coordinator, wait_for
from wire_samples import make_spans

from async_rl.actor.process import _ship_spans
from async_rl.run.directory import read_trace
from async_rl.run.tracing import (
    ACTOR_SPANS,
    SPAN_ARG_KEYS,
    Span,
    SpanRecorder,
    TraceWriter,
    WaitSpan,
    spans_from_arrays,
    spans_to_arrays,
)
from async_rl.wire import Hello, RejectCounter, TraceSpans, WireLimits, encode, recv, send

# ------------------------------------------------------------------ recorder


def test_recorder_keeps_the_newest_spans_and_counts_the_dropped():
    rec = SpanRecorder(capacity=100)
    for i in range(10_000):
        rec.record("generate", start_us=i, dur_us=1)
    assert len(rec) == 100  # memory stays bounded however long the run
    held, dropped = rec.snapshot()
    assert dropped == 9_900 and [s.start_us for s in held] == list(range(9_900, 10_000))
    taken, dropped = rec.take(30)
    assert dropped == 9_900 and [s.start_us for s in taken] == list(range(9_900, 9_930))
    taken, dropped = rec.take(1000)  # the drop count is reported once
    assert dropped == 0 and len(taken) == 70 and len(rec) == 0
    rec.count_lost(5)  # spans taken for a send that failed
    assert rec.take(10) == ([], 5)


def test_recorder_span_context_records_args_filled_in_the_body_and_clamps_durations():
    rec = SpanRecorder()
    before = time.time_ns() // 1000
    with rec.span("generate", groups=4) as args:
        time.sleep(0.01)
        args["tokens"] = 37
    with pytest.raises(RuntimeError), rec.span("push"):
        raise RuntimeError("a span ends also when its body raises")
    rec.record("score", start_us=5, dur_us=-3)  # a clock step backwards
    (gen, push, score), _ = rec.snapshot()
    assert gen.name == "generate" and gen.args == {"groups": 4, "tokens": 37}
    assert before <= gen.start_us and gen.dur_us >= 10_000
    assert push.name == "push" and push.args is None and score.dur_us == 0


def test_disabled_recorder_holds_nothing():
    rec = SpanRecorder(enabled=False)
    with rec.span("train-step"):
        pass
    rec.record("sync", 1, 1)
    assert len(rec) == 0


def test_wait_span_merges_a_run_of_waits_into_one_span():
    rec = SpanRecorder()
    waiting = WaitSpan(rec, "wait-for-admission")
    waiting.done()  # not waiting: nothing
    for since in (100, 200, 300):  # three Wait replies in a row
        waiting.waiting(since_us=since)
    waiting.done()
    waiting.done()
    (span,), _ = rec.snapshot()
    assert span.name == "wait-for-admission" and span.start_us == 100 and span.dur_us > 0


def test_spans_travel_as_arrays_and_only_known_args_leave_the_process():
    spans = [Span("generate", 10, 5, {"groups": 2, "tokens": 9, "local_only": 1}), Span("push", 20, 1),
             Span("sync", 30, 2, {"version": 0})]
    names, start, dur, args = spans_to_arrays(spans)
    assert args.shape == (3, len(SPAN_ARG_KEYS)) and args.dtype == np.int64
    back = spans_from_arrays(names, start, dur, args)
    assert back == [Span("generate", 10, 5, {"groups": 2, "tokens": 9}), Span("push", 20, 1),
                    Span("sync", 30, 2, {"version": 0})]
    msg = TraceSpans(actor_id=0, dropped=0, names=names, start_us=start, dur_us=dur, args=args)
    from async_rl.wire import decode
    assert decode(encode(msg)).names == names


# ------------------------------------------------------------------ trace.json


def test_trace_file_is_chrome_trace_json_that_the_run_reader_reads(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json")
    writer.learner.record("train-step", 1_000_000, 250_000, {"step": 1})
    names, start, dur, args = spans_to_arrays([Span("generate", 1_100_000, 50_000, {"groups": 4, "tokens": 40})])
    writer.add_actor_spans(0, names, start, dur, args, dropped=2)
    writer.write()
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, then renamed
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["dropped_spans"] == {"learner": 0, "actor-0": 2}
    tracks = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"
              and e["name"] == "process_name"}
    assert sorted(tracks.values()) == ["actor-0", "learner"] and len(set(tracks)) == 2
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            assert {"name", "pid", "tid", "ts", "dur"} <= e.keys()
            assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["pid"] in tracks
    spans = read_trace(tmp_path / "trace.json")
    assert [(s.track, s.name, s.start_s, s.dur_s, s.args) for s in spans] == [
        ("learner", "train-step", 1.0, 0.25, {"step": 1}),
        ("actor-0", "generate", 1.1, 0.05, {"groups": 4, "tokens": 40})]


def test_trace_writer_bounds_every_track_and_reports_drops(tmp_path):
    writer = TraceWriter(tmp_path / "trace.json", capacity=50)
    for i in range(500):
        writer.learner.record("train-step", i, 1)
    for batch in range(3):
        writer.add_actor_spans(7, *spans_to_arrays([Span("push", batch * 100 + i, 1) for i in range(40)]))
    writer.write()
    doc = json.loads((tmp_path / "trace.json").read_text())
    assert doc["otherData"]["dropped_spans"] == {"learner": 450, "actor-7": 70}
    assert doc["otherData"]["max_spans_per_track"] == 50
    spans = read_trace(tmp_path / "trace.json")
    assert len([s for s in spans if s.track == "learner"]) == 50
    assert len([s for s in spans if s.track == "actor-7"]) == 50


def test_resumed_writer_continues_the_trace_left_at_the_checkpoint(tmp_path):
    first = TraceWriter(tmp_path / "trace.json")
    first.learner.record("checkpoint", 100, 10)
    first.add_actor_spans(0, *spans_to_arrays([Span("generate", 50, 5, {"groups": 1})]), dropped=3)
    first.write()
    resumed = TraceWriter(tmp_path / "trace.json", resume=True)
    resumed.learner.record("train-step", 200, 10)
    resumed.write()
    spans = read_trace(tmp_path / "trace.json")
    assert [(s.track, s.name) for s in spans] == [("learner", "checkpoint"), ("learner", "train-step"),
                                                  ("actor-0", "generate")]
    assert json.loads((tmp_path / "trace.json").read_text())["otherData"]["dropped_spans"]["actor-0"] == 3
    (tmp_path / "trace.json").write_text("{not json")
    assert len(TraceWriter(tmp_path / "trace.json", resume=True).learner) == 0  # a warning, not a crash


# ------------------------------------------------------------------ over the wire


def test_actor_ships_pending_spans_in_bounded_messages_and_counts_failed_sends():
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVTIMEO, 5000)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        spans = SpanRecorder(capacity=2000)
        for i in range(2500):
            spans.record("generate" if i % 2 else "push", 1_000 + i, 3)
        sizes = []
        while len(spans):
            _ship_spans(push, 4, spans)
            _, msg = recv(pull, WireLimits(), RejectCounter(), routed=False)
            assert isinstance(msg, TraceSpans) and msg.actor_id == 4 and set(msg.names) <= ACTOR_SPANS
            sizes.append((len(msg.names), msg.dropped))
        assert sizes == [(1024, 500), (976, 0)]  # 500 dropped by the full recorder, reported once
        _ship_spans(push, 4, spans)  # nothing pending: nothing sent
        with pytest.raises(zmq.Again):
            pull.recv_multipart(flags=zmq.NOBLOCK)

        lonely = ctx.socket(zmq.DEALER)  # no peer: a non-blocking send fails
        lonely.setsockopt(zmq.LINGER, 0)
        spans.record("score", 1, 1)
        _ship_spans(lonely, 4, spans, flags=zmq.NOBLOCK)
        assert spans.take(10) == ([], 1)  # lost, and counted as dropped
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def hub(tmp_path):
    with running_coordinator(tmp_path, {"train": {"batch_groups": 4, "group_size": 2}}) as running:
        yield running


def test_coordinator_hands_valid_spans_to_the_trace_and_counts_the_rest(hub):
    coord, ctx, _ = hub
    actor = dealer(ctx, coord.hub_addr)
    welcome = ask(actor, Hello(actor_name="t", pid=1, host="h"))
    beat = dealer(ctx, coord.hub_addr)  # the heartbeat thread's own socket
    send(beat, make_spans(3, actor_id=welcome.actor_id, dropped=2))
    track = coord.trace.track(f"actor-{welcome.actor_id}")
    assert wait_for(lambda: len(track) == 3)
    assert [s.name for s in track.snapshot()[0]] == ["generate", "score", "push"] and track.snapshot()[1] == 2

    send(beat, make_spans(2, actor_id=welcome.actor_id + 5))  # an actor nobody registered
    bad_names = make_spans(3, actor_id=welcome.actor_id, names=["generate", "train-step", "push"])
    bad_lengths = make_spans(3, actor_id=welcome.actor_id, names=["generate"] * 2)
    negative = make_spans(3, actor_id=welcome.actor_id, dur_us=np.array([1, -1, 1], dtype=np.int64))
    for msg in (bad_names, bad_lengths, negative):
        beat.send_multipart(encode(msg))  # encode does not validate; the hub's decode does
    assert wait_for(lambda: coord.rejects.total == 4)
    assert coord.rejects.by_reason() == {"unknown_actor": 1, "unknown_span": 1, "shape_mismatch": 1,
                                         "bad_value": 1}
    tracks = coord.trace.document()["otherData"]["dropped_spans"]
    assert len(track) == 3 and list(tracks) == ["learner", f"actor-{welcome.actor_id}"]
