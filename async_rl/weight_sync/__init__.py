"""Weight sync from learner rank 0 to the actors.

The actors are not members of the torchrun world, so each membership epoch gets its
own process group {learner rank 0 = rank 0, actors = ranks 1..n}, rendezvoused through
a TCPStore that rank 0 hosts (`transport.store_port`), under a per-epoch key prefix:
gloo on CPU, NCCL on GPU, and for an actor on the learner's own GPU a CUDA-IPC copy
(`sync.transport`, see transports.py). Parameters travel in flat buckets of
`sync.bucket_mb`, grouped by dtype, in `named_parameters()` order, which both sides
derive from the same architecture (plan.py).

Rank 0 never waits for actors: `publish` copies the gathered weights into a free
bucket set and returns; a background thread sends it while training goes on (double
buffering; broadcaster.py): down a pipelined chain of the members on gloo, one NCCL
broadcast per bucket on GPUs (schedule.py). Actors join at their next safe point;
their parameters are views of their own buckets, so the buckets land in them without
a copy (receiver.py).

A new epoch's group is only built once every member has announced itself in the store
and rank 0 has written its decision ("go" or "abandon"): gloo's own rendezvous cannot
be interrupted, so a member that died would otherwise hold everyone for the full
`sync.timeout_s`; this way a membership change (a dead actor reaped, a new one joined)
releases the waiting members at once. Rank 0 alone decides, so all members agree
(rendezvous.py).

Actors on vLLM (`WeightBroadcaster(engine="vllm")`, actors.engine=vllm) take the same
handshake, then vLLM's own NCCL weight-transfer group, which rank 0 hosts on a fresh
port per epoch; the buckets are then in vLLM's packed layout (vllm_trainer.py,
engines/vllm_weights.py).
"""
from .broadcaster import WeightBroadcaster
from .plan import Bucket, BucketEntry, alias_into_buckets, plan_buckets, plan_packed
from .receiver import WeightReceiver
from .rendezvous import EpochPlan, EpochRejected, SyncAbandoned, SyncJob, broadcast, describe, new_group, plan_epoch
from .transports import TRANSPORTS, choose_transport

__all__ = ["Bucket", "BucketEntry", "EpochPlan", "EpochRejected", "SyncAbandoned", "SyncJob", "TRANSPORTS",
           "WeightBroadcaster", "WeightReceiver", "alias_into_buckets", "broadcast", "choose_transport", "describe",
           "new_group", "plan_buckets", "plan_epoch", "plan_packed"]
