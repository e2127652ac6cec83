"""The reward server process: `python -m async_rl.reward_server CONFIG --bind tcp://HOST:PORT
[--status FILE]`, started by `async-rl train` when a component has `placement: server`
(or by hand: `async-rl reward-server`).

It builds each such component's source on `reward_server.device` (rewards/components.py
`build_source`: a reward model, a process reward model, a judge on our torch engine),
stamps each with its weights' content hash (its version), then serves: a ROUTER socket
takes requests from every actor's reward workers, the Batcher groups their rows per
component, each batch is scored in one call of the source's `score_batch`, and a request
is answered once all its rows are. The status file, rewritten every HEARTBEAT_S from the
loop, says it is ready and alive (the launcher restarts a server whose file goes stale);
every LOG_EVERY_S its log gets a line of rows/s and batch sizes. SIGTERM or SIGINT ends
it cleanly after the batch in hand.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from async_rl.reward_server import protocol
from async_rl.reward_server.batcher import Batcher, Row
from async_rl.rewards.outcome import Failed, StepRewards, as_outcome, failure_note

log = logging.getLogger("async_rl.reward_server")
HEARTBEAT_S = 2.0
LOG_EVERY_S = 30.0
POLL_MS = 100


@dataclass
class Pending:
    """A request whose rows are being scored."""
    identity: bytes
    request: protocol.ScoreRequest
    values: list[float]
    steps: list
    failures: list[str]
    left: int
    expires: float  # the caller stops waiting (time.monotonic())
    batch: int = 0


@dataclass
class Stats:
    rows: int = 0
    batches: int = 0
    rejected: int = 0
    seconds: float = 0.0
    largest: int = 0
    since: float = field(default_factory=time.monotonic)


def server_components(cfg) -> list[dict]:
    """The config's components the server scores (placement: server), as dicts."""
    return [c.model_dump() for c in cfg.reward.components if c.placement == "server"]


class RewardServer:
    def __init__(self, sources: dict, versions: dict[str, str], bind: str, *, max_batch: int, max_tokens: int,
                 max_wait_s: float, status: Path | None = None) -> None:
        self.sources, self.versions, self.status = sources, versions, status
        self.batcher = Batcher(max_batch, max_tokens, max_wait_s)
        self.pending: dict[tuple[bytes, int], Pending] = {}
        self.stats = Stats()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES + 1024)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a caller that left: its answer is dropped
        self.socket.bind(bind)
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stopping = False
        self._beat = self._logged = 0.0

    def serve(self) -> None:
        try:
            while not self.stopping:
                now = time.monotonic()
                wait = self.batcher.wait_s(now)
                timeout = POLL_MS if wait is None else min(POLL_MS, int(wait * 1e3))
                if self.socket.poll(timeout, zmq.POLLIN):
                    self._take_requests()
                while not self.stopping and (batch := self.batcher.next_batch(time.monotonic())) is not None:
                    self._score(*batch)
                self._heartbeat()
        finally:
            self._heartbeat(last=True)  # the last figures, as it stops
            self.socket.close(0)
            self.context.term()

    def _take_requests(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.stats.rejected += 1
                continue
            identity, frame = frames
            try:
                request = protocol.decode_request(frame)
                if request.prompts and request.component not in self.sources:
                    raise protocol.BadRequest(f"no component {request.component!r} here (it scores "
                                              f"{sorted(self.sources)})", request.id)
            except protocol.BadRequest as err:
                self.stats.rejected += 1
                if err.request_id is not None:
                    self._send(identity, protocol.ScoreReply(err.request_id, [], [], [], "", error=str(err)))
                continue
            self._admit(identity, request)

    def _admit(self, identity: bytes, request: protocol.ScoreRequest) -> None:
        n = len(request.prompts)
        if n == 0:  # a ping
            self._send(identity, protocol.ScoreReply(request.id, [], [], [], json.dumps(self.versions)))
            return
        key = (identity, request.id)
        now = time.monotonic()
        self.pending[key] = Pending(identity, request, [0.0] * n, [None] * n, [""] * n, n, now + request.timeout_s)
        source = self.sources[request.component]
        rows = []
        for i, (prompt, response, answer) in enumerate(zip(request.prompts, request.responses, request.answers)):
            rows.append(Row(key, i, _tokens(source, prompt, response, answer), now, now + request.timeout_s))
        self.batcher.add(request.component, rows)

    def _score(self, component: str, rows: list[Row]) -> None:
        source = self.sources[component]
        live = [(self.pending[row.request], row.index) for row in rows if row.request in self.pending]
        started = time.perf_counter()
        try:
            outcomes = list(source.score_batch([p.request.prompts[i] for p, i in live],
                                               [p.request.responses[i] for p, i in live],
                                               [p.request.answers[i] for p, i in live]))
            if len(outcomes) != len(live):
                raise ValueError(f"returned {len(outcomes)} scores for {len(live)} rows")
        except Exception as err:  # noqa: BLE001 - the batch's rows fail, the server stays
            outcomes = [Failed("raised", f"raised {type(err).__name__}: {err}")] * len(live)
        self.stats.seconds += time.perf_counter() - started
        self.stats.rows, self.stats.batches = self.stats.rows + len(live), self.stats.batches + 1
        self.stats.largest = max(self.stats.largest, len(live))
        for (pending, i), outcome in zip(live, outcomes):
            _settle(pending, i, outcome)
            pending.batch = max(pending.batch, len(live))
            if pending.left == 0:
                del self.pending[(pending.identity, pending.request.id)]
                r = pending.request
                self._send(pending.identity, protocol.ScoreReply(r.id, pending.values, pending.steps, pending.failures,
                                                                 self.versions[r.component], pending.batch))

    def _send(self, identity: bytes, reply: protocol.ScoreReply) -> None:
        try:
            self.socket.send_multipart([identity, protocol.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:  # the caller has gone, or cannot take more: it stopped waiting
            pass

    def _heartbeat(self, last: bool = False) -> None:
        now = time.monotonic()
        if not last and now - self._beat < HEARTBEAT_S:
            return
        self._beat = now
        for key in [key for key, pending in self.pending.items() if pending.expires < now]:
            del self.pending[key]  # its caller stopped waiting: its rows are dropped as they come up
        if self.status is not None:
            write_status(self.status, {"pid": os.getpid(), "endpoint": self.endpoint, "versions": self.versions,
                                       "rows": self.stats.rows, "batches": self.stats.batches,
                                       "rejected": self.stats.rejected})
        if now - self._logged >= LOG_EVERY_S or last:
            if self._logged and self.stats.batches:
                s = self.stats
                log.info("%d rows in %d batches (mean %.1f, largest %d), %.1f rows/s while scoring; %d dropped "
                         "unscored (their callers had stopped waiting), %d requests refused", s.rows, s.batches,
                         s.rows / s.batches, s.largest, s.rows / max(s.seconds, 1e-9), self.batcher.dropped,
                         s.rejected)
            self._logged = now


def _tokens(source, prompt: str, response: str, answer: str) -> int:
    count = getattr(source, "count_tokens", None)
    return int(count(prompt, response, answer)) if count else (len(prompt) + len(response)) // 4 + 1


def _settle(pending: Pending, i: int, outcome) -> None:
    pending.left -= 1
    try:
        if isinstance(outcome, Exception):
            raise outcome if isinstance(outcome, Failed) else Failed("raised", f"raised {type(outcome).__name__}: "
                                                                                f"{outcome}")
        value = as_outcome(outcome)
    except Failed as failure:
        pending.failures[i] = f"{failure.reason}: {failure_note(failure)}"
        return
    if isinstance(value, StepRewards):
        pending.values[i], pending.steps[i] = value.value, [tuple(step) for step in value.steps]
    else:
        pending.values[i] = value


def write_status(path: Path, figures: dict) -> None:
    staging = path.with_name(path.name + ".partial")
    staging.write_text(json.dumps({**figures, "time": time.time()}))
    os.replace(staging, path)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from async_rl.config import ConfigError, load_config
    from async_rl.rewards.components import build_source
    from async_rl.rewards.reward_model import weights_version

    parser = argparse.ArgumentParser(prog="async-rl reward-server", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="where to listen (default: a free loopback port)")
    parser.add_argument("--status", help="a file rewritten every few seconds while the server is alive")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward-server %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"async-rl: reward-server: {err}", file=sys.stderr)
        return 2
    parts = server_components(cfg)
    if not parts:
        print("async-rl: reward-server: reward.components: no component has placement: server", file=sys.stderr)
        return 2
    stopping = []
    import torch

    torch.set_num_threads(cfg.reward_server.threads)
    sources, versions = {}, {}
    for part in parts:
        started = time.perf_counter()
        sources[part["name"]] = source = build_source(part, None, cfg.reward.timeout_s, device=cfg.reward_server.device)
        if hasattr(source, "batch_size"):  # the batcher decides the batch: one forward pass per batch
            source.batch_size = cfg.reward_server.max_batch
        versions[part["name"]] = weights_version(part["model"])
        log.info("component %s: %s %s on %s, version %s (%.1f s)", part["name"], part["reward"], part["model"],
                 cfg.reward_server.device, versions[part["name"]], time.perf_counter() - started)
    s = cfg.reward_server
    server = RewardServer(sources, versions, args.bind, max_batch=s.max_batch, max_tokens=s.max_tokens,
                          max_wait_s=s.max_wait_ms / 1e3, status=Path(args.status) if args.status else None)

    def stop(signum, _frame):
        stopping.append(signum)
        server.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    log.info("serving %s at %s (max_batch %d, max_tokens %d, max_wait_ms %g)", ", ".join(sources), server.endpoint,
             s.max_batch, s.max_tokens, s.max_wait_ms)
    server.serve()
    log.info("stopped (%s) after %d rows in %d batches", signal.Signals(stopping[0]).name if stopping else "end",
             server.stats.rows, server.stats.batches)
    return 128 + stopping[0] if stopping else 0
