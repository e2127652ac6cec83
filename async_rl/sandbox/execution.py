"""How one sandboxed run ended: the result every sandbox returns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# ok: exit status 0; error: a non-zero exit status;
# timeout: the wall-clock limit; killed: ended by a signal (CPU or memory limit, ...);
# output_limit: stdout and stderr grew beyond the cap, and the run was stopped;
# unavailable: the sandbox could not run the code at all (its setup failed, a remote
# service unreachable or failing after its retries): no verdict on the code.
STATUSES = ("ok", "error", "timeout", "killed", "output_limit", "unavailable")


@dataclass(frozen=True)
class Execution:
    """One run's outcome. `exit_code` is None where the program did not exit by itself,
    negative (minus the signal) where a signal ended it; stdout and stderr are decoded
    (invalid UTF-8 replaced) and together at most the output cap. `isolation` names what
    contained the run; `run_id` tags a local run's processes (the environment variable
    ASYNC_RL_SANDBOX_RUN), empty for a remote one."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str
    run_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Sandbox(Protocol):
    """What runs code: LocalSandbox, HttpSandbox."""

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            timeout_s: float | None = None) -> Execution: ...
