"""`async-rl actor` that SIGKILLs itself in the middle of a weight sync, for
tests/integration/test_elastic_actors.py: `python tests/integration/dying_actor.py N --hub ADDR` dies after the
second bucket of its N-th sync, while the other members receive the same sync. It
joined last, so it is the end of the chain (weight_transfer/gloo_chain.py): the members
before it have every bucket by then, and rank 0, left without the acknowledgement,
counts the sync as failed and sends the version again once the reaper has removed it."""
import os
import signal
import sys

from async_rl.cli import main
from async_rl.weight_transfer import gloo_chain
from async_rl.weight_transfer import receiver as weight_receiver

die_in_sync = int(sys.argv.pop(1))
syncs = buckets = 0
receive, await_bucket = weight_receiver.ParameterReceiver.receive, gloo_chain.await_bucket


def counting_receive(self, **kwargs):
    global syncs, buckets
    syncs, buckets = syncs + 1, 0
    return receive(self, **kwargs)


def dying_await_bucket(work, timeout_s):  # the receiver's wait for each bucket on CPU
    global buckets
    await_bucket(work, timeout_s)
    buckets += 1
    if syncs >= die_in_sync and buckets == 2:
        os.kill(os.getpid(), signal.SIGKILL)


weight_receiver.ParameterReceiver.receive = counting_receive
gloo_chain.await_bucket = dying_await_bucket
sys.exit(main(["actor", *sys.argv[1:]]))
