"""The coordinator's sockets, served by one thread.

A ROUTER socket takes the actors' requests (one reply each; the timeline spans that
come with their heartbeats get none) and a PULL socket their experience. Both bind on
transport.host, with CURVE when security.curve is set. Every message is validated by
the wire layer before the handler sees it: an invalid one is counted and dropped.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from async_rl.config import Config
from async_rl.wire import RejectCounter, WireLimits, read_frames, send
from async_rl.wire.curve import CurveServer

log = logging.getLogger("async_rl.coordinator")


class Handler(Protocol):
    """What the hub calls, one message at a time, with its lock held."""

    @property
    def live_actors(self) -> int: ...

    def on_request(self, identity: bytes, fd: int, msg) -> object | None:
        """A valid request that came through connection `fd`; returns the reply, if any."""

    def on_experience(self, msg) -> None: ...

    def on_rejected_group(self, frames) -> None:
        """An experience message the wire layer refused (its frames, for the header's claim)."""

    def on_disconnect(self, fd: int) -> None:
        """Connection `fd` closed: the kernel closes a killed process's sockets."""

    def on_tick(self) -> None:
        """After each poll, at least every 50 ms."""


class Hub:
    def __init__(self, cfg: Config, rejects: RejectCounter, lock: threading.Lock):
        """`lock`: held while a message is handled, so its owner sees the state between messages."""
        self.cfg, self.rejects, self.lock = cfg, rejects, lock
        self.request_addr = self.experience_addr = ""
        self._handler: Handler | None = None
        self._limits: WireLimits | None = None
        self._stopping = threading.Event()
        self._drain_s = 3.0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    def start(self, handler: Handler, limits: WireLimits) -> None:
        """Bind both sockets (the addresses are set on return) and serve them."""
        self._handler, self._limits = handler, limits
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("coordinator failed to bind its sockets")

    def stop(self, drain_s: float) -> None:
        """Serve until every actor has left, or for `drain_s` at most, then close."""
        self._drain_s = drain_s
        self._stopping.set()
        self._thread.join(timeout=drain_s + 10)

    def _bind(self, ctx: zmq.Context, kind: int, port: int, curve) -> tuple[zmq.Socket, str]:
        sock = ctx.socket(kind)
        if curve is not None:
            curve.secure(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.transport.hwm if kind == zmq.PULL else 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sock.setsockopt(zmq.SNDTIMEO, int(self.cfg.transport.timeout_s * 1000))
        host = self.cfg.transport.host
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        return sock, f"tcp://{host}:{port}"

    def _run(self) -> None:
        handler = self._handler
        ctx = zmq.Context()
        curve = CurveServer(ctx, self.cfg.security.keys_dir) if self.cfg.security.curve else None
        hub, self.request_addr = self._bind(ctx, zmq.ROUTER, self.cfg.transport.hub_port, curve)
        hub.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A closed connection names its file descriptor: the actor whose requests came
        # through it is reaped at once, not after actors.heartbeat_timeout_s.
        # (ROUTER_NOTIFY, which would name the peer, is a draft API that pyzmq's libzmq
        # is not built with.)
        disconnects = hub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pull, self.experience_addr = self._bind(ctx, zmq.PULL, self.cfg.transport.experience_port, curve)
        self._ready.set()
        poller = zmq.Poller()
        poller.register(hub, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        poller.register(disconnects, zmq.POLLIN)
        stop_deadline = None
        try:
            while True:
                if self._stopping.is_set():
                    stop_deadline = stop_deadline or time.monotonic() + self._drain_s
                    if not handler.live_actors:
                        break
                    if time.monotonic() > stop_deadline:
                        log.warning("closing with %d actor(s) that did not say goodbye within %gs: their last "
                                    "timeline spans are lost", handler.live_actors, self._drain_s)
                        break
                events = dict(poller.poll(50))
                with self.lock:
                    if hub in events:
                        for identity, fd, msg in self._drain(hub, routed=True, most=64):
                            reply = handler.on_request(identity, fd, msg)
                            if reply is not None:
                                self._reply(hub, identity, reply)
                    if disconnects in events:
                        while disconnects.poll(0):
                            handler.on_disconnect(recv_monitor_message(disconnects)["value"])
                    if pull in events:
                        for _, _, msg in self._drain(pull, routed=False, most=256, on_reject=handler.on_rejected_group):
                            handler.on_experience(msg)
                    handler.on_tick()
        finally:
            hub.disable_monitor()
            disconnects.close(0)
            hub.close(0)
            pull.close(0)
            if curve is not None:
                curve.stop()
            ctx.term()

    def _drain(self, sock: zmq.Socket, *, routed: bool, most: int, on_reject=None):
        """Up to `most` valid messages already queued, as (identity, connection fd, message);
        invalid ones are counted by read_frames."""
        for _ in range(most):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            fd = parts[0].get(zmq.SRCFD) if routed else -1
            identity, msg = read_frames(parts, self._limits, self.rejects, routed=routed, on_reject=on_reject)
            if msg is not None:
                yield identity, fd, msg

    def _reply(self, hub: zmq.Socket, identity: bytes, msg) -> None:
        try:
            send(hub, msg, identity=identity)
        except zmq.ZMQError as err:  # peer vanished (ROUTER_MANDATORY) or queue full
            log.warning("could not reply to an actor: %s", err)
