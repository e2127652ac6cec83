"""Weight fingerprints: how every receiver checks, before it generates with a version,
that the weights it loaded are the ones learner rank 0 sent, bit for bit.

A fingerprint is computed on the bytes of each bucket as sent (a torch bucket, or a
packed uint8 chunk of vLLM's layout), read as little-endian 64-bit words (the last one
zero-padded): one sum modulo 2**64 per segment, where the segments start at each
tensor's first word and are cut every CHUNK_BYTES within a large tensor. Rank 0
takes the sums of each bucket as it fills it and writes the version's fingerprint to
the sync store (store.py, `check/<version>`); each receiver computes the same sums over
what landed, each bucket as it lands, and compares.

What it catches: any change to a word (a flipped bit, a corrupted byte, a bucket of
another version or left unwritten, a truncated transfer), located to its segment and so
to its tensor (or the two sharing a word at their border); not two words swapped within
one segment. Cost: one read of the weights at memory speed, on each end (a sum of int64
words runs at the speed of a copy; a widening int32 sum would be 20x slower). Why not a
cryptographic hash: the threat is a transport that corrupts or drops data, not an
adversary (the sync store is reached only by the run's own processes), and a hash of a
GPU bucket would need a copy to the host.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # annotations only: buckets.py takes each bucket's sums as it fills it
    from async_rl.weight_transfer.buckets import Bucket, BucketSet

CHUNK_BYTES = 2**20
WORD = 8


def segments(bucket: Bucket) -> list[int]:
    """The word offsets at which the bucket's segments start (module docstring)."""
    item = bucket.dtype.itemsize  # 1 for vLLM's packed chunks, whose offsets are in bytes
    starts = {0}
    for e in bucket.entries:
        begin, end = e.offset * item, (e.offset + e.numel) * item
        starts.update(range(begin // WORD, -(-end // WORD), CHUNK_BYTES // WORD))
    words = -(-bucket.numel * item // WORD)
    return sorted(start for start in starts if start < words)


def segment_sums(flat: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """The int64 sums (wrapping) of the words of a contiguous 1-D tensor's bytes, one per
    segment starting at the word offsets `starts`, on the tensor's device."""
    raw = flat.view(torch.uint8)
    if not starts:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    if raw.storage_offset() % WORD:  # words must start on a word: read from a copy that does
        raw = raw.clone()
    whole = raw.numel() // WORD * WORD
    if whole < raw.numel():  # the last word zero-padded, without copying the whole words before it
        tail = raw.new_zeros(WORD)
        tail[:raw.numel() - whole] = raw[whole:]
        sums = _word_sums(raw[:whole].view(torch.int64), starts, whole // WORD)
        last = tail.view(torch.int64)
        if starts[-1] < whole // WORD:
            sums[-1] += last[0]
            return sums
        return torch.cat([sums, last])  # the tail word is a segment of its own
    return _word_sums(raw.view(torch.int64), starts, whole // WORD)


def _word_sums(words: torch.Tensor, starts: Sequence[int], count: int) -> torch.Tensor:
    """Per-segment sums of `words`, for the segments among `starts` that begin before `count`."""
    starts = [s for s in starts if s < count]
    if not starts:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    if words.device.type == "cpu":  # one pass in C, where a sum per segment costs microseconds of dispatch each
        return torch.from_numpy(np.add.reduceat(words.numpy(), np.asarray(starts, dtype=np.int64)))
    return device_segment_sums(words, starts)


def device_segment_sums(words: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """The same sums, one torch reduction per segment, queued on the device's stream."""
    ends = [*starts[1:], words.numel()]
    return torch.stack([words[a:b].sum() for a, b in zip(starts, ends)])


def plan_segments(plan: Sequence[Bucket]) -> list[list[int]]:
    """Each bucket's segment starts: computed once per plan, used by every sync."""
    return [segments(bucket) for bucket in plan]


def fingerprint(buckets: Sequence[torch.Tensor], starts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Every bucket's segment sums (`starts`: plan_segments), as Python ints (on a GPU,
    one copy to the host at the end)."""
    sums = [segment_sums(flat, first) for flat, first in zip(buckets, starts)]
    return tuple(tuple(s.tolist()) for s in sums)


def fingerprint_of(filled: BucketSet, starts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Rank 0's fingerprint of a bucket set just filled: the sums the fill took of each
    bucket (where it took none, taken here). On a GPU, reading them waits for the copies."""
    sums = [taken if taken is not None else segment_sums(flat, first)
            for taken, flat, first in zip(filled.sums, filled.tensors, starts)]
    return tuple(tuple(s.tolist()) for s in sums)


def segment_tensors(bucket: Bucket, segment: int) -> tuple[list[str], int, int]:
    """The names of the tensors whose bytes overlap segment `segment` of `bucket`, and
    the segment's byte range."""
    item = bucket.dtype.itemsize
    starts = segments(bucket)
    lo = starts[segment] * WORD
    hi = starts[segment + 1] * WORD if segment + 1 < len(starts) else bucket.numel * item
    return [e.name for e in bucket.entries if e.offset * item < hi and (e.offset + e.numel) * item > lo], lo, hi


def first_difference(plan: Sequence[Bucket], expected: Sequence[Sequence[int]],
                     got: Sequence[Sequence[int]]) -> str | None:
    """Where the weights that landed differ from what rank 0 sent, in one phrase naming
    the tensor(s) and bytes, or None where they agree."""
    if len(expected) != len(got):
        return f"{len(got)} buckets arrived where rank 0 sent {len(expected)}"
    for i, (want, have) in enumerate(zip(expected, got)):
        if len(want) != len(have):
            return f"bucket {i} holds {len(have)} segments where rank 0 sent {len(want)}"
        for segment, (a, b) in enumerate(zip(want, have)):
            if a != b:
                names, lo, hi = segment_tensors(plan[i], segment) if i < len(plan) else ([], 0, 0)
                return f"{' and '.join(names) or 'an unnamed tensor'} (bucket {i}, bytes {lo}-{hi})"
    return None
