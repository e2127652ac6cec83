"""Scoring a response's code against unit tests in a sandbox.

Tests come in two kinds. Assert lines (`assert add(1, 2) == 3`) run in ONE program: the
code (as solution.py, run as __main__; an exception or exit there is recorded and the
tests still run), then each line in its own try/except in the code's namespace. Each
result is written, as it is known, on a line of its own that starts with a random
nonce of the run, to a copy of stdout made before the code ran: output of the code,
however it imitates a result, lacks the nonce, so it cannot be taken for one by
accident; and a test that hangs still leaves the results before it. The limit: the
code shares the harness's process, so code that sets out to (reading main.py,
inspecting frames, patching modules) can find the nonce and forge results.
Stdin/stdout cases ({"input": ..., "output": ...}) run the code once per case and pass
where it exits 0 and its stdout, stripped and without trailing spaces on each line,
equals the expected output treated the same way.
"""
from __future__ import annotations

import json
import re
import secrets
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from async_rl.sandbox.execution import Execution, Sandbox

FENCE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)
PYTHON_TAGS = ("python", "py", "python3")
MESSAGE_CHARS = 300

HARNESS = r'''import json as _json, os as _os, sys as _sys

_NONCE = __NONCE__
_TESTS = __TESTS__
_out, _write, _dumps = _os.dup(1), _os.write, _json.dumps


def _report(record):
    try:
        _sys.stdout.flush()
    except BaseException:
        pass
    _write(_out, ("\n%s %s\n" % (_NONCE, _dumps(record))).encode())


def _describe(err):
    if isinstance(err, AssertionError) and not str(err):
        return "AssertionError"
    return ("%s: %s" % (type(err).__name__, err))[:__CHARS__]


_scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    with open("solution.py", encoding="utf-8") as _f:
        exec(compile(_f.read(), "solution.py", "exec"), _scope)
except SystemExit:
    pass
except BaseException as _err:
    _report({"setup": _describe(_err)})
for _i, _test in enumerate(_TESTS):
    try:
        exec(compile(_test, "<test %d>" % _i, "exec"), _scope)
    except BaseException as _err:
        _report({"test": _i, "error": _describe(_err)})
    else:
        _report({"test": _i})
'''


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the code (Execution status `unavailable`): the tests say
    nothing about it, so the call fails rather than scoring 0."""


def _ran(execution: Execution) -> Execution:
    if execution.status == "unavailable":
        raise SandboxUnavailable(execution.stderr.strip().splitlines()[-1] if execution.stderr.strip()
                                 else "the sandbox could not run the code")
    return execution


@dataclass(frozen=True)
class TestResult:
    """How many of `total` tests passed; `first_failure` says why the first one that did
    not pass failed ("" when all passed); `execution` is the run that decided it (the
    assert program, or the first failing stdin/stdout case, else the last one), None
    where nothing ran (code that does not compile)."""

    __test__ = False  # not a pytest test class

    passed: int
    total: int
    first_failure: str
    execution: Execution | None

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def extract_code(response: str) -> str | None:
    """The last ```python (or py, python3) fenced block of `response`, else its last
    plain ``` block, else None. Fences must open and close on lines of their own."""
    blocks = [(tag.lower(), body) for tag, body in FENCE.findall(response)]
    for wanted in (PYTHON_TAGS, ("",)):
        chosen = [body for tag, body in blocks if tag in wanted]
        if chosen:
            return textwrap.dedent(chosen[-1])
    return None


def score_code(code: str, tests: Sequence[str] | Sequence[Mapping[str, str]], sandbox: Sandbox,
               timeout_s: float | None = None) -> TestResult:
    """Runs `code` against `tests` (assert lines, or stdin/stdout cases) in `sandbox`;
    `timeout_s` bounds each run (the sandbox's own limit by default). SandboxUnavailable
    when the sandbox could not run it."""
    if not tests or isinstance(tests, (str, bytes)):
        raise ValueError("tests: expected a non-empty list of assert lines or of {'input', 'output'} cases")
    if all(isinstance(test, str) for test in tests):
        kind = "asserts"
    elif all(isinstance(test, Mapping) and isinstance(test.get("input"), str) and isinstance(test.get("output"), str)
             for test in tests):
        kind = "cases"
    else:
        raise ValueError("tests: every item must be an assert line (str), or every item an "
                         "{'input': str, 'output': str} case")
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
    except Exception as err:  # SyntaxError, and ValueError for NUL bytes, RecursionError, ...
        return TestResult(0, len(tests), f"the code does not compile: {_describe(err)}", None)
    if kind == "asserts":
        return _score_asserts(code, list(tests), sandbox, timeout_s)
    return _score_cases(code, list(tests), sandbox, timeout_s)


def _score_asserts(code: str, tests: list[str], sandbox: Sandbox, timeout_s: float | None) -> TestResult:
    nonce = secrets.token_hex(16)
    program = (HARNESS.replace("__NONCE__", repr(nonce)).replace("__TESTS__", repr(tests))
               .replace("__CHARS__", str(MESSAGE_CHARS)))
    execution = _ran(sandbox.run(program, files={"solution.py": code}, timeout_s=timeout_s))
    setup_error, errors = None, {}
    prefix = nonce + " "
    for line in execution.stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            record = json.loads(line[len(prefix):])
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "setup" in record:
            setup_error = str(record["setup"])
        elif isinstance(record.get("test"), int) and 0 <= record["test"] < len(tests):
            errors.setdefault(record["test"], record.get("error"))
    passed = sum(1 for index in errors if errors[index] is None)
    failure = ""
    for index, test in enumerate(tests):
        if index not in errors:
            failure = f"{_short(test)}: not run, {_how_it_ended(execution)}"
            break
        if errors[index] is not None:
            failure = f"{_short(test)}: {errors[index]}"
            break
    if failure and setup_error:
        failure = f"the code raised {setup_error} before the tests; {failure}"
    return TestResult(passed, len(tests), failure, execution)


def _score_cases(code: str, cases: list[Mapping[str, str]], sandbox: Sandbox, timeout_s: float | None) -> TestResult:
    passed, failure, deciding = 0, "", None
    for index, case in enumerate(cases):
        execution = _ran(sandbox.run(code, stdin=case["input"], timeout_s=timeout_s))
        expected, got = _normalized(case["output"]), _normalized(execution.stdout)
        if execution.ok and got == expected:
            passed += 1
            continue
        if not failure:
            deciding = execution
            if not execution.ok:
                failure = f"case {index}: {_how_it_ended(execution)}"
            else:
                failure = f"case {index}: expected {_short(expected)!r}, got {_short(got)!r}"
    return TestResult(passed, len(cases), failure, deciding or execution)


def _normalized(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


def _how_it_ended(execution: Execution) -> str:
    last = execution.stderr.strip().splitlines()[-1:] or [""]
    said = f" ({_short(last[0])})" if last[0] else ""
    if execution.status == "timeout":
        return "the run timed out"
    if execution.status == "output_limit":
        return "the output exceeded its cap and the run was stopped"
    if execution.status == "killed":
        return f"the run was killed (exit code {execution.exit_code}){said}"
    return f"the program ended (exit code {execution.exit_code}){said}"


def _describe(err: BaseException) -> str:
    where = f" (line {err.lineno})" if isinstance(err, SyntaxError) and err.lineno else ""
    return _short(f"{type(err).__name__}: {getattr(err, 'msg', None) or err}{where}")


def _short(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."
