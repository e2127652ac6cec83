"""Learner rank 0's end of vLLM's NCCL weight transfer (actors.engine=vllm).

Per membership epoch whose members all announced "vllm" (rendezvous.plan_epoch):
1. `reserve_port`: a listening socket on a free port of the store's host; the port
   goes to `vllm_port_key(epoch)` in our store *before* rank 0 writes "go", so every
   member finds it once released;
2. `open_group`: vLLM's trainer end (engines/vllm_weights.open_trainer_group: a
   StatelessProcessGroup hosting its store on that port, then a PyNcclCommunicator);
   it returns once every vLLM worker's `init_weight_transfer_engine` joined;
3. `send`: per version, the bucket set (already in vLLM's packed layout,
   plan.plan_packed) chunk by chunk with `group.broadcast(chunk, src=0)` on the
   broadcaster's side stream, then a bounded wait for the side stream.

Timeouts. PyNccl has none, and nothing in it can be interrupted. What is bounded:
the arrival/decision handshake (rendezvous.poll_store); the group's store rendezvous
(`store_timeout`, where this vLLM accepts it); the whole group formation (it runs in a
helper thread the caller stops waiting for after `timeout_s`: a member that died
between "go" and its NCCL init leaves that thread blocked in `ncclCommInitRank`
for the rest of the process, and the broadcaster moves on to the next epoch); the
host's wait for a broadcast (an event polled against a deadline). What is not: a
broadcast kernel whose peer died mid-transfer keeps its side stream busy for good
(no ncclCommAbort in vLLM's PyNccl), so later broadcasts on that stream time out
too until the learner restarts; and on the actor side, vLLM's `update_weights`
waits without a timeout for the chunks rank 0 never sends.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import torch


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


def open_group(sock: socket.socket, host: str, world_size: int, device: torch.device, timeout_s: float) -> Any:
    """vLLM's trainer group on `sock`'s port (rank 0 of `world_size`), or TimeoutError once
    `timeout_s` passed without every member joining (see the module docstring)."""
    from ..engines.vllm_weights import open_trainer_group  # imports vLLM: only when a vLLM member is there

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


def send(group: Any, tensors: list[torch.Tensor], *, wait_ready: Callable[[int], None],
         events: list[Any] | None, side_stream: Any, timeout_s: float) -> None:
    """Broadcast every packed chunk in order, each once `wait_ready(i)` says it is filled;
    on CUDA on `side_stream`, after the chunk's fill event, then wait (bounded) until the
    stream is done, so the set may be refilled. PyNccl broadcasts on the current stream."""
    if side_stream is None:
        for i, chunk in enumerate(tensors):
            wait_ready(i)
            group.broadcast(chunk, src=0)
        return
    with torch.cuda.stream(side_stream):
        for i, chunk in enumerate(tensors):
            wait_ready(i)
            if events is not None:
                side_stream.wait_event(events[i])  # the copy-in, not the whole learner stream
            group.broadcast(chunk, src=0)
        done = torch.cuda.Event()
        done.record(side_stream)
    wait_event(done, timeout_s)


def wait_event(event: Any, timeout_s: float) -> None:
    """Poll `event` until it completed, or raise TimeoutError (the work itself goes on)."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broadcast to the vLLM actors did not finish within {timeout_s:.0f}s "
                               "(a member died mid-transfer? PyNccl cannot abort it)")
        time.sleep(0.001)
