"""weight_transfer/store.py, abandoning: a wait that gives up as soon as asked, leaving its transfer behind; the
abandon record a member polls, on a real TCPStore."""
import datetime
import threading
import time

import pytest
import torch.distributed as dist

from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.store import mark_abandoned, member_gives_up, run_abandonable


def test_gives_up_at_once_and_leaves_the_stuck_transfer_behind():
    release, left = threading.Event(), []
    asked = []

    def give_up():
        asked.append(time.monotonic())
        return "member 2 was dropped" if len(asked) >= 3 else None

    with pytest.raises(SyncAbandoned, match="member 2 was dropped"):
        run_abandonable(release.wait, give_up, "send", left)
    assert len(asked) == 3  # gave up at the first reason, the transfer still stuck
    assert len(left) == 1 and left[0].is_alive() and left[0].name.endswith(":send")
    release.set()
    left[0].join(timeout=30)
    assert not left[0].is_alive()


def test_returns_or_raises_what_the_transfer_did():
    run_abandonable(lambda: None, lambda: None, "send", [])

    def broken():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        run_abandonable(broken, lambda: None, "send", [])


def test_a_member_sees_the_abandon_record_of_its_epoch_only():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    epoch_3, epoch_4 = member_gives_up(store, 3), member_gives_up(store, 4)
    assert epoch_3() is None
    mark_abandoned(store, 3, "the membership changed")
    assert epoch_3() == "rank 0 abandoned epoch 3: the membership changed"
    assert epoch_4() is None
