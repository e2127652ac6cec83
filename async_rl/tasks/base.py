"""Task interface: a prompt source plus a reward function.

A task hands out training prompts by integer index. ``train_prompt(i)`` is a pure
function of the task's seed and ``i``, so the coordinator's prompt cursor is a single
int that checkpoints and resumes trivially, and any process (learner, actor, test)
that builds the same task from the same config sees the same prompt for the same
index.

Prompt ids: a training prompt's id is its index (the cursor position that produced
it); held-out evaluation prompts use ids from ``EVAL_ID_OFFSET`` upwards, so the two
never collide and an id alone tells which set a prompt came from.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

# Eval ids live far above any reachable training index (2**48 prompts is beyond any
# run) and stay non-negative so they fit every integer dtype a transport might use.
EVAL_ID_OFFSET = 1 << 48

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` goes to the model, ``answer`` only to the reward."""

    id: int
    text: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """What the coordinator, actors and evaluators need from a task."""

    def train_prompt(self, index: int) -> Prompt:
        """Training prompt number ``index`` (deterministic in seed and index)."""
        ...

    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out set, disjoint from every training prompt."""
        ...

    def reward(self, prompt: str, response: str, answer: str) -> float:
        """Score one response."""
        ...


def is_eval_id(prompt_id: int) -> bool:
    return prompt_id >= EVAL_ID_OFFSET


class EpochSampler:
    """Maps a global index to an item of a pool of ``n`` items, epoch by epoch.

    Index ``i`` falls in epoch ``i // n``; each epoch visits every item once, in an
    order given by a permutation seeded with ``(seed, epoch)``. Only the latest
    epoch's permutation is cached: the cursor moves forward, so this is O(n) work per
    epoch and O(1) per lookup, and random access (resume, tests) still works.
    """

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise ValueError("cannot sample from an empty pool")
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._perm: np.ndarray = np.empty(0, dtype=np.int64)

    def __call__(self, index: int) -> int:
        if index < 0:
            raise IndexError(f"prompt index must be >= 0, got {index}")
        epoch, pos = divmod(index, self.n)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.n)
            self._epoch = epoch
        return int(self._perm[pos])


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``"package.module:function"`` to a callable ``f(prompt, response, answer)``.

    Raises ValueError with the spec in the message for every way this can fail, so a
    bad config surfaces as one readable line instead of a traceback.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"reward spec {spec!r} must look like 'module:function'")
    module_name, attr = (part.strip() for part in spec.split(":"))
    if not module_name or not attr:
        raise ValueError(f"reward spec {spec!r} must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward spec {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = module
    # Allow dotted attributes ("mod:Class.method") by walking them one at a time.
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {attr!r} is not callable")
    return fn  # type: ignore[return-value]
