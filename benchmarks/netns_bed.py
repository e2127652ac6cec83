"""A multi-node test bed on one machine: each "node" is its own Linux network namespace
with its own interface, address and routes, joined to the others through a bridge that
lives in a namespace of its own (nothing is added to the host's network). A node's link
can be taken down or rate-limited (tc tbf), as a cut cable or a slow link would be.

    with Bed(["learner0", "learner1", "actors"]) as bed:
        subprocess.run(bed.exec("actors", ["python", "client.py", bed.address("learner0")]))
        bed.set_link("actors", up=False)

Needs root and `ip` (iproute2); `Bed.unavailable()` says why a machine cannot host it.
Node k gets 10.77.0.(k+1)/24 on its `eth0`; every node also has its own loopback.
Traffic never leaves the bed's namespaces. The namespaces are removed on close, and
processes still running in them keep only their loopback.

    python benchmarks/netns_bed.py      # builds a 2-node bed, sends a byte across it, removes it
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import uuid

SUBNET = "10.77.0"


def _ip(*args: str, timeout: float = 10) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


CLONE_NEWNET = 0x40000000


def enter(namespace: str) -> None:
    """Move the calling thread (and the threads and processes it starts from now on)
    into a bed's network namespace, as `ip netns exec` does for a new process."""
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


class Bed:
    def __init__(self, nodes: list[str], tag: str | None = None):
        self.tag = tag or uuid.uuid4().hex[:6]
        self.nodes = list(nodes)
        self.switch = f"arl{self.tag}sw"
        self._namespaces: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot host a bed, or None when it can."""
        if sys.platform != "linux":
            return "network namespaces are Linux only"
        if shutil.which("ip") is None:
            return "`ip` (iproute2) is not installed"
        if os.geteuid() != 0:
            return "creating network namespaces needs root"
        probe = f"arlprobe{uuid.uuid4().hex[:6]}"
        try:
            _ip("netns", "add", probe)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            return f"this machine refuses network namespaces ({err})"
        try:
            _ip("netns", "del", probe)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        return None

    def namespace(self, node: str) -> str:
        return f"arl{self.tag}n{self.nodes.index(node)}"

    def address(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def _port(self, node: str) -> str:
        """The switch-side end of the node's veth pair (interface names: 15 characters at most)."""
        return f"arl{self.tag}p{self.nodes.index(node)}"

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._namespaces.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            ns, port = self.namespace(node), self._port(node)
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")

    def exec(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run inside the node's namespace (same file system, its own network)."""
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def set_link(self, node: str, up: bool) -> None:
        """Take the node's cable out (or put it back): its switch port goes down, so the
        node's own interface keeps its address, as a host whose network failed would."""
        _ip("-n", self.switch, "link", "set", self._port(node), "up" if up else "down")

    def set_rate(self, node: str, mbit: float | None, direction: str = "both") -> None:
        """Limit the node's link to `mbit` Mbit/s (tc tbf), or lift the limit: `direction`
        "in" limits what the node receives (tbf on the switch port), "out" what it sends
        (tbf on its eth0), "both" each way."""
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction must be in, out or both, not {direction!r}")
        ends = {"in": [(self.switch, self._port(node))], "out": [(self.namespace(node), "eth0")]}
        for ns, dev in ends["in"] + ends["out"] if direction == "both" else ends[direction]:
            base = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            subprocess.run([*base, "del", "dev", dev, "root"], capture_output=True, timeout=10)
            if mbit is None:
                continue
            burst = max(64_000, int(mbit * 1e6 / 8 / 250))  # 4 ms worth of bytes, at least 64 kB
            proc = subprocess.run([*base, "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                                   "latency", "100ms"], capture_output=True, text=True, timeout=10)
            if proc.returncode != 0:
                raise RuntimeError(f"tc tbf on {ns}/{dev}: {proc.stderr.strip()}")

    def listening(self, node: str) -> list[tuple[str, int, str]]:
        """(address, port, owning process's command line) of every listening TCP socket
        in the node's namespace."""
        proc = subprocess.run(self.exec(node, ["ss", "-ltnpH"]), capture_output=True, text=True, timeout=10)
        out = []
        for line in proc.stdout.splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            host, _, port = fields[3].rpartition(":")
            pid = re.search(r"pid=(\d+)", line)
            out.append((re.sub(r"^\[|\]$|%.*$", "", host), int(port), _command(int(pid.group(1))) if pid else "?"))
        return out

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._namespaces.clear()

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> int:
    reason = Bed.unavailable()
    if reason:
        print(f"netns_bed: {reason}", file=sys.stderr)
        return 2
    with Bed(["a", "b"]) as bed:
        server = subprocess.Popen(bed.exec("b", [sys.executable, "-c", _ECHO, bed.address("b")]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            subprocess.run(bed.exec("a", [sys.executable, "-c", _SEND, bed.address("b"), port]), check=True,
                           timeout=10)
            print(f"netns_bed: node a ({bed.address('a')}) reached node b ({bed.address('b')}:{port})")
        finally:
            server.kill()
    return 0


_ECHO = """import socket, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
s.settimeout(10); s.accept()[0].recv(1)"""
_SEND = """import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).sendall(b"x")"""


if __name__ == "__main__":
    sys.exit(main())
