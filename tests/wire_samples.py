"""Sample messages of every kind and malformed wire frames with the reason each must be
rejected for: shared by the wire, tracing and hostile-traffic tests."""

import msgpack
import numpy as np
from msgspec.structs import replace

from async_rl.wire import (
    SCHEMA,
    EvalGrant,
    EvalResult,
    ExperienceGroup,
    Goodbye,
    Heartbeat,
    Hello,
    SyncDone,
    SyncOrder,
    TraceSpans,
    Wait,
    WeightsRejected,
    Welcome,
    WireLimits,
    WorkGrant,
    WorkRequest,
    encode,
)

LIMITS = WireLimits()
TRUNCATED_AND_AFTER = ("truncated", "policy_mask", "step_ends", "step_rewards", "unscorable", "components",
                       "component_ms", "component_failures")
TIMEOUT_MS = 30_000  # a send or receive on a local socket: at once, but a loaded machine may take its time


def make_group(g: int = 4, t: int = 6, p: int = 5, seed: int = 0) -> ExperienceGroup:
    """`g` responses of 1..`t` tokens each, end to end."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=g).astype(np.int32)
    r = int(lengths.sum())
    versions = rng.integers(3, 6, size=r).astype(np.int32)
    versions[0] = 2  # the oldest token
    return ExperienceGroup(
        actor_id=1, group=17, prompt_id=42, version=2,
        prompt_tokens=rng.integers(0, 16, size=p).astype(np.int32),
        response_tokens=rng.integers(0, 16, size=r).astype(np.int32),
        response_lengths=lengths,
        logprobs=-rng.random(r, dtype=np.float32) * 3,
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
    WeightsRejected(actor_id=3, epoch=2, version=8, reason="version 8 did not arrive as sent: w (bucket 0) differs"),
    Heartbeat(actor_id=3, version=8, generated_groups=100, peak_rss_mb=812.5),
    Goodbye(reason="shutdown"),
    make_group(),
    replace(make_group(), greedy_reward=1.0),
    EvalGrant(round=3, version=7, prompt_ids=[2**48, 2**48 + 1]),
    EvalResult(actor_id=3, round=3, version=7, prompt_ids=[2**48, 2**48 + 1],
               rewards=np.array([[1.0], [0.0]], np.float32),
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
# Failed reward calls (per wire FAILURE_REASONS) travel with experience and eval results.
SAMPLES += [
    replace(make_group(), reward_errors=[1, 0, 2, 1]),
    replace(make_group(), reward_errors=[1, 0, 0, 0], unscorable=np.array([0, 1, 0, 0], np.uint8)),
    EvalResult(actor_id=3, round=3, version=7, prompt_ids=[2**48], rewards=np.array([[0.0, 1.0]], np.float32),
               response_lengths=np.array([[3, 8]], np.int32), truncated=np.array([[0, 1]], np.uint8),
               reward_errors=[0, 1, 0, 1]),
]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()  # bit-identical
        else:
            assert x == y and type(x) is type(y), name


# ------------------------------------------------------------------ rejections


def _header_edit(msg, edit, frames_edit=None):
    frames = [bytes(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[0])  # {"schema": SCHEMA, "message": {"kind": ..., fields}}
    edit(header)
    frames[0] = msgpack.packb(header)
    return frames_edit(frames) if frames_edit else frames


def _body(**changes):
    return lambda h: h["message"].update(changes)


def _array(array_name, **changes):
    """Edit the array reference {"dtype", "shape", "frame"} of field `array_name`."""
    return lambda h: h["message"][array_name].update(changes)


def _rename(old, new):
    def edit(h):
        h["message"][new] = h["message"].pop(old)
    return edit


def _group(**changes):
    return replace(make_group(), **changes)


def _nan_logprobs():
    lp = make_group().logprobs.copy()
    lp[-1] = np.nan
    return _group(logprobs=lp)


def _positive_logprobs():
    lp = make_group().logprobs.copy()
    lp[-1] = 0.5  # the last token of the last response: every token is checked
    return _group(logprobs=lp)


LENGTHS = make_group().response_lengths
R = int(LENGTHS.sum())  # make_group()'s response tokens


def _lengths(*changes):
    """make_group() with (response, new length) pairs applied to its lengths."""
    lengths = LENGTHS.copy()
    for j, n in changes:
        lengths[j] = n
    return _group(response_lengths=lengths)


HELLO = SAMPLES[0]
CASES = {
    "random_bytes": ([b"\xc1\x00\xff garbage"], "not_msgpack"),
    "trailing_bytes": ([encode(HELLO)[0] + b"\x00"], "not_msgpack"),
    "msgpack_non_map": ([msgpack.packb([1, 2, 3])], "bad_header"),
    "bytes_key": ([msgpack.packb({b"schema": 1})], "not_msgpack"),
    "int_key": ([msgpack.packb({1: 1}, strict_types=False)], "not_msgpack"),
    "ext_type": ([msgpack.packb(msgpack.ExtType(5, b"xx"))], "not_msgpack"),
    "no_frames": ([], "frame_count"),
    "wrong_schema": (_header_edit(HELLO, lambda h: h.update(schema=SCHEMA + 1)), "bad_schema"),
    "schema_1_layout": ([msgpack.packb({"schema": 1, "kind": "hello", "body": {}, "arrays": []})], "bad_schema"),
    "bool_schema": (_header_edit(HELLO, lambda h: h.update(schema=True)), "bad_schema"),
    "extra_header_key": (_header_edit(HELLO, lambda h: h.update(x=1)), "bad_header"),
    "missing_message": (_header_edit(HELLO, lambda h: h.pop("message")), "bad_header"),
    "message_not_a_map": (_header_edit(HELLO, lambda h: h.update(message=[1, 2])), "bad_header"),
    "missing_kind": (_header_edit(HELLO, lambda h: h["message"].pop("kind")), "bad_header"),
    "unknown_kind": (_header_edit(HELLO, _body(kind="pickle")), "unknown_kind"),
    "int_kind": (_header_edit(HELLO, _body(kind=5)), "unknown_kind"),
    "missing_field": (_header_edit(HELLO, lambda h: h["message"].pop("pid")), "missing_field"),
    "unknown_field": (_header_edit(HELLO, _body(extra=1)), "unknown_field"),
    "str_for_int": (_header_edit(HELLO, _body(pid="7")), "bad_field_type"),
    "bool_for_int": (_header_edit(HELLO, _body(pid=True)), "bad_field_type"),
    "float_for_int": (_header_edit(HELLO, _body(pid=7.0)), "bad_field_type"),
    "none_for_str": (_header_edit(HELLO, _body(host=None)), "bad_field_type"),
    "negative_pid": (_header_edit(HELLO, _body(pid=-1)), "bad_value"),
    "huge_int": (_header_edit(HELLO, _body(pid=2**64 - 1)), "bad_value"),
    "nan_float": (_header_edit(Wait(1.0), _body(seconds=float("nan"))), "non_finite"),
    "inf_float": (_header_edit(make_group(), _body(greedy_reward=float("-inf"))), "non_finite"),
    "negative_float": (_header_edit(Wait(1.0), _body(seconds=-0.5)), "bad_value"),
    "grant_lengths": (_header_edit(SAMPLES[3], _body(prompt_ids=[5])), "shape_mismatch"),
    "grant_list_type": (_header_edit(SAMPLES[3], _body(groups=[1, "2"])), "bad_field_type"),
    "rank_ge_world": (_header_edit(SAMPLES[5], _body(rank=3)), "bad_value"),
    "bad_port": (_header_edit(SAMPLES[5], _body(store_port=70000)), "bad_value"),
    "unsupported_dtype": (_header_edit(make_group(), _array("logprobs", dtype="float64")), "bad_dtype"),
    "wrong_dtype": (_header_edit(make_group(), _array("logprobs", dtype="int32")), "bad_dtype"),
    "ndim_3": (_header_edit(make_group(), _array("logprobs", shape=[R, 1, 1])), "bad_shape"),
    "padded_layout": (encode(_group(response_tokens=np.zeros((4, 6), np.int32))), "bad_shape"),  # [G, T]
    "negative_dim": (_header_edit(make_group(), _array("rewards", shape=[-4])), "bad_shape"),
    "dim_too_large": (_header_edit(make_group(), _array("prompt_tokens", shape=[1 << 21])), "too_large"),
    "bad_array_ref": (_header_edit(make_group(), _array("rewards", name="mask")), "bad_header"),
    "array_ref_not_a_map": (_header_edit(make_group(), _body(rewards=[5])), "bad_header"),
    "unknown_array": (_header_edit(make_group(), _rename("rewards", "mask")), "unknown_field"),
    "frame_count": (_header_edit(make_group(), lambda h: None, lambda f: f[:-1]), "frame_count"),
    "extra_frame": (_header_edit(make_group(), lambda h: None, lambda f: [*f, f[-1]]), "frame_count"),
    "frame_named_twice": (_header_edit(make_group(), _array("rewards", frame=1)), "frame_count"),
    "frame_zero": (_header_edit(make_group(), _array("rewards", frame=0)), "frame_count"),
    # truncated, and the optional arrays after it (their frames are the last ones).
    "missing_array": (_header_edit(make_group(), lambda h: [h["message"].pop(k) for k in TRUNCATED_AND_AFTER],
                                   lambda f: f[:-len(TRUNCATED_AND_AFTER)]), "missing_field"),
    "frame_length": (_header_edit(make_group(), lambda h: None,
                                  lambda f: [f[0], f[1][:-4], *f[2:]]), "shape_mismatch"),
    "nan_logprobs": (encode(_nan_logprobs()), "non_finite"),
    "positive_logprobs": (encode(_positive_logprobs()), "bad_value"),
    "inconsistent_shapes": (encode(_group(token_versions=np.zeros(R + 1, np.int32))), "shape_mismatch"),
    "rewards_shape": (encode(_group(rewards=np.zeros(5, np.float32))), "shape_mismatch"),
    "lengths_not_summing_to_r": (encode(_lengths((0, LENGTHS[0] + 1))), "shape_mismatch"),
    "negative_length": (encode(_lengths((0, -1), (1, LENGTHS[0] + LENGTHS[1] + 1))), "bad_value"),  # sum still R
    "length_above_max_tokens": (encode(_lengths((0, LIMITS.max_tokens + 1))), "too_large"),
    "negative_token": (encode(_group(prompt_tokens=np.array([1, -1], np.int32))), "bad_value"),
    "version_mismatch": (encode(_group(version=3)), "version_mismatch"),
    "negative_version": (encode(_group(token_versions=np.full(R, -1, np.int32))), "bad_value"),
    "spans_names_longer": (encode(make_spans(names=["generate"] * 4)), "shape_mismatch"),
    "spans_dur_shorter": (encode(make_spans(dur_us=np.full(2, 250, np.int64))), "shape_mismatch"),
    "spans_args_width": (encode(make_spans(args=np.full((3, 2), -1, np.int64))), "shape_mismatch"),
    "spans_unknown_name": (encode(make_spans(names=["generate", "train-step", "push"])), "unknown_span"),
    "spans_negative_duration": (encode(make_spans(dur_us=np.array([250, -1, 250], np.int64))), "bad_value"),
    "spans_negative_start": (encode(make_spans(start_us=np.array([-5, 0, 1], np.int64))), "bad_value"),
    "spans_beyond_2_53": (encode(make_spans(start_us=np.full(3, 1 << 60, np.int64))), "bad_value"),
    "spans_arg_below_minus_1": (encode(make_spans(args=np.full((3, 3), -2, np.int64))), "bad_value"),
    "spans_too_many": (encode(make_spans(1025)), "too_large"),
    "spans_int32_times": (_header_edit(make_spans(), _array("start_us", dtype="int32"),  # int32 bytes too
                                       lambda f: [f[0], make_spans().start_us.astype("<i4").tobytes(), *f[2:]]),
                          "bad_dtype"),
    "spans_negative_dropped": (_header_edit(make_spans(), _body(dropped=-1)), "bad_value"),
    "empty_group": (encode(_group(
        response_tokens=np.zeros(0, np.int32), response_lengths=np.zeros(0, np.int32),
        logprobs=np.zeros(0, np.float32), token_versions=np.zeros(0, np.int32),
        rewards=np.zeros(0, np.float32), truncated=np.zeros(0, np.uint8))), "bad_value"),
    "truncated_not_0_or_1": (encode(_group(truncated=np.full(4, 2, np.uint8))), "bad_value"),
    "eval_result_shapes": (encode(EvalResult(actor_id=3, round=0, version=0, prompt_ids=[1, 2],
                                             rewards=np.zeros((2, 1), np.float32),
                                             response_lengths=np.zeros((1, 1), np.int32),
                                             truncated=np.zeros((2, 1), np.uint8))), "shape_mismatch"),
    "reward_errors_length": (encode(_group(reward_errors=[1, 0])), "shape_mismatch"),
    "reward_errors_negative": (_header_edit(make_group(), _body(reward_errors=[-1, 0, 0, 0])), "bad_value"),
    "reward_errors_float": (_header_edit(make_group(), _body(reward_errors=[0.5, 0, 0, 0])), "bad_field_type"),
    "reward_errors_above_samples": (encode(_group(reward_errors=[3, 0, 2, 0])), "bad_value"),
    "unscorable_shape": (encode(_group(unscorable=np.zeros(3, np.uint8))), "shape_mismatch"),
    "unscorable_not_0_or_1": (encode(_group(unscorable=np.full(4, 2, np.uint8))), "bad_value"),
    "eval_reward_errors_above_samples": (encode(replace(SAMPLES[-1], reward_errors=[0, 3, 0, 0])),
                                         "bad_value"),
}


