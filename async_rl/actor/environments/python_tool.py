"""The built-in Python interpreter tool (`env.name: python`): code the policy writes in
its turn, run in a sandbox, its output answered in the next; a turn without a call is
the final answer.

    policy:       Let me check. <python>print(sum(range(1, 101)))</python>
    environment:  <output>5050</output>                     (a user turn)
    policy:       The answer is 5050.                       -> the task's reward, done

The policy calls the tool by writing `<python>CODE</python>` (set `actors.stop:
["</python>"]` so the turn ends at the call); the first call of a turn is run, its code
dedented and stripped of a markdown fence around it. Calls are stateless: each runs as
a fresh program, so names, imports and files of earlier calls are gone. The answer is
`<output>...</output>`: the program's stdout, cut to `max_output_chars` characters (a
cut marked "...[truncated]"), then, where the run failed, one line saying why: the
error's last line (`ZeroDivisionError: division by zero`), "exit status N" where it
printed none, "timed out after Ns", "killed by SIGNAL", or that its output went past
the sandbox's cap. A failing program is the policy's mistake, not the environment's.

The code runs in the actor's one LocalSandbox (async_rl/sandbox/), made when the
factory is built: at most MAX_CONCURRENCY programs at a time, each with `timeout_s` of
wall clock (and as many CPU seconds), `memory_mb` of address space per process; where
the actor runs as root, no network and of the host's files only the system's and
Python's, read-only (rlimits only elsewhere: then the code runs as the actor's user). A
call waits for a free slot before its deadline starts, so `env.timeout_s` must cover
the queue as well as `timeout_s` and about a second of start-up and clean-up.

    env.options: {timeout_s: 5, memory_mb: 512, max_output_chars: 500}
"""
from __future__ import annotations

import math
import signal
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

from async_rl.actor.environments.base import EnvironmentFactory
from async_rl.actor.environments.tagged_tool import TaggedTool
from async_rl.sandbox import Execution, LocalSandbox, Sandbox, SandboxLimits, extract_code
from async_rl.tasks.base import Prompt

NAME = "python"
OPEN, CLOSE = "<python>", "</python>"
MAX_CONCURRENCY = 2
TRUNCATED = "...[truncated]"
MAX_REASON_CHARS = 200  # an exception's message can be as long as the data it shows


@dataclass(frozen=True)
class PythonToolOptions:
    """`env.options` of `env.name: python`."""

    timeout_s: float = 5.0  # wall clock of one call, and its CPU seconds
    memory_mb: int = 512  # address space of each of its processes
    max_output_chars: int = 500  # stdout shown to the policy

    @classmethod
    def parse(cls, options: dict) -> PythonToolOptions:
        """The options of `env.options`; ValueError in one line for an unknown or bad one."""
        known = [field.name for field in fields(cls)]
        for key in options:
            if key not in known:
                raise ValueError(f"env.name {NAME!r}: env.options has no option {key!r} (it takes {', '.join(known)})")
        parsed = cls(**options)
        for key, integer in (("timeout_s", False), ("memory_mb", True), ("max_output_chars", True)):
            value = getattr(parsed, key)
            if not _positive(value, integer):
                what = "a positive integer" if integer else "a positive number"
                raise ValueError(f"env.name {NAME!r}: env.options.{key} must be {what}, got {value!r}")
        return parsed

    def sandbox_limits(self) -> SandboxLimits:
        # CPU seconds no fewer than wall seconds: an endless loop reads as a timeout, not a
        # signal. The output cap leaves room for the stdout shown (4 bytes a character at
        # most) and for the error that follows it.
        return SandboxLimits(timeout_s=float(self.timeout_s), cpu_s=float(self.timeout_s), memory_mb=self.memory_mb,
                             output_bytes=max(1 << 16, 8 * self.max_output_chars))


def python_tool_factory(score: Callable[[str, str, str], float], options: dict) -> EnvironmentFactory:
    """The factory of `env.name: python`, with the actor's sandbox; `score` is the task's
    reward. ValueError in one line for bad `options`."""
    parsed = PythonToolOptions.parse(options)
    sandbox = LocalSandbox(parsed.sandbox_limits(), max_concurrency=MAX_CONCURRENCY)
    return partial(PythonTool, score=score, sandbox=sandbox, options=parsed)


class PythonTool(TaggedTool):
    """One episode: runs `<python>` calls in `sandbox`; scores the final answer with
    `score(prompt, response, answer)` (the task's reward)."""

    open_tag, close_tag = OPEN, CLOSE

    def __init__(self, prompt: Prompt, score: Callable[[str, str, str], float], sandbox: Sandbox,
                 options: PythonToolOptions) -> None:
        super().__init__(prompt, score)
        self.sandbox, self.options = sandbox, options

    def answer(self, code: str) -> str:
        execution = self.sandbox.run(program(code))
        return f"<output>{shown_output(execution, self.options)}</output>"


def program(code: str) -> str:
    """The program of a call: its fenced block if it wrote one (as code rewards read a
    response), dedented."""
    fenced = extract_code(code)
    return textwrap.dedent(code if fenced is None else fenced).strip() + "\n"


def shown_output(execution: Execution, options: PythonToolOptions) -> str:
    """What the policy reads of a run: its stdout, cut to `max_output_chars`, then the
    reason it failed, if it did."""
    stdout = _cut(execution.stdout.rstrip("\n"), options.max_output_chars)
    reason = _cut(_failure(execution, options), MAX_REASON_CHARS)
    return "\n".join(part for part in (stdout, reason) if part)


def _failure(execution: Execution, options: PythonToolOptions) -> str:
    if execution.status == "ok":
        return ""
    if execution.status == "timeout":
        return f"timed out after {options.timeout_s:g}s"
    if execution.status == "output_limit":
        return "stopped: too much output"
    if execution.status == "killed":
        return f"killed by {_signal_name(execution.exit_code)}"
    lines = [line for line in execution.stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {execution.exit_code}"


def _signal_name(exit_code: int | None) -> str:
    try:
        return signal.Signals(-exit_code).name
    except (TypeError, ValueError):  # no exit code, or not a signal's
        return "a signal"


def _positive(value: object, integer: bool) -> bool:
    kinds = (int,) if integer else (int, float)
    return not isinstance(value, bool) and isinstance(value, kinds) and value > 0 and value != math.inf


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED
