"""Typed messages of the async-rl wire protocol.

Each is a frozen ``msgspec.Struct`` tagged with its kind (``{"kind": "hello", ...}`` in
the header). The field types, with their ``Meta`` constraints, are the schema: msgspec
checks them while it decodes the header. Array fields (``Int32Vector``, ...) travel as
raw frames (see :mod:`.wire`). Rules across fields that a schema cannot state live in
``check``, which returns a rejection reason.
"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, NamedTuple, Union

import msgspec
import numpy as np
from msgspec import Meta, field

from async_rl.run.tracing import ACTOR_SPANS, MAX_TRACE_US, SPAN_ARG_KEYS
from async_rl.staleness import group_version

# Why a call of user code (a reward, an environment) failed: the counts of failed calls
# travel in this order (`reward_errors`, `env_errors`); actor/guard.py tells them apart.
FAILURE_REASONS = ("raised", "timeout", "non_finite", "not_a_number")
MAX_FAILURE_NOTE = 300  # characters of `first_failure`: one line of a log
ERROR_FIELDS = {"reward_errors": "reward", "env_errors": "env"}  # count field -> its metrics' prefix


def zero_counts() -> list[int]:
    """Per-reason counts of a message whose samples all scored."""
    return [0] * len(FAILURE_REASONS)


# Log-probabilities are <= 0 in exact arithmetic; float32 log-softmax can land a
# hair above zero for a near-certain token, so allow a small tolerance.
LOGPROB_TOLERANCE = 1e-4

# Ints must fit int64 so that numpy and torch never overflow later.
INT64_MAX = 2**63 - 1
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # ids, versions, admission indices, counters
Port = Annotated[int, Meta(ge=1, le=65535)]
# Finite floats: NaN fails every comparison, and +-inf lies beyond the largest double.
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
NonNegative = Annotated[float, Meta(ge=0.0, le=sys.float_info.max)]
# How the first failed user-code call of a message failed: "<reward|environment> <what>".
FailureNote = Annotated[str, Meta(max_length=MAX_FAILURE_NOTE + len("environment "))]


MAX_REWARD_COMPONENTS = 16  # reward.components entries


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = 64 << 20
    max_header_bytes: int = 64 << 10
    max_dim: int = 1 << 20
    max_group_size: int = 1024
    max_tokens: int = 65536
    # Spans per TraceSpans message: 1024 of the longest name keep the header far below
    # max_header_bytes; an actor ships at most this many per heartbeat.
    max_trace_spans: int = 1024


class ArraySpec(NamedTuple):
    dtype: str  # one of wire's little-endian dtypes
    ndim: int


# Array fields travel as one raw frame each, of this dtype and number of dimensions.
Int32Vector = Annotated[np.ndarray, ArraySpec("int32", 1)]
Int32Matrix = Annotated[np.ndarray, ArraySpec("int32", 2)]
Int64Vector = Annotated[np.ndarray, ArraySpec("int64", 1)]
Int64Matrix = Annotated[np.ndarray, ArraySpec("int64", 2)]
Float32Vector = Annotated[np.ndarray, ArraySpec("float32", 1)]
Float32Matrix = Annotated[np.ndarray, ArraySpec("float32", 2)]
UInt8Vector = Annotated[np.ndarray, ArraySpec("uint8", 1)]
UInt8Matrix = Annotated[np.ndarray, ArraySpec("uint8", 2)]


class _Tag:
    """``cls.KIND`` and ``msg.KIND``: the kind named once, by the class's ``tag``."""

    def __get__(self, obj: Any, cls: type) -> str:
        return cls.__struct_config__.tag


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base class of every wire message."""

    KIND: ClassVar[str] = _Tag()  # type: ignore[assignment]

    def check(self, limits: WireLimits) -> str | None:
        """Cross-field rules; return a rejection reason, or None when valid."""
        return None


class Hello(Message, tag="hello"):
    """actor -> hub: registration."""

    actor_name: str
    pid: Count
    host: str


class Welcome(Message, tag="welcome"):
    """hub -> actor: registration accepted."""

    actor_id: Count
    config_yaml: str
    experience_addr: str
    version: Count


class WorkRequest(Message, tag="work_request"):
    """actor -> hub: ask for prompt groups; ``version`` = weights it will use."""

    actor_id: Count
    version: Count
    max_groups: Count


class WorkGrant(Message, tag="work_grant"):
    """hub -> actor: admitted prompt groups, as parallel lists. The actor builds the
    same task from the run's config, so a prompt id names the prompt and its answer."""

    groups: list[Count]  # admission indices
    prompt_ids: list[Count]

    def check(self, limits: WireLimits) -> str | None:
        return "shape_mismatch" if len(self.prompt_ids) != len(self.groups) else None


class EvalGrant(Message, tag="eval_grant"):
    """hub -> actor: score these held-out prompts with the weights of ``version`` (the
    actor's own) and push an EvalResult (settings: the run config's ``eval`` section)."""

    round: Count
    version: Count
    prompt_ids: list[Count]


class Wait(Message, tag="wait"):
    """hub -> actor: nothing admissible now; ask again after ``seconds``."""

    seconds: NonNegative


class SyncOrder(Message, tag="sync_order"):
    """hub -> actor: join the weight broadcast group of ``epoch`` now."""

    epoch: Count
    rank: Count
    world_size: Annotated[int, Meta(ge=1, le=INT64_MAX)]
    store_host: str
    store_port: Port
    version: Count

    def check(self, limits: WireLimits) -> str | None:
        return "bad_value" if self.rank >= self.world_size else None


class SyncDone(Message, tag="sync_done"):
    """actor -> hub: weights of ``version`` loaded."""

    actor_id: Count
    epoch: Count
    version: Count


class WeightsRejected(Message, tag="weights_rejected"):
    """actor -> hub: the weights of ``version`` did not arrive as learner rank 0 sent them
    (their fingerprint differs, weight_transfer/fingerprint.py); ``reason`` names the
    tensor. The actor keeps its last whole version, or generates nothing until a sync."""

    actor_id: Count
    epoch: Count
    version: Count
    reason: Annotated[str, Meta(max_length=MAX_FAILURE_NOTE)]


class Heartbeat(Message, tag="heartbeat"):
    """actor -> hub: still alive."""

    actor_id: Count
    version: Count
    generated_groups: Count
    peak_rss_mb: NonNegative = 0.0  # the actor process's peak resident memory


class Goodbye(Message, tag="goodbye"):
    """Either direction: stop."""

    reason: str
    # Set by an actor that leaves, so the hub re-issues its prompts at once.
    actor_id: Annotated[int, Meta(ge=-1, le=INT64_MAX)] = -1
    rejoin: bool = False  # hub -> actor: you were removed (silent too long, or disconnected); register again


class Response(NamedTuple):
    """One response of an ExperienceGroup: its tokens, each token's sampling log-prob
    and the policy version that sampled it. A multi-turn episode's response also holds
    what its environment wrote between the policy's turns: `policy_mask` is 1 where the
    policy sampled the token (log-prob and version real) and 0 where the environment
    wrote it (log-prob 0, version that of the policy token before it); None: every
    token is the policy's. `step_ends` (offsets in the response) and `step_rewards`:
    the reward given at the end of each step (a turn, a reasoning step), if any."""

    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]
    versions: np.ndarray  # int32 [n]
    policy_mask: np.ndarray | None = None  # uint8 [n]
    step_ends: np.ndarray | None = None  # int32 [s], increasing, each < n
    step_rewards: np.ndarray | None = None  # float32 [s]


def _empty(dtype) -> Any:
    return lambda: np.zeros(0, dtype)


# eq=False: a generated __eq__ would compare ndarrays, whose truth is ambiguous.
class ExperienceGroup(Message, tag="experience_group", eq=False):
    """actor -> learner: ONE prompt group, the training-sample format. The prompt
    travels once; the G responses travel end to end in flat [R] arrays (R = the sum of
    `response_lengths`), response j at offsets sum(lengths[:j]) .. sum(lengths[:j+1]);
    `responses()` hands them out, `from_responses` builds a group. Nothing is padded.
    A single-turn response is the policy's alone and `policy_mask` is empty; a
    multi-turn episode's response interleaves the environment's tokens, and
    `policy_mask` [R] marks the policy's: only those are trained, and only they count
    for the group's version. Process rewards: `step_rewards[k]` rewards the step whose
    last token is at flat offset `step_ends[k]`."""

    actor_id: Count
    group: Count  # admission index
    prompt_id: Count
    version: Count  # the oldest token's (staleness.py)
    prompt_tokens: Int32Vector  # [P]
    response_tokens: Int32Vector  # [R]
    response_lengths: Int32Vector  # [G]
    logprobs: Float32Vector  # [R], under the sampling distribution
    token_versions: Int32Vector  # [R]
    rewards: Float32Vector  # [G]
    truncated: UInt8Vector  # [G] 1 = cut at the length limit (no stop token)
    gen_seconds: NonNegative
    greedy_reward: Finite | None = None  # ReMax baseline, when computed
    # Samples (and the greedy baseline) scored reward.fallback, per FAILURE_REASONS: for
    # their reward's failure, for their environment's; the first failure's note.
    reward_errors: list[Count] = field(default_factory=zero_counts)
    env_errors: list[Count] = field(default_factory=zero_counts)
    first_failure: FailureNote = ""
    observations_cut: Count = 0  # episodes ended because an environment's answer was too long
    policy_mask: UInt8Vector = field(default_factory=_empty(np.uint8))  # [R], or [0]: all the policy's
    step_ends: Int32Vector = field(default_factory=_empty(np.int32))  # [S] flat offsets, increasing
    step_rewards: Float32Vector = field(default_factory=_empty(np.float32))  # [S]
    # [G] 1 = the sample's reward (or environment) failed and reward.on_failure=exclude:
    # it takes no part in the group's statistics or the loss; [0]: every sample scored.
    unscorable: UInt8Vector = field(default_factory=_empty(np.uint8))
    # [G, C] per reward.components entry (rewards/components.py), or [0, 0] without them:
    # each component's value and milliseconds (0 where it failed), and 0 or 1 + the
    # FAILURE_REASONS index of how it failed.
    components: Float32Matrix = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    component_ms: Float32Matrix = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    component_failures: UInt8Matrix = field(default_factory=lambda: np.zeros((0, 0), np.uint8))

    @classmethod
    def from_responses(cls, responses: Sequence[Response], **fields: Any) -> "ExperienceGroup":
        """The group of `responses`, in order (their arrays: anything numpy reads, CPU
        tensors too); `fields`: every other field."""
        def flat(arrays: list, dtype: type) -> np.ndarray:
            return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)

        lengths = [len(r.tokens) for r in responses]
        starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
        if any(r.policy_mask is not None for r in responses):
            fields["policy_mask"] = flat([np.ones(len(r.tokens)) if r.policy_mask is None else r.policy_mask
                                          for r in responses], np.uint8)
        if any(r.step_ends is not None and len(r.step_ends) for r in responses):
            fields["step_ends"] = flat([np.asarray(r.step_ends, np.int64) + start for r, start in zip(responses, starts)
                                        if r.step_ends is not None], np.int32)
            fields["step_rewards"] = flat([r.step_rewards for r in responses if r.step_ends is not None], np.float32)
        return cls(response_tokens=flat([r.tokens for r in responses], np.int32),
                   response_lengths=np.array(lengths, dtype=np.int32),
                   logprobs=flat([r.logprobs for r in responses], np.float32),
                   token_versions=flat([r.versions for r in responses], np.int32), **fields)

    def responses(self) -> list[Response]:
        """The G responses, in order (views: no copy, except the step offsets)."""
        ends = np.cumsum(self.response_lengths, dtype=np.int64).tolist()
        starts = [0, *ends[:-1]]
        masked = len(self.policy_mask) > 0
        cuts = np.searchsorted(self.step_ends, [*starts, ends[-1] if ends else 0])
        out = []
        for j, (a, b) in enumerate(zip(starts, ends)):
            s0, s1 = cuts[j], cuts[j + 1]
            steps = (self.step_ends[s0:s1].astype(np.int64) - a, self.step_rewards[s0:s1]) if s1 > s0 else (None, None)
            out.append(Response(self.response_tokens[a:b], self.logprobs[a:b], self.token_versions[a:b],
                                self.policy_mask[a:b] if masked else None, *steps))
        return out

    def check(self, limits: WireLimits) -> str | None:
        lengths = self.response_lengths
        g, r = len(lengths), len(self.response_tokens)
        if (
            self.logprobs.shape != (r,)
            or self.token_versions.shape != (r,)
            or self.rewards.shape != (g,)
            or self.truncated.shape != (g,)
        ):
            return "shape_mismatch"
        if g > limits.max_group_size or max(len(self.prompt_tokens), lengths.max(initial=0)) > limits.max_tokens:
            return "too_large"
        if g == 0 or (lengths < 0).any():
            return "bad_value"
        if int(lengths.sum(dtype=np.int64)) != r:
            return "shape_mismatch"
        if (reason := check_failures(self, g + (self.greedy_reward is not None))) is not None:
            return reason
        if self.observations_cut > g + (self.greedy_reward is not None):
            return "bad_value"
        if self.unscorable.shape not in ((0,), (g,)):
            return "shape_mismatch"
        if (reason := self._check_components(g)) is not None:
            return reason
        if ((self.prompt_tokens < 0).any() or (self.response_tokens < 0).any() or (self.truncated > 1).any()
                or (self.unscorable > 1).any()):
            return "bad_value"
        if (self.logprobs > LOGPROB_TOLERANCE).any():
            return "bad_value"
        if r and self.token_versions.min() < 0:
            return "bad_value"
        if (reason := self._check_turns(r)) is not None:
            return reason
        # The group's version is what staleness is measured on: it must be exactly
        # the oldest policy token's, or admission accounting lies.
        if group_version(self.token_versions, default=self.version, policy_mask=self.policy_mask) != self.version:
            return "version_mismatch"
        return None

    def _check_components(self, g: int) -> str | None:
        shape = self.components.shape
        if shape != (0, 0) and (shape[0] != g or shape[1] > MAX_REWARD_COMPONENTS):
            return "shape_mismatch"
        if self.component_ms.shape != shape or self.component_failures.shape != shape:
            return "shape_mismatch"
        if (self.component_ms < 0).any() or (self.component_failures > len(FAILURE_REASONS)).any():
            return "bad_value"
        return None

    def _check_turns(self, r: int) -> str | None:
        """The multi-turn fields: a mask of 0/1 per token, and steps that end, in order,
        on policy tokens."""
        mask, ends = self.policy_mask, self.step_ends
        if mask.shape not in ((0,), (r,)) or ends.shape != self.step_rewards.shape:
            return "shape_mismatch"
        if (mask > 1).any():
            return "bad_value"
        if len(ends) and (ends.min() < 0 or ends.max() >= r or (np.diff(ends) <= 0).any()):
            return "bad_value"
        if len(ends) and len(mask) and not mask[ends].all():
            return "bad_value"
        return None


class EvalResult(Message, tag="eval_result", eq=False):
    """actor -> learner: the scores of one EvalGrant, ``k`` samples per prompt."""

    actor_id: Count
    round: Count
    version: Count
    prompt_ids: list[Count]
    rewards: Float32Matrix  # [n, k]
    response_lengths: Int32Matrix  # [n, k]
    truncated: UInt8Matrix  # [n, k]
    reward_errors: list[Count] = field(default_factory=zero_counts)  # as ExperienceGroup's
    env_errors: list[Count] = field(default_factory=zero_counts)
    first_failure: FailureNote = ""

    def check(self, limits: WireLimits) -> str | None:
        shape = (len(self.prompt_ids), self.rewards.shape[1])
        if self.response_lengths.shape != shape or self.truncated.shape != shape:
            return "shape_mismatch"
        if (self.response_lengths < 0).any() or (self.truncated > 1).any():
            return "bad_value"
        return check_failures(self, self.rewards.size)


def check_failures(msg: ExperienceGroup | EvalResult, scored: int) -> str | None:
    """A message's failure counts: one per reason each, at most one failure per scored episode."""
    if len(msg.reward_errors) != len(FAILURE_REASONS) or len(msg.env_errors) != len(FAILURE_REASONS):
        return "shape_mismatch"
    if sum(msg.reward_errors) + sum(msg.env_errors) > scored:
        return "bad_value"
    return None


class TraceSpans(Message, tag="trace_spans", eq=False):
    """actor -> hub, from the heartbeat thread: timeline spans recorded since the last
    shipment, as parallel arrays (see async_rl/run/tracing.py)."""

    actor_id: Count
    dropped: Count  # spans the actor had to drop since the last shipment (buffer full)
    names: list[str]  # each one of tracing.ACTOR_SPANS
    start_us: Int64Vector  # [n] wall clock, microseconds since the epoch
    dur_us: Int64Vector  # [n] microseconds
    args: Int64Matrix  # [n, len(tracing.SPAN_ARG_KEYS)], -1 = not set

    def check(self, limits: WireLimits) -> str | None:
        n = len(self.names)
        if self.start_us.shape != (n,) or self.dur_us.shape != (n,) or self.args.shape != (n, len(SPAN_ARG_KEYS)):
            return "shape_mismatch"
        if n > limits.max_trace_spans:
            return "too_large"
        if not ACTOR_SPANS.issuperset(self.names):
            return "unknown_span"
        if n and (self.start_us.min() < 0 or self.start_us.max() >= MAX_TRACE_US or self.dur_us.min() < 0
                  or self.dur_us.max() >= MAX_TRACE_US or self.args.min() < -1):
            return "bad_value"
        return None


MESSAGE_TYPES: dict[str, type[Message]] = {cls.KIND: cls for cls in (
    Hello, Welcome, WorkRequest, WorkGrant, EvalGrant, Wait, SyncOrder, SyncDone, WeightsRejected, Heartbeat, Goodbye,
    ExperienceGroup, EvalResult, TraceSpans)}
AnyMessage = Union[tuple(MESSAGE_TYPES.values())]  # noqa: UP007 (built from a tuple) the tagged union one decoder reads
