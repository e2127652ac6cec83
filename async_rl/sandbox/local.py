"""LocalSandbox: runs model-written Python on this machine, contained as far as the
machine allows, and leaves nothing running when a run is over.

Each run gets a fresh directory (its cwd and HOME, removed afterwards), a scrubbed
environment, `python -I` of this interpreter, its own process group, rlimits (CPU,
address space, processes, file size, open files, no core dumps) and a deadline, at
which every process it started is killed, those that left its group (setsid) or
double-forked included. Its stdout and stderr are read up to a cap, never buffered
beyond it.

Where this process is root on Linux it is also isolated ("namespaces+nobody"): new pid,
network, mount, IPC and UTS namespaces, a root of its own (/usr, /bin, /sbin, /lib*,
/etc and this interpreter's directories read-only, a minimal /dev, a new /proc, a
private tmpfs /tmp with the run directory in it: nothing else of the host's files is
visible, nothing outside the tmpfs is writable), no network (a down loopback only),
its own SysV IPC and hostname, and the user nobody (uid 65534) with
no capabilities, no setuid and no way back (no_new_privs). The pid namespace's init
ends with the program, and the kernel then kills everything left inside it.

What this stops: accidents and ordinary misbehaviour of generated code, such as reading
or deleting files, leaking the environment's secrets, network access, fork bombs,
memory hogs, endless loops, floods of output, daemons that outlive their run.
What it does not: it is not a security boundary against a determined attacker. The
program shares this machine's kernel, so a kernel exploit escapes it; CPU side channels
(Spectre-style) and timing remain; RLIMIT_NPROC counts all of nobody's processes, so
concurrent runs share the process cap; memory is capped per process (address space),
not per run; seccomp filters no system call. For hostile code, run HttpSandbox against
a service in a VM or gVisor.
Elsewhere (not root, or the namespaces fail) it falls back to rlimits only, says so
once in a warning, and names the reason in Execution.isolation: then the program runs
as this user, with this user's files and network.
"""
from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path, PurePosixPath

from async_rl.sandbox.execution import Execution
from async_rl.sandbox.isolation import NOBODY, TRIAL_CODE, Isolation, detect, interpreter_paths, turned_off
from async_rl.sandbox.limits import SandboxLimits

SUPERVISOR = str(Path(__file__).with_name("supervisor.py"))
PROGRAM = "main.py"  # the code's file in the run directory
RUN_TAG = "ASYNC_RL_SANDBOX_RUN"  # in every process of a run: finds the strays of an unisolated one
PATH = "/usr/local/bin:/usr/bin:/bin"
GRACE_S = 0.5  # how long the supervisor has to end a run before its whole group is SIGKILLed
BACKSTOP_S = 2.0  # the supervisor ends a run by itself this long after its deadline
STATUS_CAP = 4096


class LocalSandbox:
    """Runs Python code in a contained child process, at most `max_concurrency` at a time
    (further calls wait for a slot; a run's deadline starts when it has one)."""

    def __init__(self, limits: SandboxLimits | None = None, max_concurrency: int = 4, *, isolate: bool = True) -> None:
        """`isolate=False` skips the namespaces even where they work (rlimits only)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.limits = limits or SandboxLimits()
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self.isolation: Isolation = detect(self._trial) if isolate else turned_off()

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            timeout_s: float | None = None) -> Execution:
        """Runs `code` as the file main.py in a fresh directory holding `files` (relative
        paths to their text), with `stdin` as its standard input; returns by the deadline
        (`timeout_s`, else the limits') plus about a second."""
        program_files = _checked_files(files or {})
        program_files[PROGRAM] = code
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        with self._slots:
            return _execute(program_files, stdin, timeout, self.limits, self.isolation)

    def _trial(self) -> Execution:
        return _execute({PROGRAM: TRIAL_CODE}, "", 10.0, SandboxLimits(), Isolation(True, "trial"))


def _checked_files(files: dict[str, str]) -> dict[str, str]:
    checked = {}
    for name, text in files.items():
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or str(path) in (".", PROGRAM):
            raise ValueError(f"file name {name!r}: must be a relative path inside the run directory, not {PROGRAM}")
        checked[str(path)] = text
    return checked


def _execute(files: dict[str, str], stdin: str, timeout_s: float, limits: SandboxLimits,
             isolation: Isolation) -> Execution:
    start = time.monotonic()
    run_id = secrets.token_hex(8)
    staging = tempfile.mkdtemp(prefix="async-rl-sandbox-")
    try:
        for name, text in files.items():
            path = os.path.join(staging, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
        # With namespaces the run directory is a copy in the run's own tmpfs /tmp.
        run_dir = "/tmp/" + os.path.basename(staging) if isolation.namespaces else staging
        config = {
            "namespaces": isolation.namespaces, "staging": staging, "run_dir": run_dir,
            "parent": os.getpid(), "backstop_s": timeout_s + BACKSTOP_S,
            "uid": NOBODY, "gid": NOBODY, "disk_mb": limits.disk_mb,
            "expose": interpreter_paths() if isolation.namespaces else [],
            "python": sys.executable, "argv": [sys.executable, "-I", PROGRAM], "env": _environment(run_dir, run_id),
            "limits": {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
                       "file_size_mb": limits.file_size_mb, "open_files": limits.open_files},
        }
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8", "replace"))
            stdin_file.seek(0)
            return _supervise(config, stdin_file, start + timeout_s, limits.output_bytes, isolation, run_id, start)
    finally:
        _remove(staging)


def _environment(run_dir: str, run_id: str) -> dict[str, str]:
    return {
        "PATH": PATH, "HOME": run_dir, "TMPDIR": run_dir, "LANG": "C.UTF-8",
        # `python -I` ignores it; Pythons that the program starts without -I keep it.
        "PYTHONHASHSEED": "0",
        # Numerical libraries would start a thread per core, each counting against the process cap.
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        RUN_TAG: run_id,
    }


def _supervise(config: dict, stdin_file, deadline: float, cap: int, isolation: Isolation, run_id: str,
               start: float) -> Execution:
    status_read, status_write = os.pipe()
    config["status_fd"] = status_write
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", SUPERVISOR, json.dumps(config)], stdin=stdin_file,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_write,),
            start_new_session=True, env={"PATH": PATH}, cwd="/")
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    report = b""
    try:
        stdout, stderr, report, ended = _collect(process, status_read, deadline, cap)
    finally:
        os.close(status_read)
        for pipe in (process.stdout, process.stderr):
            pipe.close()
        _end(process, isolation.namespaces, run_id, reported=bool(report))
    outcome = _outcome(report)
    exit_code = outcome.get("exit", -outcome["signal"] if "signal" in outcome else None)
    text_err = stderr.decode("utf-8", "replace")
    if ended in ("timeout", "output_limit"):
        status, exit_code = ended, None
    elif "error" in outcome:  # its supervisor could not set the run up
        status, text_err = "unavailable", text_err + f"\n{outcome['error']}\n"
    elif "signal" in outcome:
        status = "killed"
    elif "exit" in outcome:
        status = "ok" if exit_code == 0 else "error"
    else:  # its supervisor died first: only a program running as the same user can do that
        status, text_err = "killed", text_err + "\nsandbox: the run's supervisor was killed\n"
    return Execution(status, exit_code, stdout.decode("utf-8", "replace"), text_err,
                     time.monotonic() - start, isolation.label, run_id)


def _outcome(report: bytes) -> dict:
    """The supervisor's report; {} where there is none (it died), or none readable."""
    try:
        outcome = json.loads(report.split(b"\n", 1)[0]) if report else {}
    except ValueError:
        return {}
    return outcome if isinstance(outcome, dict) else {}


def _collect(process: subprocess.Popen, status_read: int, deadline: float,
             cap: int) -> tuple[bytes, bytes, bytes, str]:
    """Reads stdout and stderr (together up to `cap`) and the supervisor's report until
    all three close, the deadline passes or the output exceeds the cap; says which."""
    outputs = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    report = bytearray()
    ended = "done"
    with selectors.DefaultSelector() as selector:
        for fd in (*outputs, status_read):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ended = "timeout"
                break
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    if key.fd == status_read and not report:
                        ended = "unreported"  # the supervisor is gone; the program may not be
                elif key.fd == status_read:
                    report += data[:STATUS_CAP - len(report)]
                else:
                    room = cap - sum(len(buffer) for buffer in outputs.values())
                    outputs[key.fd] += data[:room]
                    if len(data) > room:
                        ended = "output_limit"
            if ended in ("output_limit", "unreported"):
                break
    return (bytes(outputs[process.stdout.fileno()]), bytes(outputs[process.stderr.fileno()]),
            bytes(report), "done" if ended == "unreported" else ended)


def _end(process: subprocess.Popen, namespaces: bool, run_id: str, reported: bool) -> None:
    """Ends whatever is left of the run and reaps its supervisor. Its pid stays unreaped
    (a zombie at worst) until the end, so the process group it names is still this run's."""
    if not _exited(process.pid, 0):
        # Not Popen.send_signal: it would reap the supervisor, freeing its pid and group.
        os.kill(process.pid, signal.SIGTERM)  # the supervisor kills the run's processes and exits
    if not _exited(process.pid, GRACE_S):
        _kill_group(process.pid)
        reported = False
    if not namespaces and not reported:
        # A program running as this user may have killed its supervisor, or outlived it:
        # its strays are in the group, or carry the run's tag.
        _kill_group(process.pid)
        _kill_tagged(run_id)
    process.wait()


def _exited(pid: int, timeout_s: float) -> bool:
    """Whether the child `pid` has exited within `timeout_s`, without reaping it."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already, by someone else
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)


def _kill_group(pgid: int) -> None:
    """SIGKILLs the group and waits (a second at most) until only zombies are left in it."""
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if _group_members(pgid) == 0:
            return
        time.sleep(0.005)


def _group_members(pgid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                count += 1
    return count


def tagged_processes(run_id: str) -> list[int]:
    """Live processes of the run `run_id`: every process of a run carries its tag in its
    environment (zombies have none and are no longer running)."""
    needle = f"{RUN_TAG}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _kill_tagged(run_id: str) -> None:
    for _ in range(100):
        found = tagged_processes(run_id)
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _remove(path: str) -> None:
    """Removes the staging directory, also where the program took away its own permissions."""
    def writable(function, failed, _):
        try:
            os.chmod(os.path.dirname(failed), 0o700)
            os.chmod(failed, 0o700)
            function(failed)
        except OSError:
            pass  # gone already, or beyond repair: a leftover in the temporary directory

    shutil.rmtree(path, onerror=writable)
