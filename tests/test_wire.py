"""Wire protocol: round trips over real zmq sockets, zero copy, rejections, fuzzing."""

import dataclasses
import logging
import threading

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.transport import (
    MESSAGE_TYPES,
    EvalGrant,
    EvalResult,
    ExperienceGroup,
    Goodbye,
    Heartbeat,
    Hello,
    RejectCounter,
    SyncDone,
    SyncOrder,
    TraceSpans,
    Wait,
    Welcome,
    WireError,
    WireLimits,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
    recv,
    send,
)

LIMITS = WireLimits()
TIMEOUT_MS = 2000


def make_group(g: int = 4, t: int = 6, p: int = 5, seed: int = 0) -> ExperienceGroup:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=g).astype(np.int32)
    versions = rng.integers(3, 6, size=(g, t)).astype(np.int32)
    versions[0, 0] = 2  # the oldest token; position 0 is always a real token
    return ExperienceGroup(
        actor_id=1, group=17, prompt_id=42, version=2,
        prompt_tokens=rng.integers(0, 16, size=p).astype(np.int32),
        response_tokens=rng.integers(0, 16, size=(g, t)).astype(np.int32),
        response_lengths=lengths,
        logprobs=-rng.random((g, t), dtype=np.float32) * 3,
        token_versions=versions,
        rewards=rng.random(g, dtype=np.float32),
        truncated=(lengths == t).astype(np.uint8),
        gen_seconds=0.25, greedy_reward=None,
    )


SAMPLES = [
    Hello(actor_name="actor-0", pid=1234, host="node1"),
    Welcome(actor_id=3, config_yaml="seed: 1\n", experience_addr="tcp://127.0.0.1:5000", version=7),
    WorkRequest(actor_id=3, version=7, max_groups=4),
    WorkGrant(groups=[10, 11], prompt_ids=[5, 9]),
    Wait(seconds=0.5),
    SyncOrder(epoch=2, rank=1, world_size=3, store_host="127.0.0.1", store_port=29500, version=8),
    SyncDone(actor_id=3, epoch=2, version=8),
    Heartbeat(actor_id=3, version=8, generated_groups=100, peak_rss_mb=812.5),
    Goodbye(reason="shutdown"),
    make_group(),
    ExperienceGroup(**{**make_group().__dict__, "greedy_reward": 1.0}),
    EvalGrant(round=3, version=7, prompt_ids=[2**48, 2**48 + 1]),
    EvalResult(actor_id=3, round=3, version=7, prompt_ids=[2**48, 2**48 + 1], rewards=np.array([[1.0], [0.0]], np.float32),
               response_lengths=np.array([[3], [8]], np.int32), truncated=np.array([[0], [1]], np.uint8)),
]


def make_spans(n: int = 3, **changes) -> TraceSpans:
    names = ["generate", "score", "push", "wait-for-admission", "sync"]
    args = np.full((n, 3), -1, dtype=np.int64)
    args[:, 0] = 4  # groups
    fields = dict(actor_id=3, dropped=0, names=[names[i % len(names)] for i in range(n)],
                  start_us=1_790_000_000_000_000 + np.arange(n, dtype=np.int64) * 1000,
                  dur_us=np.full(n, 250, dtype=np.int64), args=args)
    return TraceSpans(**{**fields, **changes})


# Appended, not inserted: CASES below refer to SAMPLES by position.
SAMPLES += [make_spans(), make_spans(0, dropped=7)]
# Failed reward calls (per reward_guard.REASONS) travel with experience and eval results.
SAMPLES += [
    ExperienceGroup(**{**make_group().__dict__, "reward_errors": [1, 0, 2, 1]}),
    EvalResult(actor_id=3, round=3, version=7, prompt_ids=[2**48], rewards=np.array([[0.0, 1.0]], np.float32),
               response_lengths=np.array([[3, 8]], np.int32), truncated=np.array([[0, 1]], np.uint8),
               reward_errors=[0, 1, 0, 1]),
]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name, x in a.__dict__.items():
        y = b.__dict__[name]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()  # bit-identical
        else:
            assert x == y and type(x) is type(y), name


def test_every_kind_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES.values())


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


# ------------------------------------------------------------------ rejections


def _header_edit(msg, edit, frames_edit=None):
    frames = [bytes(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[0])
    edit(header)
    frames[0] = msgpack.packb(header)
    return frames_edit(frames) if frames_edit else frames


def _body(**changes):
    return lambda h: h["body"].update(changes)


def _array(array_name, **changes):
    def edit(h):
        next(a for a in h["arrays"] if a["name"] == array_name).update(changes)
    return edit


def _group(**changes):
    return ExperienceGroup(**{**make_group().__dict__, **changes})


def _nan_logprobs():
    lp = make_group().logprobs.copy()
    lp[0, 0] = np.nan
    return _group(logprobs=lp)


def _positive_logprobs():
    lp = make_group().logprobs.copy()
    lp[0, 0] = 0.5
    return _group(logprobs=lp)


HELLO = SAMPLES[0]
CASES = {
    "random_bytes": ([b"\xc1\x00\xff garbage"], "not_msgpack"),
    "trailing_bytes": ([encode(HELLO)[0] + b"\x00"], "not_msgpack"),
    "msgpack_non_map": ([msgpack.packb([1, 2, 3])], "bad_header"),
    "bytes_key": ([msgpack.packb({b"schema": 1})], "not_msgpack"),
    "int_key": ([msgpack.packb({1: 1}, strict_types=False)], "not_msgpack"),
    "ext_type": ([msgpack.packb(msgpack.ExtType(5, b"xx"))], "not_msgpack"),
    "no_frames": ([], "frame_count"),
    "wrong_schema": (_header_edit(HELLO, lambda h: h.update(schema=2)), "bad_schema"),
    "bool_schema": (_header_edit(HELLO, lambda h: h.update(schema=True)), "bad_schema"),
    "extra_header_key": (_header_edit(HELLO, lambda h: h.update(x=1)), "bad_header"),
    "unknown_kind": (_header_edit(HELLO, lambda h: h.update(kind="pickle")), "unknown_kind"),
    "missing_field": (_header_edit(HELLO, lambda h: h["body"].pop("pid")), "missing_field"),
    "unknown_field": (_header_edit(HELLO, _body(extra=1)), "unknown_field"),
    "str_for_int": (_header_edit(HELLO, _body(pid="7")), "bad_field_type"),
    "bool_for_int": (_header_edit(HELLO, _body(pid=True)), "bad_field_type"),
    "float_for_int": (_header_edit(HELLO, _body(pid=7.0)), "bad_field_type"),
    "none_for_str": (_header_edit(HELLO, _body(host=None)), "bad_field_type"),
    "negative_pid": (_header_edit(HELLO, _body(pid=-1)), "bad_value"),
    "huge_int": (_header_edit(HELLO, _body(pid=2**64 - 1)), "bad_value"),
    "nan_float": (_header_edit(Wait(1.0), _body(seconds=float("nan"))), "non_finite"),
    "grant_lengths": (_header_edit(SAMPLES[3], _body(prompt_ids=[5])), "shape_mismatch"),
    "grant_list_type": (_header_edit(SAMPLES[3], _body(groups=[1, "2"])), "bad_field_type"),
    "rank_ge_world": (_header_edit(SAMPLES[5], _body(rank=3)), "bad_value"),
    "bad_port": (_header_edit(SAMPLES[5], _body(store_port=70000)), "bad_value"),
    "unsupported_dtype": (_header_edit(make_group(), _array("logprobs", dtype="float64")), "bad_dtype"),
    "wrong_dtype": (_header_edit(make_group(), _array("logprobs", dtype="int32")), "bad_dtype"),
    "ndim_3": (_header_edit(make_group(), _array("logprobs", shape=[4, 6, 1])), "bad_shape"),
    "negative_dim": (_header_edit(make_group(), _array("rewards", shape=[-4])), "bad_shape"),
    "dim_too_large": (_header_edit(make_group(), _array("prompt_tokens", shape=[1 << 21])), "too_large"),
    "unknown_array": (_header_edit(make_group(), _array("rewards", name="mask")), "unknown_field"),
    "frame_count": (_header_edit(make_group(), lambda h: None, lambda f: f[:-1]), "frame_count"),
    "missing_array": (_header_edit(make_group(), lambda h: h["arrays"].pop(),
                                   lambda f: f[:-1]), "missing_field"),
    "frame_length": (_header_edit(make_group(), lambda h: None,
                                  lambda f: [f[0], f[1][:-4], *f[2:]]), "shape_mismatch"),
    "nan_logprobs": (encode(_nan_logprobs()), "non_finite"),
    "positive_logprobs": (encode(_positive_logprobs()), "bad_value"),
    "inconsistent_shapes": (encode(_group(token_versions=np.zeros((4, 7), np.int32))), "shape_mismatch"),
    "rewards_shape": (encode(_group(rewards=np.zeros(5, np.float32))), "shape_mismatch"),
    "length_above_t": (encode(_group(response_lengths=np.full(4, 7, np.int32))), "bad_value"),
    "negative_token": (encode(_group(prompt_tokens=np.array([1, -1], np.int32))), "bad_value"),
    "version_mismatch": (encode(_group(version=3)), "version_mismatch"),
    "negative_version": (encode(_group(token_versions=np.full((4, 6), -1, np.int32))), "bad_value"),
    "spans_names_longer": (encode(make_spans(names=["generate"] * 4)), "shape_mismatch"),
    "spans_dur_shorter": (encode(make_spans(dur_us=np.full(2, 250, np.int64))), "shape_mismatch"),
    "spans_args_width": (encode(make_spans(args=np.full((3, 2), -1, np.int64))), "shape_mismatch"),
    "spans_unknown_name": (encode(make_spans(names=["generate", "train-step", "push"])), "unknown_span"),
    "spans_negative_duration": (encode(make_spans(dur_us=np.array([250, -1, 250], np.int64))), "bad_value"),
    "spans_negative_start": (encode(make_spans(start_us=np.array([-5, 0, 1], np.int64))), "bad_value"),
    "spans_beyond_2_53": (encode(make_spans(start_us=np.full(3, 1 << 60, np.int64))), "bad_value"),
    "spans_arg_below_minus_1": (encode(make_spans(args=np.full((3, 3), -2, np.int64))), "bad_value"),
    "spans_too_many": (encode(make_spans(1025)), "too_large"),
    "spans_int32_times": (_header_edit(make_spans(), _array("start_us", dtype="int32")), "bad_dtype"),
    "spans_negative_dropped": (_header_edit(make_spans(), _body(dropped=-1)), "bad_value"),
    "empty_group": (encode(ExperienceGroup(**{
        **make_group().__dict__, "response_tokens": np.zeros((0, 6), np.int32),
        "response_lengths": np.zeros(0, np.int32), "logprobs": np.zeros((0, 6), np.float32),
        "token_versions": np.zeros((0, 6), np.int32), "rewards": np.zeros(0, np.float32),
        "truncated": np.zeros(0, np.uint8)})), "bad_value"),
    "truncated_not_0_or_1": (encode(_group(truncated=np.full(4, 2, np.uint8))), "bad_value"),
    "eval_result_shapes": (encode(EvalResult(actor_id=3, round=0, version=0, prompt_ids=[1, 2],
                                             rewards=np.zeros((2, 1), np.float32),
                                             response_lengths=np.zeros((1, 1), np.int32),
                                             truncated=np.zeros((2, 1), np.uint8))), "shape_mismatch"),
    "reward_errors_length": (encode(_group(reward_errors=[1, 0])), "shape_mismatch"),
    "reward_errors_negative": (_header_edit(make_group(), _body(reward_errors=[-1, 0, 0, 0])), "bad_value"),
    "reward_errors_float": (_header_edit(make_group(), _body(reward_errors=[0.5, 0, 0, 0])), "bad_field_type"),
    "reward_errors_above_samples": (encode(_group(reward_errors=[3, 0, 2, 0])), "bad_value"),
    "eval_reward_errors_above_samples": (encode(EvalResult(**{**SAMPLES[-1].__dict__, "reward_errors": [0, 3, 0, 0]})),
                                         "bad_value"),
}


def test_messages_without_reward_errors_mean_none_failed():
    """Senders from before reward_errors existed: absent counts decode as zeros."""
    for msg in (make_group(), SAMPLES[-1]):
        got = decode(_header_edit(msg, lambda h: h["body"].pop("reward_errors")), LIMITS)
        assert got.reward_errors == [0, 0, 0, 0] and type(got.reward_errors) is list


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


def test_padding_is_not_checked_for_logprob_sign_or_version():
    msg = make_group()
    lp, tv = msg.logprobs.copy(), msg.token_versions.copy()
    lengths = msg.response_lengths.copy()
    lengths[1] = 1
    lp[1, 1:], tv[1, 1:] = 5.0, 0  # padding: ignored by the group checks
    got = decode(encode(_group(logprobs=lp, token_versions=tv, response_lengths=lengths)), LIMITS)
    assert got.version == 2


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


@st.composite
def _headers(draw):
    """Headers that are mostly well-formed, so inputs get past the first checks."""

    def pick(plausible):
        return draw(plausible) if draw(st.integers(0, 9)) else draw(_values)

    kind = pick(_kinds)
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    fields = dataclasses.fields(cls) if cls else []
    arrays = [f.name for f in fields if "dtype" in f.metadata] or ["x"]
    body = {f.name: draw(_values) for f in fields if f.name not in arrays and draw(st.integers(0, 9))}
    descs = [
        {"name": pick(st.sampled_from(arrays)), "dtype": pick(_dtypes),
         "shape": pick(st.lists(st.integers(-2, 9), max_size=3))}
        for _ in range(draw(st.integers(0, len(arrays) + 1)) if draw(st.integers(0, 3)) else 0)
    ]
    header = {"schema": pick(st.just(1)), "kind": kind, "body": pick(st.just(body)),
              "arrays": pick(st.just(descs))}
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
