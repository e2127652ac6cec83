"""Typed messages of the async-rl wire protocol.

Each is a frozen dataclass with a ``KIND`` tag. :mod:`.wire` validates fields
generically from the type hints (int, float, str, bool, list[int], list[str],
dict[str, Any], Optional[...]) and :func:`bounded` metadata (applied per element
for list[int]); ``np.ndarray`` fields declared with :func:`array` travel as raw
frames. Cross-field rules live in ``check``, which returns a rejection reason.
"""

from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np

from ..tasks.reward_guard import REASONS, zero_counts
from ..tracing import ACTOR_SPANS, MAX_TRACE_US, SPAN_ARG_KEYS

if TYPE_CHECKING:  # wire imports this module; avoid the cycle at run time
    from .wire import WireLimits

# Log-probabilities are <= 0 in exact arithmetic; float32 log-softmax can land a
# hair above zero for a near-certain token, so allow a small tolerance.
LOGPROB_TOLERANCE = 1e-4


def array(dtype: str, ndim: int) -> Any:
    """Declare an ndarray field that travels as one raw frame."""
    return field(metadata={"dtype": dtype, "ndim": ndim})


def bounded(*, lo: float | None = None, hi: float | None = None, default: Any = MISSING,
            default_factory: Any = MISSING) -> Any:
    """Inclusive bounds on a numeric field, checked on decode; optionally a default
    (a `default_factory` for a list, which a decoded message holds as a list too)."""
    return field(default=default, default_factory=default_factory, metadata={"min": lo, "max": hi})


class Message:
    """Base class of every wire message."""

    KIND: ClassVar[str] = ""

    def check(self, limits: "WireLimits") -> str | None:
        """Cross-field rules; return a rejection reason, or None when valid."""
        return None


@dataclass(frozen=True)
class Hello(Message):
    """actor -> hub: registration."""

    KIND: ClassVar[str] = "hello"
    actor_name: str
    pid: int = bounded(lo=0)
    host: str


@dataclass(frozen=True)
class Welcome(Message):
    """hub -> actor: registration accepted."""

    KIND: ClassVar[str] = "welcome"
    actor_id: int = bounded(lo=0)
    config_yaml: str
    experience_addr: str
    version: int = bounded(lo=0)


@dataclass(frozen=True)
class WorkRequest(Message):
    """actor -> hub: ask for prompt groups; ``version`` = weights it will use."""

    KIND: ClassVar[str] = "work_request"
    actor_id: int = bounded(lo=0)
    version: int = bounded(lo=0)
    max_groups: int = bounded(lo=0)


@dataclass(frozen=True)
class WorkGrant(Message):
    """hub -> actor: admitted prompt groups, as parallel lists. The actor builds the
    same task from the run's config, so a prompt id names the prompt and its answer."""

    KIND: ClassVar[str] = "work_grant"
    groups: list[int] = bounded(lo=0)  # admission indices
    prompt_ids: list[int] = bounded(lo=0)

    def check(self, limits: "WireLimits") -> str | None:
        return "shape_mismatch" if len(self.prompt_ids) != len(self.groups) else None


@dataclass(frozen=True)
class EvalGrant(Message):
    """hub -> actor: score these held-out prompts with the weights of ``version`` (the
    actor's own) and push an EvalResult (settings: the run config's ``eval`` section)."""

    KIND: ClassVar[str] = "eval_grant"
    round: int = bounded(lo=0)
    version: int = bounded(lo=0)
    prompt_ids: list[int] = bounded(lo=0)


@dataclass(frozen=True)
class Wait(Message):
    """hub -> actor: nothing admissible now; ask again after ``seconds``."""

    KIND: ClassVar[str] = "wait"
    seconds: float = bounded(lo=0.0)


@dataclass(frozen=True)
class SyncOrder(Message):
    """hub -> actor: join the weight broadcast group of ``epoch`` now."""

    KIND: ClassVar[str] = "sync_order"
    epoch: int = bounded(lo=0)
    rank: int = bounded(lo=0)
    world_size: int = bounded(lo=1)
    store_host: str
    store_port: int = bounded(lo=1, hi=65535)
    version: int = bounded(lo=0)

    def check(self, limits: "WireLimits") -> str | None:
        return "bad_value" if self.rank >= self.world_size else None


@dataclass(frozen=True)
class SyncDone(Message):
    """actor -> hub: weights of ``version`` loaded."""

    KIND: ClassVar[str] = "sync_done"
    actor_id: int = bounded(lo=0)
    epoch: int = bounded(lo=0)
    version: int = bounded(lo=0)


@dataclass(frozen=True)
class Heartbeat(Message):
    """actor -> hub: still alive."""

    KIND: ClassVar[str] = "heartbeat"
    actor_id: int = bounded(lo=0)
    version: int = bounded(lo=0)
    generated_groups: int = bounded(lo=0)
    peak_rss_mb: float = bounded(lo=0.0, default=0.0)  # the actor process's peak resident memory


@dataclass(frozen=True)
class Goodbye(Message):
    """Either direction: stop."""

    KIND: ClassVar[str] = "goodbye"
    reason: str
    actor_id: int = bounded(lo=-1, default=-1)  # set by an actor that leaves, so the hub re-issues its prompts at once
    rejoin: bool = False  # hub -> actor: you were removed (silent too long, or disconnected); register again


# eq=False: the generated __eq__ would compare ndarrays, whose truth is ambiguous.
@dataclass(frozen=True, eq=False)
class ExperienceGroup(Message):
    """actor -> learner: ONE prompt group (G responses, right-padded to T)."""

    KIND: ClassVar[str] = "experience_group"
    actor_id: int = bounded(lo=0)
    group: int = bounded(lo=0)  # admission index
    prompt_id: int = bounded(lo=0)
    version: int = bounded(lo=0)  # oldest token version in the group
    prompt_tokens: np.ndarray = array("int32", 1)  # [P]
    response_tokens: np.ndarray = array("int32", 2)  # [G, T], padded with pad id
    response_lengths: np.ndarray = array("int32", 1)  # [G]
    logprobs: np.ndarray = array("float32", 2)  # [G, T], sampling distribution
    token_versions: np.ndarray = array("int32", 2)  # [G, T]
    rewards: np.ndarray = array("float32", 1)  # [G]
    truncated: np.ndarray = array("uint8", 1)  # [G] 1 = cut at the length limit (no stop token)
    gen_seconds: float = bounded(lo=0.0)
    greedy_reward: Optional[float] = None  # ReMax baseline, when computed
    # Samples (and the greedy baseline) scored reward.fallback, per reward_guard.REASONS.
    reward_errors: list[int] = bounded(lo=0, default_factory=zero_counts)

    def check(self, limits: "WireLimits") -> str | None:
        g, t = self.response_tokens.shape
        if (
            self.logprobs.shape != (g, t)
            or self.token_versions.shape != (g, t)
            or self.response_lengths.shape != (g,)
            or self.rewards.shape != (g,)
            or self.truncated.shape != (g,)
        ):
            return "shape_mismatch"
        if g > limits.max_group_size or max(t, len(self.prompt_tokens)) > limits.max_tokens:
            return "too_large"
        lengths = self.response_lengths
        if g == 0 or (lengths < 0).any() or (lengths > t).any():
            return "bad_value"
        if len(self.reward_errors) != len(REASONS):
            return "shape_mismatch"
        if sum(self.reward_errors) > g + (self.greedy_reward is not None):
            return "bad_value"
        if (self.prompt_tokens < 0).any() or (self.response_tokens < 0).any() or (self.truncated > 1).any():
            return "bad_value"
        # Padding positions carry no meaning; only real tokens are checked.
        valid = np.arange(t)[None, :] < lengths[:, None]
        if (self.logprobs[valid] > LOGPROB_TOLERANCE).any():
            return "bad_value"
        versions = self.token_versions[valid]
        if versions.size:
            if versions.min() < 0:
                return "bad_value"
            # The group's version is what staleness is measured on: it must be
            # exactly the oldest token's, or admission accounting lies.
            if int(versions.min()) != self.version:
                return "version_mismatch"
        return None


@dataclass(frozen=True, eq=False)
class EvalResult(Message):
    """actor -> learner: the scores of one EvalGrant, ``k`` samples per prompt."""

    KIND: ClassVar[str] = "eval_result"
    actor_id: int = bounded(lo=0)
    round: int = bounded(lo=0)
    version: int = bounded(lo=0)
    prompt_ids: list[int] = bounded(lo=0)
    rewards: np.ndarray = array("float32", 2)  # [n, k]
    response_lengths: np.ndarray = array("int32", 2)  # [n, k]
    truncated: np.ndarray = array("uint8", 2)  # [n, k]
    reward_errors: list[int] = bounded(lo=0, default_factory=zero_counts)  # as ExperienceGroup's

    def check(self, limits: "WireLimits") -> str | None:
        shape = (len(self.prompt_ids), self.rewards.shape[1])
        if self.response_lengths.shape != shape or self.truncated.shape != shape:
            return "shape_mismatch"
        if len(self.reward_errors) != len(REASONS):
            return "shape_mismatch"
        if (self.response_lengths < 0).any() or (self.truncated > 1).any():
            return "bad_value"
        if sum(self.reward_errors) > self.rewards.size:
            return "bad_value"
        return None


@dataclass(frozen=True, eq=False)
class TraceSpans(Message):
    """actor -> hub, from the heartbeat thread: timeline spans recorded since the last
    shipment, as parallel arrays (see async_rl/tracing.py)."""

    KIND: ClassVar[str] = "trace_spans"
    actor_id: int = bounded(lo=0)
    dropped: int = bounded(lo=0)  # spans the actor had to drop since the last shipment (buffer full)
    names: list[str]  # each one of tracing.ACTOR_SPANS
    start_us: np.ndarray = array("int64", 1)  # [n] wall clock, microseconds since the epoch
    dur_us: np.ndarray = array("int64", 1)  # [n] microseconds
    args: np.ndarray = array("int64", 2)  # [n, len(tracing.SPAN_ARG_KEYS)], -1 = not set

    def check(self, limits: "WireLimits") -> str | None:
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
    Hello, Welcome, WorkRequest, WorkGrant, EvalGrant, Wait, SyncOrder, SyncDone, Heartbeat, Goodbye,
    ExperienceGroup, EvalResult, TraceSpans)}
