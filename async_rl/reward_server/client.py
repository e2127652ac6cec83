"""A component scored by the reward server (`placement: server`), as the reward's
workers call it: `score_batch(prompts, responses, answers)` sends the rows in one
request and waits for their scores within the call's deadline.

The DEALER socket is made on first use (each worker process has its own) with
ZMQ_IMMEDIATE, so nothing queues for a server that is not there: a server that cannot be
reached within CONNECT_WAIT_S, or does not answer by the deadline, fails the rows
(unscorable, `raised` or `timeout`), never scores them 0. A reply's version is the
model that scored it: the first, and any change, get a line in the actor's log.
"""
from __future__ import annotations

import itertools
import sys
import time

import zmq

from async_rl.reward_server import protocol
from async_rl.rewards.outcome import Failed, StepRewards

CONNECT_WAIT_S = 2.0


class ServerScorer:
    def __init__(self, endpoint: str, component: str, timeout_s: float) -> None:
        self.endpoint, self.component, self.timeout_s = endpoint, component, timeout_s
        self.socket: zmq.Socket | None = None
        self.version: str | None = None
        self.ids = itertools.count(1)

    def _connect(self) -> zmq.Socket:
        if self.socket is None:
            self.socket = zmq.Context.instance().socket(zmq.DEALER)
            self.socket.setsockopt(zmq.IMMEDIATE, 1)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES + 1024)
            self.socket.connect(self.endpoint)
        return self.socket

    def _drop_socket(self) -> None:
        """After a request went unanswered: its late answer must not meet the next one."""
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None

    def __call__(self, prompt: str, response: str, answer: str, **fields):
        outcome = self.score_batch([prompt], [response], [answer])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def score_batch(self, prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list:
        """Per row: a float, StepRewards, or the Failed that says why it has none."""
        answers = answers if answers is not None else [""] * len(prompts)
        reply = self.ask(prompts, responses, answers)
        if reply.error:
            raise Failed("raised", f"reward server at {self.endpoint} refused the request: {reply.error}")
        if len(reply.values) != len(prompts):
            raise Failed("raised", f"reward server at {self.endpoint} answered {len(reply.values)} scores "
                                   f"for {len(prompts)} rows")
        self._note_version(reply.version)
        out: list = []
        for value, steps, failure in zip(reply.values, reply.steps, reply.failures):
            if failure:
                reason, _, note = failure.partition(": ")
                out.append(Failed(reason if reason in ("raised", "timeout", "non_finite", "not_a_number")
                                  else "raised", f"reward server: {note or failure}"))
            elif steps is not None:
                out.append(StepRewards([tuple(step) for step in steps], value))
            else:
                out.append(value)
        return out

    def ask(self, prompts: list[str], responses: list[str], answers: list[str]) -> protocol.ScoreReply:
        """The server's reply to these rows (none: a ping); Failed when there is none in time."""
        deadline = time.monotonic() + self.timeout_s
        socket = self._connect()
        request_id = next(self.ids)
        frame = protocol.encode(protocol.ScoreRequest(request_id, self.component, prompts, responses, answers,
                                                      self.timeout_s))
        if not socket.poll(int(1e3 * min(CONNECT_WAIT_S, max(0.0, deadline - time.monotonic()))), zmq.POLLOUT):
            self._drop_socket()
            raise Failed("raised", f"reward server at {self.endpoint} unreachable (no connection within "
                                   f"{CONNECT_WAIT_S:g} s)")
        socket.send(frame, zmq.NOBLOCK)
        while (remaining := deadline - time.monotonic()) > 0:
            if not socket.poll(int(remaining * 1e3) + 1, zmq.POLLIN):
                break
            try:
                reply = protocol.decode_reply(socket.recv(zmq.NOBLOCK))
            except (zmq.Again, ValueError):
                continue  # an answer that cannot be read is no answer
            if reply.id == request_id:
                return reply
        self._drop_socket()
        raise Failed("timeout", f"reward server at {self.endpoint}: no answer within {self.timeout_s:.1f} s")

    def _note_version(self, version: str) -> None:
        if version != self.version:
            change = f" (it was {self.version})" if self.version else ""
            # One write: the actor's reward workers share its log.
            sys.stderr.write(f"reward {self.component}: scored by the reward server at {self.endpoint}, version "
                             f"{version}{change}\n")
            sys.stderr.flush()
            self.version = version


def wait_until_serving(endpoint: str, timeout_s: float) -> dict[str, str]:
    """The server's component versions once it answers a ping (it may still be loading its
    models when an actor starts); RuntimeError after `timeout_s`."""
    import json

    deadline = time.monotonic() + timeout_s
    pinger = ServerScorer(endpoint, "", timeout_s=min(5.0, timeout_s))
    while True:
        try:
            return json.loads(pinger.ask([], [], []).version)
        except Failed:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reward server at {endpoint} did not answer within {timeout_s:g} s "
                                   f"(reward_server.start_timeout_s)") from None
            time.sleep(0.2)
        finally:
            pinger._drop_socket()
