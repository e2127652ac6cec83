"""`async-rl actor` whose weight syncs arrive corrupted, for
tests/integration/test_verified_weights.py: `python tests/integration/corrupting_actor.py
FIRST COUNT --hub ADDR` flips one bit of the first bucket of each of its syncs FIRST to
FIRST + COUNT - 1, as they arrive from the transport and before the receiver checks them
(as a faulty link or memory would). Joined last, it is the end of the gloo chain, so it
forwards nothing corrupted to another member."""
import sys

import torch

from async_rl.cli import main
from async_rl.weight_transfer.gloo_chain import GlooChainReceiver
from async_rl.weight_transfer.groups import CollectiveReceiver

first, count = int(sys.argv.pop(1)), int(sys.argv.pop(1))
syncs = 0


def corrupting(receive):
    def wrapped(self, landed=None):
        global syncs
        syncs += 1

        def flip_then_report(i):  # before the receiver takes the bucket's fingerprint
            if i == 0 and first <= syncs < first + count:
                self.target[0].view(torch.uint8)[3] ^= 0x04
            if landed is not None:
                landed(i)
        receive(self, flip_then_report)
    return wrapped


GlooChainReceiver.receive = corrupting(GlooChainReceiver.receive)
CollectiveReceiver.receive = corrupting(CollectiveReceiver.receive)
sys.exit(main(["actor", *sys.argv[1:]]))
