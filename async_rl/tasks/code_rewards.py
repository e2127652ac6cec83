"""Rewards for code: the response's last Python block, run against the row's `tests`
in a LocalSandbox (async_rl/sandbox).

- `code_tests`: the fraction of the tests that pass;
- `code_tests_all_pass`: 1.0 only when every test passes.

`tests` is the prompt's field of that name: a list of assert lines
(`"assert add(1, 2) == 3"`), or of stdin/stdout cases (`{"input": "1 2\\n", "output": "3"}`),
or that list as a JSON string (datasets often store it so). A response without a code
block scores 0.0. A `tests` value that is none of these raises ValueError: it is a
fault of the data, counted as a failed reward call rather than passed off as a 0.

The sandbox is built once per process, at the first call: 5 s wall clock and 2 CPU
seconds per run, 512 MB of address space, two runs at a time.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from async_rl.sandbox import LocalSandbox, SandboxLimits, TestResult, extract_code, score_code

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=2.0, memory_mb=512)
MAX_CONCURRENT_RUNS = 2

_sandbox: LocalSandbox | None = None
_sandbox_lock = threading.Lock()  # the actor's guard may call rewards from several threads


def shared_sandbox() -> LocalSandbox:
    """This process's sandbox, built on first use (building it runs a trial program)."""
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = LocalSandbox(LIMITS, max_concurrency=MAX_CONCURRENT_RUNS)
        return _sandbox


def parse_tests(tests: Any) -> list[str] | list[dict[str, str]]:
    """`tests` as a list of assert lines or of {"input", "output"} cases; ValueError in
    one line naming what is wrong with it."""
    if tests is None:
        raise ValueError("code_tests: the prompt has no 'tests' field")
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError as err:
            raise ValueError(f"code_tests: 'tests' is a string but not JSON ({err})") from None
    if isinstance(tests, Mapping) or not isinstance(tests, Sequence) or isinstance(tests, (str, bytes)):
        raise ValueError(f"code_tests: 'tests' must be a list (or a JSON string of one), got {type(tests).__name__}")
    if not tests:
        raise ValueError("code_tests: 'tests' is an empty list")
    if all(isinstance(test, str) for test in tests):
        for index, line in enumerate(tests):
            if not line.strip():  # a blank test passes whatever the code does
                raise ValueError(f"code_tests: tests[{index}] is blank")
            try:
                compile(line, f"<test {index}>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as err:
                raise ValueError(f"code_tests: tests[{index}] is not valid Python "
                                 f"({type(err).__name__}: {getattr(err, 'msg', err)})") from None
        return list(tests)
    for index, case in enumerate(tests):
        if not (isinstance(case, Mapping) and isinstance(case.get("input"), str)
                and isinstance(case.get("output"), str)):
            raise ValueError(f"code_tests: tests[{index}] is neither an assert line nor an "
                             "{'input': str, 'output': str} case (and all tests must be of one kind)")
    return [{"input": case["input"], "output": case["output"]} for case in tests]


def run_tests(response: str, tests: Any) -> TestResult | None:
    """The response's code scored against `tests`; None when it has no code block."""
    parsed = parse_tests(tests)  # first: bad data is an error whatever the response
    code = extract_code(response)
    if code is None:
        return None
    return score_code(code, parsed, shared_sandbox())


def code_tests(prompt: str, response: str, answer: str, tests: Any = None, **fields: Any) -> float:
    """The fraction of `tests` the response's code passes; 0.0 without a code block."""
    result = run_tests(response, tests)
    return 0.0 if result is None else result.fraction


def code_tests_all_pass(prompt: str, response: str, answer: str, tests: Any = None, **fields: Any) -> float:
    """1.0 when the response's code passes every test, else 0.0."""
    result = run_tests(response, tests)
    return float(result is not None and result.all_passed)
