"""The launcher's side of the reward server, on real processes: a server whose heartbeat
went stale is killed, one that exited is restarted until reward_server.max_restarts,
each with one line."""
import os
import subprocess
import sys
import time

from async_rl.config import build_config, to_yaml
from async_rl.reward_server.config import RewardServerConfig
from async_rl.reward_server.process import ServerProcess


def server_process(tmp_path, **section) -> ServerProcess:
    (tmp_path / "logs").mkdir(exist_ok=True)
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(build_config({})))  # no placement: server component: a server started on it exits 2
    return ServerProcess(RewardServerConfig(**section), config, tmp_path, dict(os.environ))


def test_a_server_whose_heartbeat_went_stale_is_killed_and_given_up_after_its_restarts(tmp_path):
    server = server_process(tmp_path, max_restarts=0, heartbeat_timeout_s=5)
    server.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    server.started = time.monotonic()
    server.status.write_text("{}")
    old = time.time() - 60
    os.utime(server.status, (old, old))
    said = []
    server.watch(said.append)
    assert server.proc.poll() is not None  # killed
    assert len(said) == 1 and "stopped answering (no heartbeat for 5 s): killed; not restarting it" in said[0]
    server.watch(said.append)
    assert len(said) == 1  # said once


def test_a_server_that_exits_is_restarted_until_max_restarts(tmp_path):
    server = server_process(tmp_path, max_restarts=1)
    server.start()
    said = []
    deadline = time.monotonic() + 60
    while len(said) < 2 and time.monotonic() < deadline:
        server.watch(said.append)
        time.sleep(0.05)
    assert said[0].startswith("the reward server exited with status 2; restarting it (1 of "
                              "reward_server.max_restarts=1")
    assert "exited with status 2; not restarting it" in said[1]
    assert "placement: server" in server.log.read_text()  # why, in its log
