"""Starts one sandboxed program and ends everything it started: LocalSandbox runs it as
`python -I -S supervisor.py CONFIG_JSON`, with the program's stdin, stdout and stderr
as its own and the write end of a status pipe at CONFIG["status_fd"].

With `namespaces` (root only): new pid, network, IPC and UTS namespaces. The first
child is the pid namespace's init: in a new mount namespace it builds a root of its
own (read-only binds of the system directories and the interpreter, a minimal /dev, a
new /proc, a private tmpfs /tmp holding the run directory), chroots into it and starts
the program as an unprivileged user. When init exits the kernel kills every process
left in the namespace, so nothing the program started outlives it.
Without: the program runs as the caller, under rlimits only; this process is a child
subreaper, so descendants that leave their process group still end up its children,
and it kills them all when the program ends or at SIGTERM.

Either way the program ends by SIGTERM to this process (the deadline), by the death of
its parent (the sandbox), or at CONFIG["backstop_s"] should neither come; one JSON
line on the status pipe says how it ended: {"exit": N}, {"signal": N} or {"error": text}.
Standard library only, imports nothing of async_rl: it runs before any isolation.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2

SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEVICE_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                "stderr": "/proc/self/fd/2"}

ORPHANED = signal.SIGUSR1  # the parent-death signal: the sandbox that started this run is gone

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                     ctypes.c_ulong(flags), data and data.encode()), f"mount {target}")


def read_only(root: str) -> None:
    """Every mount under `root` read-only and nosuid (these copies only: the host's stay)."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), root.encode(),
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
          "mount_setattr (Linux 5.12+)")


def bind(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)


def read_tree(top: str) -> dict[str, bytes]:
    files = {}
    for folder, _, names in os.walk(top):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, top)] = f.read()
    return files


def build_root(config: dict, root: str) -> None:
    """The program's filesystem, mounted at `root`: nothing of the host's beyond the
    system directories and the interpreter, all read-only; /tmp a private tmpfs."""
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name in SYSTEM_DIRS:
        source, target = "/" + name, os.path.join(root, name)
        if os.path.islink(source):  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.mkdir(target)
            bind(source, target)
    # The interpreter, where it lives outside the system directories; one under /tmp (a
    # virtual environment there) goes in after the private /tmp is mounted over it.
    under_tmp = [path for path in config["expose"] if path == "/tmp" or path.startswith("/tmp/")]
    for path in config["expose"]:
        if path not in under_tmp:
            os.makedirs(root + path, exist_ok=True)
            bind(path, root + path)
    dev = os.path.join(root, "dev")
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "size=64k,mode=755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(os.path.join(dev, name), "w").close()
            mount("/dev/" + name, os.path.join(dev, name), None, MS_BIND)
    for name, target in DEVICE_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    for name in ("proc", "tmp", "dev/shm"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    read_only(root)
    mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    tmp = os.path.join(root, "tmp")
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,mode=1777")
    mount(tmp, os.path.join(dev, "shm"), None, MS_BIND)
    for path in under_tmp:
        os.makedirs(root + path, exist_ok=True)
        bind(path, root + path)
        read_only(root + path)


def fill_run_dir(config: dict, files: dict[str, bytes]) -> None:
    run_dir = config["run_dir"]
    os.mkdir(run_dir, 0o700)
    for name, data in files.items():
        path = os.path.join(run_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    for folder, _, names in os.walk(run_dir):
        for path in [folder] + [os.path.join(folder, name) for name in names]:
            os.chown(path, config["uid"], config["gid"])


def user_tasks(uid: int) -> int:
    """Tasks (threads count) whose real uid is `uid`: RLIMIT_NPROC counts all of them."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                pass
    return count


def start_program(config: dict) -> None:
    """In the forked child: limits, the user, then exec. Never returns."""
    try:
        limits = config["limits"]
        mb = 1024 * 1024
        nproc = limits["max_processes"]
        if not config["namespaces"] and os.getuid() != 0:  # the caller's own processes count too
            nproc += user_tasks(os.getuid())
        for which, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc),
                             (resource.RLIMIT_NOFILE, limits["open_files"]),
                             (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb)):
            resource.setrlimit(which, (value, value))
        cpu = max(1, int(limits["cpu_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
        if config["namespaces"]:
            os.setgroups([])
            os.setresgid(config["gid"], config["gid"], config["gid"])
            os.setresuid(config["uid"], config["uid"], config["uid"])
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.chdir(config["run_dir"])
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them, and exec keeps what is ignored
            signal.signal(sig, signal.SIG_DFL)
        os.closerange(3, 65536)
        # Last: the limit applies to this process too, and exec starts a fresh address space.
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
        os.execve(config["python"], config["argv"], config["env"])
    except BaseException as err:  # whatever it was, the program did not start
        os.write(2, f"sandbox: the program could not start: {err}\n".encode())
    os._exit(127)


def wait_for(pid: int) -> dict:
    """Reaps children (adopted orphans too) until `pid` ends; how it ended."""
    while True:
        try:
            done, status = os.wait()
        except ChildProcessError:
            return {"error": "the program vanished"}
        if done == pid:
            if os.WIFSIGNALED(status):
                return {"signal": os.WTERMSIG(status)}
            return {"exit": os.waitstatus_to_exitcode(status)}


def end_descendants() -> None:
    """SIGKILLs every child, and the orphans each death hands over, until none is left."""
    while True:
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            children = []
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            return


def report(config: dict, outcome: dict) -> None:
    try:
        os.write(config["status_fd"], (json.dumps(outcome) + "\n").encode())
    except OSError:
        pass  # the sandbox stopped listening: it has given up on this run


def init(config: dict) -> None:
    """Pid 1 of the new pid namespace. Never returns; its exit ends the namespace."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
        check(libc.unshare(CLONE_NEWNS), "unshare")  # here, not above: the supervisor keeps the host's view
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
        files = read_tree(config["staging"])
        build_root(config, config["staging"])
        os.chroot(config["staging"])
        os.chdir("/")
        fill_run_dir(config, files)
    except BaseException as err:  # reported, then the run ends
        report(config, {"error": f"sandbox setup failed: {err}"})
        os._exit(1)
    program = os.fork()
    if program == 0:
        start_program(config)
    report(config, wait_for(program))
    os._exit(0)


def main() -> None:
    config = json.loads(sys.argv[1])
    child = 0

    def stop(signum, frame):  # the deadline, or (ORPHANED) the sandbox's death
        if signum == ORPHANED:
            config["orphaned"] = True
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not config["namespaces"]:
            end_descendants()
            finish(config)

    signal.signal(signal.SIGTERM, stop)
    # Should the sandbox die, or stop keeping time, the run still ends. Its death comes as
    # a signal of its own: the parent pid may not have changed yet when it arrives.
    signal.signal(ORPHANED, stop)
    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, config["backstop_s"])
    check(libc.prctl(PR_SET_PDEATHSIG, ORPHANED, 0, 0, 0), "pdeathsig")
    if os.getppid() != config["parent"]:  # it died before the line above
        finish(config)
    if config["namespaces"]:
        try:
            check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
        except OSError as err:
            report(config, {"error": f"sandbox setup failed: {err}"})
            sys.exit(1)
        child = os.fork()
        if child == 0:
            for sig in (signal.SIGTERM, signal.SIGALRM, ORPHANED):
                signal.signal(sig, signal.SIG_DFL)
            init(config)
        try:  # pid 1 reports; its end means the namespace is empty
            os.waitpid(child, 0)
        except ChildProcessError:
            pass
        finish(config)
    check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
    child = os.fork()
    if child == 0:
        start_program(config)
    outcome = wait_for(child)
    for sig in (signal.SIGTERM, signal.SIGALRM, ORPHANED):  # from here on it ends everything itself
        signal.signal(sig, signal.SIG_IGN)
    end_descendants()
    report(config, outcome)
    finish(config)


def finish(config: dict) -> None:
    """Exits, removing the staging directory first where the sandbox died and cannot."""
    if config.get("orphaned") or os.getppid() != config["parent"]:
        shutil.rmtree(config["staging"], ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
