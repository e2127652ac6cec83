"""Hostile programs through the `code_tests` reward in a real run: each call of the run's
reward (in its worker process, as every reward runs) scores the next program of a list
(fork bomb, memory hog, endless loop, sleep, reading and writing outside its directory,
a socket, 100 MB of output, a daemon that outlives its parent, killing its parent,
os.system) with `code_tests` in the local sandbox, as it would score a policy's code.
The run goes on to its last step; calls past reward.timeout_s are counted and left out
of the loss; nothing is written outside; no sandboxed process is left."""
import json
import os
import time
import uuid
from pathlib import Path

from conftest import read_metrics, train

from async_rl.sandbox import LocalSandbox
from async_rl.sandbox.local import RUN_TAG

PROGRAMS = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory_hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))",
    "endless_loop": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(1000)",
    "read_outside": "try:\n    SECRET = open({secret!r}).read()\nexcept OSError:\n    SECRET = None",
    "write_outside": "try:\n    open({canary!r}, 'w').write('escaped')\nexcept OSError:\n    pass",
    "socket": ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    NET = True\n"
               "except OSError:\n    NET = False"),
    "output_flood": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))",
    "daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(1000)\n    os._exit(0)"),
    "kill_parent": "import os, time\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\ntime.sleep(1000)",
    "os_system": "import os\nos.system('sleep 1000')",
}
# What each program's test asserts: passing means the hostile act was contained.
TESTS = {"read_outside": "assert SECRET is None", "socket": "assert not NET"}

REWARD = '''import fcntl
import json
from pathlib import Path

from async_rl.tasks.code_rewards import code_tests

PROGRAMS = {programs!r}
TESTS = {tests!r}
STATE = Path({state!r})


def score(prompt, response, answer):
    """The next hostile program, scored by code_tests in place of the response's code."""
    with open(str(STATE) + ".lock", "w") as lock:  # the reward's workers take turns at the list
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = json.loads(STATE.read_text()) if STATE.exists() else []
        name = list(PROGRAMS)[len(done) % len(PROGRAMS)]
        STATE.write_text(json.dumps(done + [name]))  # before the run: a call killed at its deadline counts too
    code = PROGRAMS[name] + "\\n\\ndef f():\\n    return 1\\n"
    value = code_tests(prompt, f"```python\\n{{code}}\\n```", answer, tests=[TESTS.get(name, "assert f() == 1")])
    with open(str(STATE) + ".scored", "a") as log:  # one short append: whole lines
        log.write(json.dumps([name, value]) + "\\n")
    return value
'''


def sandboxed_processes() -> list[int]:
    """Live processes of any sandbox run (each carries RUN_TAG in its environment)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if any(item.startswith(RUN_TAG.encode() + b"=") for item in f.read().split(b"\0")):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_hostile_programs_in_a_run_are_contained_counted_and_the_run_goes_on(tmp_path, demo_model):
    secret, canary, state = tmp_path / "secret.txt", Path(f"/tmp/escaped-{uuid.uuid4().hex}"), tmp_path / "calls.json"
    secret.write_text("SECRET")
    secret.chmod(0o600)
    programs = {name: code.format(secret=str(secret), canary=str(canary)) for name, code in PROGRAMS.items()}
    isolated = LocalSandbox().isolation.namespaces
    if not isolated and os.geteuid() == 0:
        programs.pop("fork_bomb")  # RLIMIT_NPROC does not bind root: without namespaces it would run as root
    reward = tmp_path / "hostile.py"
    reward.write_text(REWARD.format(programs=programs, tests=TESTS, state=str(state)))
    run = tmp_path / "run"
    try:
        train(run, demo_model, "train.max_steps=2", "train.batch_groups=2", "train.group_size=2",
              "actors.groups_per_request=2", "eval.every=0", "task.eval_size=2", "eval.size=2",
              f"task.reward={reward}:score", "reward.workers=2", "reward.timeout_s=2", "reward.max_error_frac=1.0",
              timeout=240)
        steps, evals = read_metrics(run)
        assert [s["step"] for s in steps] == [1, 2]
        called = json.loads(state.read_text())
        assert set(called) == set(programs)  # every program ran at least once
        timeouts = sum(s.get("reward/errors_timeout", 0) for s in steps + evals)
        assert timeouts > 0 and any(s["reward/unscorable_frac"] > 0 for s in steps)
        scored: dict[str, list[float]] = {}
        for line in Path(str(state) + ".scored").read_text().splitlines():
            name, score = json.loads(line)
            scored.setdefault(name, []).append(score)
        for name in ("memory_hog", "output_flood", "endless_loop"):  # stopped by a limit: no test passes, ever
            assert max(scored.get(name, [0.0])) == 0.0, (name, scored)
        if isolated:  # without namespaces the program runs as this user, reads and writes as it does
            # They finish, contained: at least once (a call may also meet reward.timeout_s on a loaded machine).
            for name in ("read_outside", "socket", "write_outside", "daemon"):
                assert max(scored.get(name, [0.0])) == 1.0, (name, scored)
            assert not canary.exists()
        for _ in range(100):  # the last killed call's processes may take a moment to go
            if not sandboxed_processes():
                break
            time.sleep(0.1)
        assert sandboxed_processes() == []
    finally:
        canary.unlink(missing_ok=True)
