"""Weight fingerprints (weight_transfer/fingerprint.py) against hand-computed sums, and
what they catch and name."""
import random

import pytest
import torch

from async_rl.weight_transfer.buckets import plan_buckets, plan_packed
from async_rl.weight_transfer.fingerprint import (
    CHUNK_BYTES,
    device_segment_sums,
    fingerprint,
    first_difference,
    plan_segments,
    segment_sums,
    segment_tensors,
    segments,
)

WRAP = 2**64


def as_int64(n: int) -> int:
    """n modulo 2**64, as a signed 64-bit int (what torch's wrapping sum gives)."""
    n %= WRAP
    return n - WRAP if n >= 2**63 else n


def test_words_are_little_endian_and_the_tail_is_zero_padded():
    raw = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 3, 2, 1], dtype=torch.uint8)
    # 1 + (2 + 256) + the tail 0x010203 read little-endian: 3 + 2*256 + 1*65536
    assert segment_sums(raw, [0]).tolist() == [1 + 258 + 3 + 512 + 65536]
    assert segment_sums(raw, [0, 2]).tolist() == [1 + 258, 3 + 512 + 65536]


def test_a_float_tensor_is_summed_as_its_bytes():
    x = torch.tensor([1.0, -2.0], dtype=torch.float32)  # 0x3F800000, 0xC0000000: one word
    assert segment_sums(x, [0]).tolist() == [0x3F800000 + (0xC0000000 << 32) - WRAP]


def test_the_sum_wraps_modulo_two_to_the_64():
    words = torch.tensor([2**63 - 1, 1, 2**62, 2**62, -5], dtype=torch.int64)
    assert segment_sums(words, [0]).tolist() == [as_int64(2**63 - 1 + 1 + 2**62 + 2**62 - 5)]


def test_segments_start_at_each_tensor_and_every_mebibyte_within_one():
    # a: 4000 bytes (words 0-499); b: 1.2 MB from byte 4000 (word 500), cut 131072 words on
    plan = plan_buckets([("a", (1000,), torch.float32), ("b", (300000,), torch.float32)], bucket_bytes=2**30)
    assert segments(plan[0]) == [0, 500, 500 + CHUNK_BYTES // 8]
    # bf16 tensors of odd sizes: b starts in the middle of word 1, its segment at word 1
    plan = plan_buckets([("a", (5,), torch.bfloat16), ("b", (3,), torch.bfloat16)], bucket_bytes=2**20)
    assert segments(plan[0]) == [0, 1]
    assert segment_tensors(plan[0], 1) == (["a", "b"], 8, 16)


def test_a_tensor_not_starting_on_a_word_is_read_from_its_own_first_byte():
    raw = torch.arange(20, dtype=torch.uint8)
    view = raw[3:]  # storage offset 3
    assert segment_sums(view, [0, 1]).tolist() == segment_sums(view.clone(), [0, 1]).tolist()


def test_every_flipped_byte_is_caught_and_names_its_tensor():
    g = torch.Generator().manual_seed(0)
    specs = [("embed", (300, 8), torch.float32), ("w", (300000,), torch.float32), ("b", (5,), torch.float32)]
    plan = plan_buckets(specs, bucket_bytes=2**30)
    starts = plan_segments(plan)
    flat = torch.randn(plan[0].numel, generator=g)
    sent = fingerprint([flat], starts)
    rng = random.Random(0)
    raw = flat.view(torch.uint8)
    ends = {e.name: (e.offset * 4, (e.offset + e.numel) * 4) for e in plan[0].entries}
    for position in [0, raw.numel() - 1, *rng.sample(range(raw.numel()), 50)]:
        landed = flat.clone()
        landed.view(torch.uint8)[position] ^= 1 << rng.randrange(8)
        where = first_difference(plan, sent, fingerprint([landed], starts))
        holder = next(name for name, (lo, hi) in ends.items() if lo <= position < hi)
        assert where is not None and where.startswith(f"{holder} (bucket 0, bytes "), (position, where)
    assert first_difference(plan, sent, fingerprint([flat.clone()], starts)) is None


def test_a_flip_names_the_tensor_and_its_bytes():
    specs = [("a", (1000,), torch.float32), ("b", (300000,), torch.float32)]
    plan = plan_buckets(specs, bucket_bytes=2**30)
    starts = plan_segments(plan)
    flat = torch.ones(plan[0].numel)
    sent = fingerprint([flat], starts)
    landed = flat.clone()
    landed[1000 + 280000] = 2.0  # in b's second mebibyte
    assert first_difference(plan, sent, fingerprint([landed], starts)) == "b (bucket 0, bytes 1052576-1204000)"
    landed = flat.clone()
    landed[10] = 0.0
    assert first_difference(plan, sent, fingerprint([landed], starts)) == "a (bucket 0, bytes 0-4000)"


def test_packed_chunks_segment_by_bytes():
    specs = [("x", (10,), torch.bfloat16), ("y", (4,), torch.float32)]  # x: bytes 0-20, y: 20-36
    plan = plan_packed(specs, buffer_bytes=1 << 20)
    assert segments(plan[0]) == [0, 2]
    assert segment_tensors(plan[0], 1) == (["x", "y"], 16, 36)


def test_a_bucket_missing_or_cut_short_is_named():
    plan = plan_buckets([("a", (4,), torch.float32), ("b", (4,), torch.float16)], bucket_bytes=2**20)
    sent = fingerprint([torch.ones(4), torch.ones(4, dtype=torch.float16)], plan_segments(plan))
    assert "1 buckets arrived where rank 0 sent 2" in first_difference(plan, sent, sent[:1])
    assert "bucket 1 holds 0 segments" in first_difference(plan, sent, (sent[0], ()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_identical_bytes_give_identical_fingerprints_whatever_the_dtype(dtype):
    x = (torch.arange(1001) % 7).to(dtype)
    starts = [[0, 3, 40]]
    assert fingerprint([x], starts) == fingerprint([x.clone()], starts)
    assert fingerprint([x], starts) == fingerprint([x.view(torch.uint8).clone()], starts)


def test_the_host_and_device_ways_to_sum_agree():
    """CPU buckets are summed by numpy in one pass, GPU ones by a torch reduction per
    segment: a learner and an actor on different devices must agree, overflow included."""
    words = torch.randint(-2**62, 2**62, (5000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    starts = [0, 1, 17, 1000, 4999]
    assert segment_sums(words, starts).tolist() == device_segment_sums(words, starts).tolist()


def reference_sums(raw: torch.Tensor, starts: list[int]) -> list[int]:
    """The definition, word by word in Python: little-endian words, the last zero-padded."""
    data = bytes(raw.tolist()) + bytes(-raw.numel() % 8)
    words = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data), 8)]
    ends = [*starts[1:], len(words)]
    return [as_int64(sum(words[a:b])) for a, b in zip(starts, ends)]


@pytest.mark.parametrize("seed", range(6))
def test_partial_last_words_and_odd_offsets_agree_with_the_definition(seed):
    rng = random.Random(seed)
    backing = torch.randint(0, 256, (200,), dtype=torch.uint8)
    offset, size = rng.randrange(0, 9), rng.randrange(1, 150)
    raw = backing[offset:offset + size]
    words = -(-size // 8)
    starts = sorted({0, *rng.sample(range(words), k=min(words, rng.randrange(1, 5)))})
    assert segment_sums(raw, starts).tolist() == reference_sums(raw, starts)

