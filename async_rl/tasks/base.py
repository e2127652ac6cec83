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

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Eval ids live far above any reachable training index (2**48 prompts is beyond any
# run) and stay non-negative so they fit every integer dtype a transport might use.
EVAL_ID_OFFSET = 1 << 48

RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class Prompt:
    """One prompt. The model sees ``messages`` when given (a conversation, rendered with
    the chat template), else ``text``; ``answer`` and ``fields`` only go to the reward
    and the environment. ``text`` is
    always the question itself (for a conversation: its last user turn), which is what
    reward functions receive as ``prompt``."""

    id: int
    text: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) turns
    # The row's other columns (a dataset's or a JSONL line's keys besides the prompt and
    # the answer): for the environment factory, and for a reward that names them.
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def conversation(self) -> list[dict[str, str]]:
        """The prompt as chat messages: its turns, or one user turn of its text."""
        if self.messages is not None:
            return [{"role": role, "content": content} for role, content in self.messages]
        return [{"role": "user", "content": self.text}]


@runtime_checkable
class Task(Protocol):
    """What the coordinator, actors and evaluators need from a task."""

    def train_prompt(self, index: int) -> Prompt:
        """Training prompt number ``index`` (deterministic in seed and index)."""
        ...

    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out set, disjoint from every training prompt."""
        ...

    def reward(self, prompt: str, response: str, answer: str, **fields: Any) -> float:
        """Score one response; `fields`: the prompt's (`Prompt.fields`)."""
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


def load_callable(spec: str, what: str) -> Callable:
    """User code named by ``package.module:function`` (importable from the working
    directory, which the launcher puts on the spawned processes' path) or
    ``path/to/file.py:function``; ``mod:Class.method`` walks dotted attributes. Every
    way this can fail raises ValueError with one line starting with `what` and the spec."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    source, attr = (part.strip() for part in spec.rsplit(":", 1))
    if not source or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    fn = _load_file(spec, source, what) if source.endswith(".py") else _import(spec, source, what)
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"{what} {spec!r}: {source!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{what} {spec!r}: {attr!r} is not callable")
    return fn


def _cause(exc: BaseException) -> str:
    """`Type: first line of the message[, line N]`: one line whatever the exception says."""
    where = f", line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
    text = str(exc.msg if isinstance(exc, SyntaxError) else exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}{where}" if text else f"{type(exc).__name__}{where}"


def _import(spec: str, name: str, what: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # The module itself (or a parent package) is missing, not something it imports.
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ValueError(f"{what} {spec!r}: no module named {exc.name!r}; it must be importable from the "
                             f"working directory or installed, or give a file: 'path/to/rewards.py:fn'") from None
        raise ValueError(f"{what} {spec!r}: module {name!r} failed to import ({_cause(exc)})") from None
    except (Exception, SystemExit) as exc:  # user code: anything may go wrong at import time
        raise ValueError(f"{what} {spec!r}: module {name!r} failed to import ({_cause(exc)})") from None


def _load_file(spec: str, path: str, what: str):
    file = Path(path).expanduser()
    if not file.is_file():
        where = "" if file.is_absolute() else f" in {Path.cwd()}"
        raise ValueError(f"{what} {spec!r}: no file {path}{where}")
    # One module name per file (stable across processes), registered in sys.modules
    # as an import would be: dataclasses and typing look a class's module up there.
    name = f"async_rl_reward_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except (Exception, SystemExit) as exc:  # user code: anything may go wrong at import time
        sys.modules.pop(name, None)
        raise ValueError(f"{what} {spec!r}: cannot load file {path} ({_cause(exc)})") from None
    return module
