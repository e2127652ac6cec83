"""`async-rl actor` that SIGKILLs itself in the middle of a weight broadcast, for
tests/test_elastic_actors.py: `python tests/dying_actor.py N --hub ADDR` dies after the
second bucket of its N-th sync, while the other members receive the same broadcast.
(After two buckets, not one: by then rank 0 has sent every member the first bucket, so
the survivors are certainly left half-updated.)"""
import os
import signal
import sys

from async_rl.cli import main
from async_rl.weight_sync import receiver as weight_receiver

die_in_sync = int(sys.argv.pop(1))
syncs = buckets = 0
receive, broadcast = weight_receiver.WeightReceiver.receive, weight_receiver.broadcast


def counting_receive(self, **kwargs):
    global syncs, buckets
    syncs, buckets = syncs + 1, 0
    return receive(self, **kwargs)


def dying_broadcast(group, tensor):  # the receiver's per-bucket broadcast on CPU
    global buckets
    broadcast(group, tensor)
    buckets += 1
    if syncs >= die_in_sync and buckets == 2:
        os.kill(os.getpid(), signal.SIGKILL)


weight_receiver.WeightReceiver.receive = counting_receive
weight_receiver.broadcast = dying_broadcast
sys.exit(main(["actor", *sys.argv[1:]]))
