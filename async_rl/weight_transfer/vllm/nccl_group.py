"""Learner rank 0's NCCL group with vLLM actors on GPUs (the GPU communicator of the
vLLM transport, transport.py).

A vLLM worker cannot join the groups groups.py builds: vLLM's NCCL weight transfer
forms a `StatelessProcessGroup` whose rank 0 (the trainer) *hosts* a TCPStore at
`master_port`, then a `PyNcclCommunicator` (NCCL only, no timeout, no abort). So rank
0 reserves a free port of the store's host before "go" (its decision names it in
`Group.port`), and forms vLLM's trainer end on it after "go".

Timeouts. What is bounded: the store rendezvous (`store_timeout`); the whole group
formation (it runs in a helper thread that rank 0 stops waiting for after `timeout_s`:
a member that died between "go" and its NCCL init leaves that thread blocked in
`ncclCommInitRank` for the rest of the process, and the sender moves on to the
next epoch); the host's wait for a broadcast (an event polled against a deadline).
What is not: a broadcast kernel whose peer died mid-transfer keeps its side stream
busy for good (no ncclCommAbort in vLLM's PyNccl), so later broadcasts on that stream
time out too until the learner restarts; and on the actor side, vLLM's
`update_weights` waits without a timeout for the chunks rank 0 never sends.

Not yet run: it needs a GPU for the learner and another for each vLLM actor.
"""
from __future__ import annotations

import math
import socket
import threading
import time
from typing import Any

import torch

from async_rl.weight_transfer.buckets import BucketSet
from async_rl.weight_transfer.vllm.api import require_vllm, supported_kwargs


def reserve_port(host: str) -> socket.socket:
    """A listening TCP socket on a free port of `host` (`getsockname()[1]`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def open_trainer_group(host: str, port: int, world_size: int, device: torch.device, *,
                       timeout_s: float | None = None, listen_socket: socket.socket | None = None) -> Any:
    """vLLM's recommended trainer end of the group (rank 0 of a `StatelessProcessGroup`
    hosting its store at `port`, then a `PyNcclCommunicator`). Broadcast packed chunks
    with `group.broadcast(chunk, src=0)`. `timeout_s` bounds the store rendezvous
    (`store_timeout`); NCCL's own init has no timeout. `listen_socket` (bound to `port`,
    listening) is handed over where this vLLM accepts one, which closes the gap in which
    another process could take the port; else it is closed first."""
    require_vllm()
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    wanted: dict[str, Any] = {} if timeout_s is None else {"store_timeout": max(1, math.ceil(timeout_s))}
    if listen_socket is not None:
        wanted["listen_socket"] = listen_socket
    extra = supported_kwargs(StatelessProcessGroup.create, wanted)
    if listen_socket is not None and "listen_socket" not in extra:
        listen_socket.close()  # this vLLM binds the port itself
    pg = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world_size, **extra)
    return PyNcclCommunicator(pg, device=device)


def open_group(sock: socket.socket, host: str, world_size: int, device: torch.device, timeout_s: float) -> Any:
    """The trainer group on `sock`'s port (rank 0 of `world_size`), or TimeoutError once
    `timeout_s` passed without every member joining (see the module docstring)."""
    port = sock.getsockname()[1]
    result: dict[str, Any] = {}

    def form() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            result["group"] = open_trainer_group(host, port, world_size, device, timeout_s=timeout_s,
                                                 listen_socket=sock)
        except BaseException as err:  # handed to the caller
            sock.close()  # a no-op once vLLM's store took the descriptor over
            result["error"] = err

    thread = threading.Thread(target=form, name="vllm-trainer-group", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"vLLM's weight-transfer group (world {world_size}, port {port}) did not form within "
                           f"{timeout_s:.0f}s; its NCCL init cannot be interrupted and is left behind")
    if "error" in result:
        raise result["error"]
    return result["group"]


def wait_event(event: Any, timeout_s: float) -> None:
    """Poll `event` until it completed, or raise TimeoutError (the work itself goes on)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broadcast to the vLLM actors did not finish within {timeout_s:.0f}s "
                               "(a member died mid-transfer? PyNccl cannot abort it)")
        time.sleep(0.001)


def send_packed(group: Any, source: BucketSet, stream: Any, timeout_s: float) -> None:
    """Every packed chunk in order, each once filled, on the side stream after the
    chunk's fill event, then an all-reduce of one word that completes once every worker
    has every chunk (groups.all_arrived), then a bounded wait until the stream is done,
    so the set may be refilled. PyNccl broadcasts on the current stream."""
    with torch.cuda.stream(stream):
        for i, chunk in enumerate(source.tensors):
            source.wait_ready(i)
            if source.events is not None:
                stream.wait_event(source.events[i])  # the copy-in, not the whole learner stream
            group.broadcast(chunk, src=0)
        group.all_reduce(torch.zeros(1, dtype=torch.int32, device=chunk.device))  # every member's word: all arrived
        done = torch.cuda.Event()
        done.record(stream)
    wait_event(done, timeout_s)
