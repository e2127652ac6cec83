"""The sync store's typed records and the handshake over them: strict decoding (a
malformed value is a clear error), and a member's view of rank 0's decision."""
import datetime
import threading

import msgspec
import pytest
import torch.distributed as dist

from async_rl.weight_transfer import store as handshake
from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.store import (
    Abandon,
    Arrival,
    Decision,
    Go,
    Group,
    IpcOrder,
    LearnerInfo,
    decision_key,
    decode,
    encode,
)


def raw(value) -> bytes:
    return msgspec.msgpack.encode(value)


@pytest.mark.parametrize("record", [
    LearnerInfo("auto", "nccl", "node-1", "GPU-1234"), LearnerInfo("gloo", "gloo", "node-1", None),
    Arrival("gloo"), Arrival("cuda_ipc"), Arrival("vllm", 2, "0123abcd"),
    Go({"gloo": Group((1, 3)), "cuda_ipc": Group((2,))}), Go({"vllm": Group((1,), port=29500)}), Abandon("why"),
    IpcOrder(1, 7),
])
def test_records_round_trip(record):
    kind = Decision if isinstance(record, (Go, Abandon)) else type(record)
    assert decode(kind, encode(record), "record") == record


@pytest.mark.parametrize("kind,value", [
    (Arrival, {"transport": "tcp"}),  # not a transport
    (Arrival, {"transport": "gloo", "workers": "1"}),  # no coercion from text
    (Arrival, {"transport": "gloo", "rank": 1}),  # unknown field
    (Arrival, "collective"),  # the old string protocol
    (Decision, {"type": "go", "groups": {"gloo": {"ranks": [0]}}}),  # rank 0 is the learner
    (Decision, {"type": "go", "groups": {"udp": {"ranks": [1]}}}),
    (Decision, "go 1 2 3"),
    (Decision, {"type": "abandon"}),
    (LearnerInfo, {"transport": "auto", "backend": "gloo", "host": "h" * 300, "gpu": None}),
    (IpcOrder, {"bucket_set": 2, "version": 1}),  # there are two sets at most
])
def test_malformed_values_are_clear_errors(kind, value):
    with pytest.raises(ValueError, match="malformed thing in the sync store"):
        decode(kind, raw(value), "thing")
    with pytest.raises(ValueError, match="malformed thing in the sync store"):
        decode(kind, raw(value)[:-1] + b"\xc1", "thing")  # not even MessagePack


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    yield dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=5))


def test_member_joins_the_group_of_its_transport(store):
    store.set(decision_key(3), encode(Go({"gloo": Group((1, 4)), "cuda_ipc": Group((2,))})))
    assert handshake.join(store, 3, 4, Arrival("gloo"), timeout_s=5) == Group((1, 4))
    assert handshake.join(store, 3, 2, Arrival("cuda_ipc"), timeout_s=5) == Group((2,))
    with pytest.raises(RuntimeError, match="leaves this member"):
        handshake.join(store, 3, 5, Arrival("gloo"), timeout_s=5)
    with pytest.raises(RuntimeError, match="leaves this member"):  # rank 2 is in, but by CUDA IPC
        handshake.join(store, 3, 2, Arrival("gloo"), timeout_s=5)
    assert decode(Arrival, store.get("arrived/3/4"), "arrival") == Arrival("gloo")


def test_member_sees_abandon_and_malformed_decisions(store):
    threading.Timer(0.2, handshake.abandon, args=(store, 1, "the membership changed")).start()
    with pytest.raises(SyncAbandoned, match="abandoned epoch 1: the membership changed"):
        handshake.join(store, 1, 1, Arrival("gloo"), timeout_s=5)
    store.set(decision_key(2), b"go 1 2")
    with pytest.raises(ValueError, match="malformed sync decision"):
        handshake.join(store, 2, 1, Arrival("gloo"), timeout_s=5)


def test_rank_0_gives_up_at_once_or_after_its_timeout(store):
    store.set("arrived/1/1", encode(Arrival("gloo")))
    with pytest.raises(SyncAbandoned, match="membership changed"):
        handshake.gather_arrivals(store, 1, 2, timeout_s=5, give_up=lambda: "the membership changed")
    assert decode(Decision, store.get(decision_key(1)), "decision") == Abandon("the membership changed")
    with pytest.raises(TimeoutError, match="1 of 2 member"):
        handshake.gather_arrivals(store, 1, 2, timeout_s=0.1, give_up=lambda: None)
    assert isinstance(decode(Decision, store.get(decision_key(1)), "decision"), Abandon)
    store.set("arrived/1/2", b"collective")
    arrivals = handshake.gather_arrivals(store, 1, 2, timeout_s=5, give_up=lambda: None)
    assert handshake.decode_arrival(1, arrivals[1]) == Arrival("gloo")
    with pytest.raises(ValueError, match="rank 2 announced itself as b'collective'"):
        handshake.decode_arrival(2, arrivals[2])


def test_the_store_listens_on_its_host_alone():
    """torch's TCPStore listens on every address whatever host it is given; ours is
    bound to transport.host, and still serves clients there."""
    import psutil

    from async_rl.weight_transfer.sender import store_bound_to

    store = store_bound_to("127.0.0.1", 0, timeout_s=5)
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [a.ip for a in listening] == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
