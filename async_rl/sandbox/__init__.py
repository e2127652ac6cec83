"""Running model-written Python code: LocalSandbox on this machine (namespaces and an
unprivileged user where it is root, rlimits only elsewhere), HttpSandbox against a
SandboxFusion service, and score_code, which scores a response's code against unit
tests in either."""
from async_rl.sandbox.code_tests import SandboxUnavailable, TestResult, extract_code, score_code
from async_rl.sandbox.execution import STATUSES, Execution, Sandbox
from async_rl.sandbox.http import HttpSandbox
from async_rl.sandbox.limits import SandboxLimits
from async_rl.sandbox.local import LocalSandbox

__all__ = ["STATUSES", "Execution", "HttpSandbox", "LocalSandbox", "Sandbox", "SandboxLimits", "SandboxUnavailable",
           "TestResult", "extract_code", "score_code"]
