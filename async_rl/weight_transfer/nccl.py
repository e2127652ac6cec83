"""The NCCL transport: one broadcast per bucket, to actors on GPUs other than the learner's.

Not yet run on a GPU: its test needs two GPUs (NCCL refuses two ranks on one device)
and skips here; an actor on the learner's own GPU is served by CUDA IPC (cuda_ipc.py).

No chain as on gloo: NCCL already pipelines a broadcast in chunks along its ring. Rank
0 queues the broadcasts on its side stream, each behind its bucket's fill event, and
the host waits once, with a timeout; the members queue theirs on their current stream
likewise. The group's watchdog timeout (collective.new_group) aborts a broadcast stuck
on a dead peer.
"""
from __future__ import annotations

from async_rl.weight_transfer.groups import CollectiveReceiver, CollectiveSender
from async_rl.weight_transfer.protocol import Transport


class NcclSender(CollectiveSender):
    backend = "nccl"


class NcclReceiver(CollectiveReceiver):
    backend = "nccl"


TRANSPORT = Transport("nccl", NcclSender, NcclReceiver)
