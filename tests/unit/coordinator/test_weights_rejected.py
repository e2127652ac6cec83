"""An actor's WeightsRejected: counted, logged, and rank 0 sends the version again to a
new epoch; a claim on a version the learner has not reached is refused."""
import logging

import torch

from async_rl.config import build_config
from async_rl.coordinator.coordinator import Coordinator
from async_rl.tasks import make_task
from async_rl.weight_transfer.sender import WeightSender
from async_rl.wire import Hello, WeightsRejected


def test_a_refusal_is_counted_logged_and_starts_a_new_epoch(tmp_path, caplog):
    cfg = build_config({"learner": {"ranks": 1}})
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo",
                      device=torch.device("cpu"), timeout_s=5)
    coord = Coordinator(cfg, make_task("arithmetic", seed=0), bc, tmp_path)  # not started: handed messages
    try:
        coord.on_request(b"id-0", -1, Hello(actor_name="a", pid=1, host="h"))
        (actor_id,) = coord.actors
        epoch = bc._epoch
        reason = "version 0 did not arrive as sent: w (bucket 0, bytes 0-16) differs"
        with caplog.at_level(logging.WARNING, logger="async_rl.coordinator"):
            coord.on_request(b"id-0", -1, WeightsRejected(actor_id=actor_id, epoch=epoch, version=0, reason=reason))
        assert coord.counters()["sync/rejected"] == 1 and bc._epoch == epoch + 1
        assert f"rejected the weights of version 0 (epoch {epoch}): {reason}; sending them again" in caplog.text
        # The same epoch's refusal again (another member's, or late) starts no second one.
        coord.on_request(b"id-0", -1, WeightsRejected(actor_id=actor_id, epoch=epoch, version=0, reason=reason))
        assert bc._epoch == epoch + 1 and coord.counters()["sync/rejected"] == 2
        # A version beyond the learner's is not something rank 0 sent.
        coord.on_request(b"id-0", -1, WeightsRejected(actor_id=actor_id, epoch=epoch + 1, version=5, reason=reason))
        assert coord.counters()["sync/rejected"] == 2 and coord.rejects.total == 1
    finally:
        bc.close()
