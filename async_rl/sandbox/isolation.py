"""What contains LocalSandbox's programs on this machine, found once per process: Linux
namespaces and an unprivileged user where this process is root and a trial run shows
them working, rlimits alone otherwise, and then one warning says that code is not
isolated."""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from async_rl.sandbox.execution import Execution
from async_rl.sandbox.supervisor import SYSTEM_DIRS

log = logging.getLogger("async_rl.sandbox")

NOBODY = 65534
NAMESPACES = "namespaces+nobody"

# The trial: it must run as nobody, as the child of its pid namespace's init, and find
# the network unreachable (not merely refused).
TRIAL_CODE = """import errno, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1).close()
    network = "reachable"
except OSError as err:
    network = "unreachable" if err.errno in (errno.ENETUNREACH, errno.EADDRNOTAVAIL) else "reachable"
print(os.getuid(), os.getppid(), network)
"""
TRIAL_OUTPUT = f"{NOBODY} 1 unreachable"


@dataclass(frozen=True)
class Isolation:
    namespaces: bool
    label: str  # Execution.isolation


_lock = threading.Lock()
_found: Isolation | None = None
_warned = False


def detect(trial: Callable[[], Execution]) -> Isolation:
    """This machine's isolation, tried (`trial` runs TRIAL_CODE with namespaces) once
    per process."""
    global _found
    with _lock:
        if _found is None:
            _found = _probe(trial)
            if not _found.namespaces:
                _warn(_found)
        return _found


def turned_off() -> Isolation:
    isolation = Isolation(False, "rlimits only (not isolated: turned off)")
    with _lock:
        _warn(isolation)
    return isolation


def _warn(isolation: Isolation) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("sandboxed code is NOT isolated here, %s: it runs as this user, with this user's "
                    "files and network, under resource limits only", isolation.label)


def _probe(trial: Callable[[], Execution]) -> Isolation:
    if not sys.platform.startswith("linux"):
        reason = "not Linux"
    elif os.geteuid() != 0:
        reason = "not root"
    else:
        try:
            result = trial()
        except Exception as err:  # any failure of the trial means no namespaces
            reason = f"namespaces unavailable: {err}"
        else:
            if result.ok and result.stdout.strip() == TRIAL_OUTPUT:
                return Isolation(True, NAMESPACES)
            if result.stderr.strip():
                said = result.stderr.strip().splitlines()[-1]
            else:
                said = f"the trial printed {result.stdout.strip()!r}, not {TRIAL_OUTPUT!r} (uid, parent pid, network)"
            reason = f"namespaces unavailable: {said}"
    return Isolation(False, f"rlimits only (not isolated: {reason})")


@functools.cache
def interpreter_paths() -> list[str]:
    """The directories this interpreter needs that lie outside the system directories
    (a pyenv or conda prefix, a virtual environment): a namespaced run binds them
    read-only into its root."""
    wanted = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))}
    wanted |= {os.path.realpath(path) for path in wanted}
    system = [os.path.realpath("/" + name) for name in SYSTEM_DIRS if os.path.exists("/" + name)]
    kept: list[str] = []
    for path in sorted(os.path.abspath(p) for p in wanted):
        inside = [*system, *kept]
        if not any(_within(os.path.realpath(path), top) or _within(path, top) for top in inside):
            kept.append(path)
    return kept


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")
