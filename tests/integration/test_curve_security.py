"""CURVE on real sockets and processes: a hub that refuses every peer without the client
key, and an actor that cannot register saying why in one line."""
import socket
import subprocess
import sys

import pytest
import zmq
from conftest import running_coordinator, subprocess_env

from async_rl.wire import Hello, RejectCounter, Welcome, WireLimits, recv, send
from async_rl.wire.curve import make_keys, secure_client


@pytest.fixture
def curve_hub(tmp_path):
    keys = make_keys(tmp_path / "keys")
    config = {"train": {"batch_groups": 4, "group_size": 2}, "security": {"curve": True, "keys_dir": str(keys)}}
    with running_coordinator(tmp_path, config) as (coord, ctx, _):
        yield coord, ctx, keys


def test_curve_hub_admits_the_key_holder_and_refuses_everyone_else(curve_hub, tmp_path):
    coord, ctx, keys = curve_hub
    assert hello(ctx, coord.hub_addr, timeout_ms=1500) is None  # plain ZeroMQ peer: no handshake, no reply
    strangers = make_keys(tmp_path / "other")  # valid CURVE keys the hub does not know
    (strangers / "server.key").write_bytes((keys / "server.key").read_bytes())  # ... even with the hub's public key
    assert hello(ctx, coord.hub_addr, strangers, timeout_ms=1500) is None
    assert coord.live_actors == 0 and coord.rejects.total == 0  # nothing reached our code
    assert isinstance(hello(ctx, coord.hub_addr, keys), Welcome)
    assert coord.live_actors == 1


def test_actor_start_up_failures_are_one_line_with_the_likely_cause(curve_hub, tmp_path):
    """Real `async-rl actor` processes, started together: each exits 2 with one line."""
    coord, _, keys = curve_hub
    strangers = make_keys(tmp_path / "strangers")  # keys the hub does not know ...
    (strangers / "server.key").write_bytes((keys / "server.key").read_bytes())  # ... with the hub's public key
    other_run = make_keys(tmp_path / "other-run")  # another run's keys: the wrong server key
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    # An actor names the cause once its connect timeout has passed: 2 s where nothing
    # answers (the cause), long enough for a handshake to fail first, with seven actors
    # starting at once on a loaded machine, where the hub answers with a refusal.
    handshake = ["--connect-timeout", "10"]
    cases = {
        "bad address": (["--hub", "127.0.0.1:5555"], "--hub: expected tcp://HOST:PORT"),
        "bad port": (["--hub", "tcp://127.0.0.1:99999"], "--hub: port 99999 is outside 1-65535"),
        "no hub": (["--hub", closed], f"no hub answered at {closed} for 2s"),
        "no keys": (["--hub", coord.hub_addr, *handshake],
                    "refused the handshake: it probably requires CURVE (pass --keys DIR)"),
        "unknown key": (["--hub", coord.hub_addr, "--keys", str(strangers), *handshake],
                        "refused this actor's CURVE key"),
        "wrong server key": (["--hub", coord.hub_addr, "--keys", str(other_run), *handshake],
                             "holds another run's server key"),
        "no learner": (["--run-dir", str(tmp_path / "no-run")], "the learner's hub did not come up within 2s"),
    }
    procs = {name: subprocess.Popen([sys.executable, "-m", "async_rl.cli", "actor", "--connect-timeout", "2", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=60)
        lines = [line for line in err.splitlines() if line.startswith("async-rl")]
        assert proc.returncode == 2 and len(lines) == 1 and cases[name][1] in lines[0], (name, err[-2000:])
        assert "Traceback" not in err, (name, err[-2000:])
    assert coord.live_actors == 0


def hello(ctx, addr, keys_dir=None, timeout_ms=30_000):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        secure_client(sock, keys_dir)
    sock.connect(addr)
    send(sock, Hello(actor_name="t", pid=1, host="h"))
    try:
        return recv(sock, WireLimits(), RejectCounter(), routed=False)[1]
    except zmq.Again:
        return None
    finally:
        sock.close(0)
