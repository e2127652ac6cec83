import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from async_rl.sandbox import Execution, LocalSandbox, SandboxLimits
from async_rl.sandbox import isolation as isolation_module

BOTH = ["sandbox", "unisolated_sandbox"]


def test_a_program_runs_and_its_stdout_comes_back(sandbox, contained):
    result = contained(sandbox, "print('hello', 6 * 7)")
    assert (result.status, result.exit_code, result.stdout, result.stderr) == ("ok", 0, "hello 42\n", "")
    assert result.isolation == sandbox.isolation.label
    assert result.isolation.startswith(("namespaces", "rlimits only"))


def test_a_non_zero_exit_is_an_error(sandbox, contained):
    result = contained(sandbox, "import sys\nprint('partial')\nsys.exit(3)")
    assert (result.status, result.exit_code, result.stdout) == ("error", 3, "partial\n")
    raised = contained(sandbox, "raise ValueError('bad input')")
    assert raised.status == "error" and raised.exit_code == 1
    assert "ValueError: bad input" in raised.stderr


def test_a_syntax_error_is_an_error(sandbox, contained):
    result = contained(sandbox, "def f(:\n    pass")
    assert result.status == "error" and "SyntaxError" in result.stderr


def test_stdin_reaches_the_program(sandbox, contained):
    result = contained(sandbox, "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2\n3\n")
    assert result.stdout == "6\n"


def test_files_are_in_the_run_directory_which_is_removed_afterwards(sandbox, contained):
    code = ("import os\nprint(open('data/numbers.txt').read())\nprint(os.getcwd() == os.environ['HOME'])\n"
            "print(os.getcwd())")
    result = contained(sandbox, code, files={"data/numbers.txt": "1 2 3"})
    text, same, cwd = result.stdout.splitlines()
    assert (text, same) == ("1 2 3", "True")
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), os.path.basename(cwd)))


@pytest.mark.parametrize("name", ["/etc/x", "../x", "a/../../x", "main.py", ""])
def test_file_names_outside_the_run_directory_are_refused(sandbox, name):
    with pytest.raises(ValueError, match="relative path"):
        sandbox.run("pass", files={name: "x"})


def test_the_environment_is_scrubbed(sandbox, contained, monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_API_KEY", "hunter2")
    result = contained(sandbox, "import os\nfor k, v in sorted(os.environ.items()):\n    print(k, v)")
    assert "hunter2" not in result.stdout
    environment = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert environment["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert environment["PYTHONHASHSEED"] == "0"
    assert environment["HOME"] == environment["TMPDIR"]


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_the_concurrency_cap_is_respected(contained):
    sandbox = LocalSandbox(SandboxLimits(timeout_s=5), max_concurrency=2)
    code = "import time\nstart = time.time()\ntime.sleep(0.4)\nprint(start, time.time())"
    spans: list[tuple[float, float]] = []

    def one() -> None:
        result = sandbox.run(code)
        spans.append(tuple(float(x) for x in result.stdout.split()))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(spans) == 4
    most = max(sum(1 for start, end in spans if start <= moment < end) for moment, _ in spans)
    assert most <= 2


# Hostile programs: each must be contained (the `contained` fixture checks the deadline,
# and that no process or thread is left) and say why it ended.

@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_an_endless_loop_times_out(sandbox, contained):
    result = contained(sandbox, "while True:\n    pass")
    assert (result.status, result.exit_code) == ("timeout", None)


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_the_cpu_limit_kills(contained):
    sandbox = LocalSandbox(SandboxLimits(timeout_s=8, cpu_s=1))  # the wall clock only as a backstop
    result = contained(sandbox, "while True:\n    pass")
    assert (result.status, result.exit_code) == ("killed", -signal.SIGXCPU)


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
@pytest.mark.parametrize("fixture", BOTH)
def test_sleeping_for_ever_times_out(fixture, request, contained):
    result = contained(request.getfixturevalue(fixture), "import time\nprint('going to sleep', flush=True)\n"
                                                         "time.sleep(1000)")
    assert (result.status, result.stdout) == ("timeout", "going to sleep\n")


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
@pytest.mark.parametrize("fixture", BOTH)
def test_os_system_sleep_is_killed_at_the_deadline(fixture, request, contained):
    result = contained(request.getfixturevalue(fixture), "import os\nos.system('sleep 1000')")
    assert result.status == "timeout"


@pytest.mark.parametrize("fixture", BOTH)
def test_a_daemon_that_outlives_its_parent_is_killed(fixture, request, contained):
    code = """import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.closerange(0, 3)
        time.sleep(1000)
    os._exit(0)
os.wait()
print('parent exits')
"""
    result = contained(request.getfixturevalue(fixture), code)
    assert (result.status, result.stdout) == ("ok", "parent exits\n")


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
@pytest.mark.parametrize("fixture", BOTH)
def test_killing_its_parent_leaves_nothing_running(fixture, request, contained):
    code = """import os, time
try:
    os.kill(os.getppid(), 9)
except OSError as err:
    print('could not kill the parent:', type(err).__name__, flush=True)
if os.fork() == 0:
    os.setsid()
    time.sleep(1000)
time.sleep(1000)
"""
    sandbox = request.getfixturevalue(fixture)
    result = contained(sandbox, code)
    assert result.status in ("timeout", "killed")
    if sandbox.isolation.namespaces:  # its parent is the namespace's init, root's
        assert result.stdout == "could not kill the parent: PermissionError\n"


@pytest.mark.integration  # waits out a real process's deadline: the integration tier
def test_a_fork_bomb_is_contained(sandbox, contained):
    if not sandbox.isolation.namespaces and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not bind root: without namespaces a fork bomb would run as root")
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = contained(sandbox, code)
    assert result.status == "timeout"


@pytest.mark.parametrize("code", [
    "x = bytearray(4 * 1024 ** 3)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))",
], ids=["at-once", "growing"])
def test_a_memory_hog_is_stopped(sandbox, contained, code):
    result = contained(sandbox, code)
    assert result.status in ("error", "killed")
    assert result.status == "killed" or "MemoryError" in result.stderr


def test_a_flood_of_output_is_cut_at_the_cap(sandbox, contained):
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)"
    result = contained(sandbox, code)
    assert (result.status, result.exit_code) == ("output_limit", None)
    assert 0 < len(result.stdout.encode()) + len(result.stderr.encode()) <= sandbox.limits.output_bytes


def test_a_secret_outside_the_run_directory_cannot_be_read(isolated, contained, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-VALUE")
    secret.chmod(0o600)
    readable = [str(secret)] + (["/etc/shadow"] if os.path.exists("/etc/shadow") else [])
    code = f"""for path in {readable!r}:
    try:
        print(path, open(path).read())
    except OSError as err:
        print(path, 'denied', type(err).__name__)
"""
    result = contained(isolated, code)
    assert "SECRET-VALUE" not in result.stdout + result.stderr
    assert result.stdout.count("denied") == len(readable), result.stdout
    if os.path.exists("/etc/shadow"):  # visible, but not to nobody
        assert "/etc/shadow denied PermissionError" in result.stdout


def test_nothing_is_written_outside_the_run_directory(isolated, contained, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("original")
    target.chmod(0o666)
    name = f"sandbox-test-{uuid.uuid4().hex}"
    outside = [str(target), f"/tmp/{name}", f"/etc/{name}", str(tmp_path / name)]
    code = f"""for path in {outside!r}:
    try:
        with open(path, 'w') as f:
            f.write('escaped')
        print('wrote', path)
    except OSError as err:
        print('denied', path, type(err).__name__)
"""
    try:
        result = contained(isolated, code)
        assert result.status == "ok", result
        assert target.read_text() == "original"
        for path in outside[1:]:
            assert not os.path.exists(path), f"the program wrote {path}"
    finally:
        for path in outside[1:]:
            Path(path).unlink(missing_ok=True)


def test_the_network_is_unreachable(isolated, contained):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""import socket
try:
    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()
    print('connected')
except OSError as err:
    print('failed', type(err).__name__)
"""
        result = contained(isolated, code)
        assert result.stdout.startswith("failed"), result
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_the_program_runs_as_nobody_without_privileges(isolated, contained):
    code = "import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n" \
           "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
    result = contained(isolated, code)
    assert result.stdout.split("\n")[:2] == ["65534 65534 65534 []", "0000000000000000"]


def test_without_isolation_one_warning_says_so(monkeypatch, caplog):
    monkeypatch.setattr(isolation_module, "_found", None)
    monkeypatch.setattr(isolation_module, "_warned", False)
    monkeypatch.setattr(isolation_module.os, "geteuid", lambda: 1000)
    trials: list[int] = []

    def trial() -> Execution:
        trials.append(1)
        raise AssertionError("no trial run without root")

    with caplog.at_level(logging.WARNING, logger="async_rl.sandbox"):
        first = isolation_module.detect(trial)
        second = isolation_module.detect(trial)
    assert first == second and not first.namespaces and trials == []
    assert first.label == "rlimits only (not isolated: not root)"
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NOT isolated" in warnings[0].getMessage()


def test_a_failed_trial_falls_back_and_names_why(monkeypatch):
    monkeypatch.setattr(isolation_module, "_found", None)
    monkeypatch.setattr(isolation_module, "_warned", True)
    monkeypatch.setattr(isolation_module.os, "geteuid", lambda: 0)
    failed = Execution("error", None, "", "sandbox setup failed: mount /tmp: Operation not permitted\n", 0.1, "trial")
    found = isolation_module.detect(lambda: failed)
    assert not found.namespaces
    assert found.label == "rlimits only (not isolated: namespaces unavailable: sandbox setup failed: " \
                          "mount /tmp: Operation not permitted)"


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "unisolated"])
def test_a_run_ends_when_the_process_that_started_it_dies(sandbox, isolate):
    if isolate and not sandbox.isolation.namespaces:
        pytest.skip(f"needs namespaces, and here: {sandbox.isolation.label}")
    marker = uuid.uuid4().hex
    # Reversed, so that only the run's shell, not the starter's command line, shows it;
    # then the run directory's name, which is the staging directory's.
    code = ("import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 1000; : ' + "
            f"{marker[::-1]!r}[::-1] + ' ' + os.path.basename(os.getcwd())])")
    script = (f"from async_rl.sandbox import LocalSandbox, SandboxLimits\n"
              f"LocalSandbox(SandboxLimits(timeout_s=60), isolate={isolate}).run({code!r})")
    starter = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    try:
        assert _wait_until(lambda: _with_marker(marker), 20), "the run never started"
        with open(f"/proc/{_with_marker(marker)[0]}/cmdline", "rb") as f:
            staging = os.path.join(tempfile.gettempdir(), f.read().split()[-1].strip(b"\0").decode())
    finally:
        starter.kill()
        starter.wait()
    # Bounds only spent when it fails: a loaded machine may take seconds to reap and remove.
    assert _wait_until(lambda: not _with_marker(marker), 30), f"left running: {_with_marker(marker)}"
    assert _wait_until(lambda: not os.path.exists(staging), 30), f"left behind: {staging}"


def _with_marker(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _wait_until(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_an_interpreter_in_a_virtual_environment_under_tmp_is_isolated_too(sandbox, tmp_path):
    """A venv under /tmp (as CI makes one) lies where the run's private /tmp is mounted:
    it is bound in after that mount, read-only, and the run is still isolated."""
    if not sandbox.isolation.namespaces:
        pytest.skip(f"needs namespaces, and here: {sandbox.isolation.label}")
    assert str(tmp_path).startswith(tempfile.gettempdir())
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True,
                   timeout=60)
    script = ("from async_rl.sandbox import LocalSandbox\n"
              "box = LocalSandbox()\n"
              "result = box.run('import sys\\nprint(sys.prefix)\\nopen(sys.prefix + \"/x\", \"w\")')\n"
              "print(box.isolation.label)\nprint(result.stdout.strip())\nprint(result.stderr.strip().splitlines()[-1])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    out = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True, text=True, timeout=60,
                         env=env)
    label, prefix, error = out.stdout.strip().splitlines()
    assert label == "namespaces+nobody" and prefix == str(venv)
    assert "Read-only file system" in error or "Permission denied" in error  # bound read-only
