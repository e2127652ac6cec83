"""The run's processes: who dies with whom, how a process ends, what it uses."""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a stop asked for: exit 128 + the signal


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised as KeyboardInterrupt (what every `except KeyboardInterrupt`
    expects), with the signal that asked for it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, _frame) -> None:
    """A signal handler: the stop as Interrupted, in the main thread."""
    raise Interrupted(signum)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def exit_now(code: int) -> None:
    """Flush everything, then end the process without running C++ static destructors.

    With torch 2.13 CPU, a process that held gloo process groups intermittently
    aborts during interpreter teardown ("terminate called without an active
    exception"), after all its work is done, turning a clean run into exit status -6.
    Every file this project writes is closed before this point, so skipping the
    teardown loses nothing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it (Linux /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the command may contain ")"
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo.extend(children.get(tree[-1], []))
    return tree


def die_with_parent(sig: int = 9) -> None:
    """Ask the kernel to send `sig` (default SIGKILL) to this process when its parent
    dies (Linux prctl PR_SET_PDEATHSIG; a no-op elsewhere). Safe in a Popen preexec_fn:
    the setting survives exec. A parent already gone before the call is caught by
    comparing with the parent pid the caller expects."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, sig, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def child_of(parent_pid: int):
    """A Popen preexec_fn: the child dies with `parent_pid` (SIGKILL: nothing of a run
    may go on unsupervised), and exits at once if that parent is already gone."""
    def setup() -> None:
        die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)
    return setup
