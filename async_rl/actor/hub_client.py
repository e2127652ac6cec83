"""An actor's connection to the hub: one DEALER socket with a timeout on every operation,
and registration that survives a hub not up yet and says in one line why it failed."""
from __future__ import annotations

import logging
import os
import re
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from async_rl.wire import Hello, RejectCounter, Welcome, WireLimits, recv, send
from async_rl.wire.curve import secure_client

log = logging.getLogger("async_rl.actor")
HUB_ADDRESS = re.compile(r"tcp://[^\s:/]+:\d{1,5}")


class ConnectError(RuntimeError):
    """The actor could not register with the hub; the message is one line for the user."""


class HubClient:
    """One DEALER socket to the hub with timeouts on every operation."""

    def __init__(self, ctx: zmq.Context, hub_addr: str, timeout_s: float, keys_dir: str | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        # A fixed, unguessable routing id: the hub accepts requests only from the socket
        # that registered, and an id of our own survives reconnects.
        self.sock.setsockopt(zmq.ROUTING_ID, os.urandom(16).hex().encode())  # ids starting with 0 are reserved
        if keys_dir:
            secure_client(self.sock, keys_dir)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_CONNECTED)
        self.sock.connect(hub_addr)
        self.limits, self.rejects = WireLimits(), RejectCounter()

    def request(self, msg):
        send(self.sock, msg)
        return self.receive()

    def receive(self):
        while True:
            try:
                _, reply = recv(self.sock, self.limits, self.rejects, routed=False)
            except zmq.Again:
                raise TimeoutError("the hub did not answer in time") from None
            if reply is not None:
                return reply

    def connection_events(self) -> set[int]:
        """The connection events seen so far (handshake failures, connects)."""
        seen = set()
        while self.monitor.poll(0):
            seen.add(recv_monitor_message(self.monitor)["event"])
        return seen

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket and its monitor (an open monitor would hold up ctx.term())."""
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(linger=linger_ms)


def check_hub_address(hub_addr: str) -> None:
    if not HUB_ADDRESS.fullmatch(hub_addr):
        raise ConnectError(f"--hub: expected tcp://HOST:PORT (RUN_DIR/endpoints.json: hub), got {hub_addr!r}")
    port = int(hub_addr.rsplit(":", 1)[1])
    if not 1 <= port <= 65535:  # zmq would retry such an address until the connect timeout
        raise ConnectError(f"--hub: port {port} is outside 1-65535 in {hub_addr!r}")


def _why(events: set[int], hub_addr: str, keys_dir: str | None, waited_s: float) -> str:
    if zmq.EVENT_HANDSHAKE_FAILED_AUTH in events:
        return (f"the hub at {hub_addr} refused this actor's CURVE key: --keys must be a copy of the run's "
                "`async-rl keys` directory")
    if events & {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}:
        if keys_dir:
            return (f"the CURVE handshake with {hub_addr} failed: the hub does not use CURVE, or --keys "
                    f"{keys_dir} holds another run's server key")
        return f"the hub at {hub_addr} refused the handshake: it probably requires CURVE (pass --keys DIR)"
    if zmq.EVENT_CONNECTED in events:
        return f"the hub at {hub_addr} accepted the connection but did not answer for {waited_s:.0f}s"
    return (f"no hub answered at {hub_addr} for {waited_s:.0f}s: is the learner running, and is this the "
            f"address in its RUN_DIR/endpoints.json?")


def register(ctx: zmq.Context, hub_addr: str, name: str, keys_dir: str | None,
             connect_timeout_s: float) -> tuple[HubClient, Welcome]:
    """Say hello until the hub welcomes us, retrying with backoff for `connect_timeout_s`
    (a hub still loading its model); ConnectError with the likely cause otherwise. Each
    try has a socket of its own: a hello queued on a dead try must not register later."""
    check_hub_address(hub_addr)
    started, attempt_s, events = time.monotonic(), 2.0, set()
    hello = Hello(actor_name=name, pid=os.getpid(), host=socket.gethostname())
    while True:
        remaining = connect_timeout_s - (time.monotonic() - started)
        client = HubClient(ctx, hub_addr, timeout_s=max(0.1, min(attempt_s, remaining)), keys_dir=keys_dir)
        try:
            welcome = client.request(hello)
        except TimeoutError:
            events |= client.connection_events()
            client.close()
            if time.monotonic() - started >= connect_timeout_s:
                raise ConnectError(_why(events, hub_addr, keys_dir, time.monotonic() - started)) from None
            log.info("no answer from the hub at %s yet; trying again", hub_addr)
            attempt_s = min(attempt_s * 2, 15.0)
            continue
        if not isinstance(welcome, Welcome):
            client.close()
            raise ConnectError(f"the hub at {hub_addr} refused registration: {welcome}")
        client.connection_events()  # drained; the monitor stays quiet from here on
        return client, welcome
