"""Forming a weight-sync group for one membership epoch, through rank 0's TCPStore.

Every member writes `arrived/{epoch}/{rank}` = how it will receive ("collective" for
a gloo/NCCL broadcast, "cuda_ipc" for a copy from the learner's mapped buckets,
"vllm <workers> <layout>" for a vLLM engine's weight-transfer API); rank 0 then writes
`decision/{epoch}` = "abandon", or "go" followed by the ranks that take part in the
collective. Those ranks, renumbered 1..k in that order, form the epoch's process group
with rank 0; CUDA-IPC members take no part in it (NCCL refuses two ranks on one GPU,
which is exactly their situation). For vLLM members the group is vLLM's own (a
StatelessProcessGroup + PyNcclCommunicator whose store rank 0 hosts on a fresh port,
written to `vllm_port_key(epoch)` *before* "go"); an epoch is either all vLLM or all
torch receivers (`plan_epoch`): a run uses one `actors.engine` for every actor.
"""
from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE, CUDA_IPC, VLLM = "collective", "cuda_ipc", "vllm"
_LAYOUT = re.compile(r"[0-9a-f]{1,64}")


class SyncAbandoned(RuntimeError):
    """Rank 0 gave up on an epoch before its group formed (membership changed, or a
    member never came); the parameters are untouched."""


@dataclass(frozen=True)
class SyncJob:
    epoch: int
    version: int
    members: tuple[int, ...]  # actor ids; actor k has rank members.index(k) + 1 in the epoch

    def rank_of(self, actor_id: int) -> int:
        return self.members.index(actor_id) + 1


def describe(err: BaseException) -> str:
    """One short log line for a failed sync: gloo's messages open with a source location
    and end with a paragraph of advice."""
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]


class EpochRejected(ValueError):
    """Rank 0 cannot serve the members as they announced themselves (engines mixed, or
    a vLLM member whose wire layout differs from the learner's); it abandons the epoch."""


@dataclass(frozen=True)
class EpochPlan:
    """Who receives how in one epoch, as rank 0 decided it from the arrivals."""
    collective: tuple[int, ...] = ()  # torch receivers in our gloo/NCCL group
    ipc: tuple[int, ...] = ()  # torch receivers copying over CUDA IPC
    vllm: tuple[int, ...] = ()  # vLLM engines, in vLLM's trainer group
    vllm_world: int = 0  # that group's NCCL world: the trainer and every vLLM worker

    def decision(self) -> str:
        return encode_go(list(self.vllm or self.collective))


def vllm_arrival(workers: int, layout: str) -> str:
    """A vLLM member's arrival: its workers per engine (NCCL ranks) and wire layout id."""
    return f"{VLLM} {int(workers)} {layout}"


def plan_epoch(arrivals: dict[int, str], *, engine: str, layout: str | None = None) -> EpochPlan:
    """Rank 0's decision from every member's arrival value (network input: strict).
    `engine` is the run's actors.engine, which fixed the learner's bucket layout;
    `layout` the learner's packed layout id (engine "vllm")."""
    collective, ipc, vllm, workers, layouts = [], [], [], set(), {}
    for rank in sorted(arrivals):
        words = arrivals[rank].split()
        if words == [COLLECTIVE]:
            collective.append(rank)
        elif words == [CUDA_IPC]:
            ipc.append(rank)
        elif len(words) == 3 and words[0] == VLLM and words[1].isdigit() and int(words[1]) >= 1 \
                and _LAYOUT.fullmatch(words[2]):
            vllm.append(rank)
            workers.add(int(words[1]))
            layouts[rank] = words[2]
        else:
            raise EpochRejected(f"rank {rank} announced itself as {arrivals[rank][:40]!r}")
    torch_ranks = sorted(collective + ipc)
    if engine == "vllm" and torch_ranks:
        raise EpochRejected(f"rank(s) {torch_ranks} run the torch engine, but this learner sends vLLM's packed "
                            "layout (actors.engine=vllm); one run uses one engine for all actors")
    if engine != "vllm" and vllm:
        raise EpochRejected(f"rank(s) {vllm} run vLLM, but this learner was built for actors.engine={engine} "
                            "(WeightBroadcaster(engine=...)); one run uses one engine for all actors")
    for rank, theirs in layouts.items():
        if theirs != layout:
            raise EpochRejected(f"rank {rank}'s vLLM wire layout {theirs} differs from the learner's {layout}: "
                                "learner and actors need the same model architecture, sync.bucket_mb and sync dtype")
    if len(workers) > 1:
        raise EpochRejected(f"the vLLM members differ in workers per engine {sorted(workers)}")
    world = 1 + len(vllm) * workers.pop() if vllm else 0
    return EpochPlan(tuple(collective), tuple(ipc), tuple(vllm), world)


def vllm_port_key(epoch: int) -> str:
    """Key in the learner's TCPStore holding the port of vLLM's rendezvous for `epoch`."""
    return f"vllm/{epoch}/port"


def arrived_key(epoch: int, rank: int) -> str:
    return f"arrived/{epoch}/{rank}"


def decision_key(epoch: int) -> str:
    return f"decision/{epoch}"


def encode_go(collective_ranks: list[int]) -> str:
    return " ".join(["go", *map(str, collective_ranks)])


def parse_decision(value: bytes) -> list[int] | None:
    """The collective ranks of a "go", None for "abandon"; strict, it is network input."""
    words = value.decode("ascii", errors="replace").split()
    if not words or words[0] != "go":
        return None
    if not all(w.isdigit() for w in words[1:]):
        raise ValueError(f"malformed sync decision {value[:80]!r}")
    return [int(w) for w in words[1:]]


def poll_store(store: dist.Store, keys: list[str], timeout_s: float, give_up=lambda: False) -> bool:
    """Wait until all `keys` exist; False if `give_up()` turns true first. Polled rather
    than `store.wait`, which cannot be interrupted and logs a warning on timeout."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if give_up():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all of {len(keys)} store key(s) appeared within {timeout_s:.0f}s")
        time.sleep(0.02)
    return True


def new_group(backend: str, store: dist.Store, epoch: int, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group outside the default (torchrun) world, one per membership epoch."""
    prefixed = dist.PrefixStore(f"sync/{epoch}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options._timeout = timeout  # the watchdog aborts a collective stuck on a dead peer
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    broadcast_async(group, tensor).wait()


def wait_all(works: list[dist.Work], timeout_s: float) -> None:
    """Block the host until the last collective is done, or raise after `timeout_s`.
    A CUDA work's plain wait() only orders the current stream after it; the host must
    know the buckets are free (double buffering) and that the parameters are complete.
    Works of one group run in order, so waiting for the last is waiting for all."""
    for work in works[:-1]:
        work.wait()
    if works:
        works[-1].wait(datetime.timedelta(seconds=timeout_s))
