"""HttpSandbox: runs Python code on a SandboxFusion service (its POST /run_code API),
for code that should not run on this machine at all.

The request carries the code, "language": "python", the run and compile timeouts,
memory_limit_MB, stdin, and files as base64. The answer's status is Success, Failed or
SandboxError; its run_result has a status (Finished, TimeLimitExceeded, Error),
return_code, stdout and stderr. Connection errors and HTTP 5xx and 429 answers are
retried with exponential backoff while the deadline allows; a timeout never is, since
the service may still be running the code (rewards/remote.py).
"""
from __future__ import annotations

import base64
import json
import time

from async_rl.rewards.remote import NoAnswer, Unavailable, post_json
from async_rl.sandbox.execution import Execution
from async_rl.sandbox.limits import SandboxLimits


class HttpSandbox:
    """A SandboxFusion service at `url` (its base, or the /run_code endpoint itself)."""

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 3, *, limits: SandboxLimits | None = None,
                 grace_s: float = 5.0) -> None:
        """`timeout_s`: the run's limit, sent to the service; a call gives up `grace_s`
        later (the service's own overhead and the network). `retries`: further attempts
        after a connection error or a 5xx/429 answer. `limits`: memory_mb is sent,
        output_bytes caps what is returned."""
        if not timeout_s > 0 or retries < 0 or grace_s < 0:
            raise ValueError(f"HttpSandbox: timeout_s must be positive, retries and grace_s not negative "
                             f"(got {timeout_s}, {retries}, {grace_s})")
        base = url.rstrip("/")
        self.url = base if base.endswith("/run_code") else base + "/run_code"
        self.timeout_s, self.retries, self.grace_s = timeout_s, retries, grace_s
        self.limits = limits or SandboxLimits()
        self.isolation = f"remote: SandboxFusion at {self.url}"

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            timeout_s: float | None = None) -> Execution:
        """Runs `code` on the service; returns by the deadline (`timeout_s`, else the
        sandbox's, plus grace_s), an unreachable service as an error naming it."""
        start = time.monotonic()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = start + timeout + self.grace_s
        body = {
            "code": code, "language": "python", "stdin": stdin,
            "run_timeout": timeout, "compile_timeout": timeout, "memory_limit_MB": self.limits.memory_mb,
            "files": {name: base64.b64encode(text.encode("utf-8")).decode("ascii")
                      for name, text in (files or {}).items()},
        }
        try:
            answer = post_json(self.url, body, deadline, self.retries, what="sandbox service")
        except NoAnswer as err:
            return self._failed("timeout", str(err), start)
        except Unavailable as err:
            return self._failed("unavailable", str(err), start)
        return self._execution(answer, start)

    def _execution(self, answer: bytes, start: float) -> Execution:
        try:
            payload = json.loads(answer)
            result = payload.get("run_result") or {}
            outcome, code = payload.get("status"), result.get("return_code")
            stdout, stderr = result.get("stdout") or "", result.get("stderr") or ""
            if not isinstance(stdout, str) or not isinstance(stderr, str) or not isinstance(code, (int, type(None))):
                raise TypeError("run_result fields of the wrong type")
        except (ValueError, AttributeError, TypeError) as err:
            return self._failed("unavailable", f"sandbox service: unreadable answer ({err})", start)
        if outcome == "SandboxError" or result.get("status") == "Error":
            message = payload.get("message") or stderr or "no message"
            return self._failed("unavailable", f"sandbox service error: {message}", start)
        if result.get("status") == "TimeLimitExceeded":
            status, code = "timeout", None
        elif result.get("status") == "Finished" and code is not None:
            status = "ok" if code == 0 else "killed" if code < 0 else "error"
        else:
            return self._failed("unavailable", f"sandbox service: unexpected answer (status {outcome!r}, "
                                         f"run_result status {result.get('status')!r})", start)
        if len(stdout.encode()) + len(stderr.encode()) > self.limits.output_bytes:
            status, code = "output_limit", None
            stdout = _clip(stdout, self.limits.output_bytes)
            stderr = _clip(stderr, self.limits.output_bytes - len(stdout.encode()))
        return Execution(status, code, stdout, stderr, time.monotonic() - start, self.isolation)

    def _failed(self, status: str, message: str, start: float) -> Execution:
        return Execution(status, None, "", message + "\n", time.monotonic() - start, self.isolation)


def _clip(text: str, limit: int) -> str:
    return text.encode("utf-8")[:max(0, limit)].decode("utf-8", "ignore")
