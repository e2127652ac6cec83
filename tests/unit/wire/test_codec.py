"""Wire protocol: round trips over real zmq sockets, zero copy, rejections, fuzzing."""

import logging
import threading

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wire_samples import CASES, LIMITS, SAMPLES, TIMEOUT_MS, _group, _header_edit, assert_same, make_group, make_spans

from async_rl.wire import (
    MESSAGE_TYPES,
    SCHEMA,
    ExperienceGroup,
    Goodbye,
    RejectCounter,
    TraceSpans,
    WireError,
    WireLimits,
    WorkRequest,
    claimed_group,
    decode,
    encode,
    recv,
    send,
)


def test_every_kind_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


def test_header_is_schema_then_the_tagged_message():
    for msg in SAMPLES:
        header = msgpack.unpackb(encode(msg)[0])
        assert list(header) == ["schema", "message"] and header["schema"] == SCHEMA
        assert header["message"]["kind"] == msg.KIND == type(msg).KIND
        assert set(header["message"]) == {"kind", *msg.__struct_fields__}


# ------------------------------------------------------------------ real sockets


def _setup(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    return sock


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _pair(ctx, bind_type, connect_type):
    server = _setup(ctx.socket(bind_type))
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = _setup(ctx.socket(connect_type))
    client.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def test_round_trip_push_pull(ctx):
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    counter = RejectCounter()
    for msg in SAMPLES:
        send(push, msg)
        identity, got = recv(pull, LIMITS, counter, routed=False)
        assert identity is None
        assert_same(msg, got)
    assert counter.total == 0


def test_round_trip_dealer_router(ctx):
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"actor-7")
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))  # identity applies on connect
    counter = RejectCounter()
    for msg in SAMPLES:
        send(dealer, msg)
        identity, got = recv(router, LIMITS, counter, routed=True)
        assert identity is not None
        assert_same(msg, got)
        send(router, msg, identity=identity)  # and back to the same dealer
        none, back = recv(dealer, LIMITS, counter, routed=False)
        assert none is None
        assert_same(msg, back)
    assert counter.total == 0


def test_recv_rejects_and_counts_instead_of_raising(ctx):
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    counter = RejectCounter()
    push.send_multipart([b"\xc1 not msgpack"])
    assert recv(pull, LIMITS, counter, routed=False) == (None, None)
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    dealer.send_multipart([msgpack.packb({"schema": 99})])
    identity, msg = recv(router, LIMITS, counter, routed=True)
    assert msg is None and isinstance(identity, bytes)
    assert counter.by_reason() == {"not_msgpack": 1, "bad_schema": 1}


def test_zero_copy_over_zmq(ctx):
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    msg = make_group(g=8, t=4096)  # arrays well above pyzmq's copy threshold
    frames = encode(msg)
    # encode: frames alias the message's own arrays
    assert np.shares_memory(np.frombuffer(frames[2], np.uint8), msg.response_tokens)
    push.send_multipart(frames, copy=False)
    parts = pull.recv_multipart(copy=False)
    got = decode(parts, LIMITS)
    assert_same(msg, got)
    # decode: arrays alias the received frames' buffers
    for i, name in enumerate(["prompt_tokens", "response_tokens", "response_lengths",
                              "logprobs", "token_versions", "rewards"], start=1):
        assert np.shares_memory(getattr(got, name), np.frombuffer(parts[i].buffer, np.uint8)), name


def test_zero_copy_from_bytes():
    frames = [bytes(f) for f in encode(make_group())]
    got = decode(frames, LIMITS)
    assert np.shares_memory(got.logprobs, np.frombuffer(frames[4], np.uint8))


def test_unaligned_frames_are_copied_not_misread():
    frames = [bytes(f) for f in encode(make_group())]
    shifted = bytearray(1 + len(frames[4]))
    shifted[1:] = frames[4]
    frames[4] = memoryview(shifted)[1:]  # logprobs at an odd address
    got = decode(frames, LIMITS)
    assert got.logprobs.flags.aligned
    assert got.logprobs.tobytes() == make_group().logprobs.tobytes()


def test_messages_without_reward_errors_mean_none_failed():
    """Senders from before reward_errors existed: absent counts decode as zeros."""
    for msg in (make_group(), SAMPLES[-1]):
        got = decode(_header_edit(msg, lambda h: [h["message"].pop(k) for k in ("reward_errors", "env_errors")]),
                     LIMITS)
        assert got.reward_errors == got.env_errors == [0, 0, 0, 0] and type(got.reward_errors) is list
        assert got.first_failure == ""


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejections(case):
    frames, reason = CASES[case]
    with pytest.raises(WireError) as info:
        decode(frames, LIMITS)
    assert info.value.reason == reason, info.value


def test_invalid_trace_spans_are_rejected_and_counted(ctx):
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    counter = RejectCounter()
    cases = [CASES[c] for c in ("spans_names_longer", "spans_unknown_name", "spans_negative_duration",
                                "spans_too_many")]
    for frames, _ in cases:
        push.send_multipart(frames)
        assert recv(pull, LIMITS, counter, routed=False) == (None, None)
    send(push, make_spans(1024))  # the most one message may carry
    _, ok = recv(pull, LIMITS, counter, routed=False)
    assert isinstance(ok, TraceSpans) and len(ok.names) == 1024
    assert counter.by_reason() == {"shape_mismatch": 1, "unknown_span": 1, "bad_value": 1, "too_large": 1}


def test_responses_are_the_flat_arrays_cut_at_the_lengths():
    msg = decode(encode(make_group()), LIMITS)
    parts = msg.responses()
    assert [len(r.tokens) for r in parts] == msg.response_lengths.tolist()
    for name, field in (("tokens", "response_tokens"), ("logprobs", "logprobs"), ("versions", "token_versions")):
        pieces = [getattr(r, name) for r in parts]
        assert all(np.shares_memory(p, getattr(msg, field)) for p in pieces), name  # views, no copy
        assert np.concatenate(pieces).tobytes() == getattr(msg, field).tobytes(), name
    others = {f: getattr(msg, f) for f in msg.__struct_fields__
              if f not in ("response_tokens", "response_lengths", "logprobs", "token_versions")}
    assert_same(ExperienceGroup.from_responses(parts, **others), msg)


def test_a_group_of_empty_responses_has_no_token_version_to_match():
    empty = _group(response_tokens=np.zeros(0, np.int32), response_lengths=np.zeros(4, np.int32),
                   logprobs=np.zeros(0, np.float32), token_versions=np.zeros(0, np.int32), version=9)
    got = decode(encode(empty), LIMITS)
    assert got.version == 9 and [len(r.tokens) for r in got.responses()] == [0, 0, 0, 0]


def test_size_limits():
    big = encode(make_group(g=8, t=256))
    with pytest.raises(WireError, match="too_large"):
        decode(big, WireLimits(max_message_bytes=1000))
    with pytest.raises(WireError, match="too_large"):
        decode(encode(Goodbye("x" * 100)), WireLimits(max_header_bytes=64))
    with pytest.raises(WireError, match="too_large"):
        decode(big, WireLimits(max_tokens=128))
    with pytest.raises(WireError, match="too_large"):
        decode(big, WireLimits(max_group_size=4))


def test_encode_coerces_numpy_scalars_and_refuses_non_messages():
    msg = WorkRequest(actor_id=np.int64(1), version=np.int32(2), max_groups=3)
    assert decode(encode(msg)) == WorkRequest(1, 2, 3)
    with pytest.raises(TypeError):
        encode(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode(WorkRequest(actor_id=1.5, version=0, max_groups=1))
    with pytest.raises(TypeError):
        encode(Goodbye(reason=None))  # type: ignore[arg-type]


def test_encode_sends_values_out_of_range_for_the_receiver_to_count():
    """A negative or NaN value is data, not a sender bug: it reaches the receiver,
    which rejects and counts it."""
    for msg, reason in [(WorkRequest(actor_id=-1, version=0, max_groups=1), "bad_value"),
                        (Goodbye("x", actor_id=-2), "bad_value"),
                        (TraceSpans(**{**msgspec.structs.asdict(make_spans()), "dropped": 2**63}), "bad_value"),
                        (_group(gen_seconds=float("nan")), "non_finite"),
                        (_group(greedy_reward=float("inf")), "non_finite")]:
        with pytest.raises(WireError) as info:
            decode(encode(msg), LIMITS)
        assert info.value.reason == reason, msg


def test_claimed_group_reads_the_ids_of_a_rejected_experience_group():
    bad = CASES["version_mismatch"][0]
    with pytest.raises(WireError):
        decode(bad, LIMITS)
    assert claimed_group(bad, LIMITS) == (1, 17)
    assert claimed_group(CASES["nan_logprobs"][0], LIMITS) == (1, 17)
    assert claimed_group(encode(WorkRequest(1, 2, 3)), LIMITS) is None
    for case in ("random_bytes", "no_frames", "msgpack_non_map"):
        assert claimed_group(CASES[case][0], LIMITS) is None
    assert claimed_group(_header_edit(make_group(), lambda h: h["message"].update(actor_id="1")), LIMITS) is None
    assert claimed_group(encode(make_group()), WireLimits(max_header_bytes=16)) is None


# ------------------------------------------------------------------ RejectCounter


def test_reject_counter_counts_and_logs_once_per_reason(caplog):
    counter = RejectCounter()
    with caplog.at_level(logging.WARNING, logger="async_rl.wire"):
        for frames, _ in [CASES["random_bytes"], CASES["wrong_schema"]] * 3:
            try:
                decode(frames, LIMITS)
            except WireError as err:
                counter.record(err)
    assert counter.total == 6
    assert counter.by_reason() == {"not_msgpack": 3, "bad_schema": 3}
    logged = [r for r in caplog.records if r.name == "async_rl.wire"]
    assert len(logged) == 2
    assert "not_msgpack" in logged[0].getMessage() and "bad_schema" in logged[1].getMessage()


def test_reject_counter_counts_receiver_side_refusals():
    counter = RejectCounter()
    counter.reject("unknown_actor", "id 9")
    counter.reject("unknown_actor")
    assert counter.total == 2 and counter.by_reason() == {"unknown_actor": 2}


def test_reject_counter_is_thread_safe():
    counter = RejectCounter(logging.getLogger("async_rl.wire.test"))
    errors = [WireError(f"r{i % 3}") for i in range(1000)]

    def work():
        for err in errors:
            counter.record(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert counter.total == 4000
    assert sum(counter.by_reason().values()) == 4000


# ------------------------------------------------------------------ fuzzing


def _decode_only_wire_errors(frames, limits=LIMITS):
    try:
        decode(frames, limits)
    except WireError as err:
        assert err.reason and err.reason.isidentifier()


# Example counts keep the whole file under 10 s on 2 busy cores; 2200 inputs in all.
FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_fuzz_random_frames(frames):
    _decode_only_wire_errors(frames)


_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can represent
_scalars = st.none() | st.booleans() | _ints | st.floats() \
    | st.text(max_size=8) | st.binary(max_size=8)
# Shallow on purpose: recursive strategies cost hypothesis far more than decode does.
_values = _scalars | st.lists(_scalars, max_size=3) \
    | st.dictionaries(st.text(max_size=6) | _ints, _scalars, max_size=3)
_kinds = st.sampled_from(sorted(MESSAGE_TYPES))
_dtypes = st.sampled_from(["int32", "int64", "float32", "float16", "float64", "bool"])


def _array_fields(cls) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls) if getattr(f.type, "__origin__", None) is np.ndarray]


@st.composite
def _headers(draw):
    """Headers that are mostly well-formed, so inputs get past the first checks."""

    def pick(plausible):
        return draw(plausible) if draw(st.integers(0, 9)) else draw(_values)

    kind = pick(_kinds)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    fields = msgspec.structs.fields(cls) if cls else []
    arrays = _array_fields(cls) if cls else []
    message = {f.name: draw(_values) for f in fields if f.name not in arrays and draw(st.integers(0, 9))}
    for _ in range(draw(st.integers(0, len(arrays) + 1)) if draw(st.integers(0, 3)) else 0):
        name = pick(st.sampled_from(arrays or ["x"]))
        message[name if not isinstance(name, (list, dict)) else "x"] = {
            "dtype": pick(_dtypes), "shape": pick(st.lists(st.integers(-2, 9), max_size=3)),
            "frame": pick(st.integers(-1, 8))}
    if draw(st.integers(0, 19)):
        message["kind"] = kind
    header = {"schema": pick(st.just(SCHEMA)), "message": pick(st.just(message))}
    if not draw(st.integers(0, 19)):
        header.pop(draw(st.sampled_from(sorted(header))))
    return header


@settings(FUZZ, max_examples=600)
@given(_headers(), st.lists(st.binary(max_size=96), max_size=6))
def test_fuzz_structured_headers(header, payload):
    frames = [msgpack.packb(header, use_bin_type=True, strict_types=False), *payload]
    _decode_only_wire_errors(frames)


@settings(FUZZ, max_examples=600)
@given(st.sampled_from(range(len(SAMPLES))), st.data())
def test_fuzz_mutated_valid_messages(index, data):
    frames = [bytearray(f) for f in encode(SAMPLES[index])]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frames) - 1))
        if frames[i]:
            pos = data.draw(st.integers(0, len(frames[i]) - 1))
            frames[i][pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
    _decode_only_wire_errors([bytes(f) for f in frames])
