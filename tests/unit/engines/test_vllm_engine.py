"""The vLLM engine: pure parts everywhere, generation and weight transfer where vLLM runs.

vLLM cannot be installed on the CPU CI machines, so the tests that need it skip there,
saying why; the version check, the config rules and the SyncOrder -> vLLM mapping are
pure and always run, and so is learner rank 0's side (WeightBroadcaster(engine="vllm"))
against vLLM faked at its own API (its group classes and `LLM`'s weight-transfer calls;
our broadcaster and receiver are real).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import queue
import socket
import sys
import threading
import time
import types
from types import SimpleNamespace

import msgspec
import pytest
import torch
import transformers

from async_rl.config import ConfigError, build_config
from async_rl.engines import make_engine
from async_rl.engines.vllm_engine import completion_from_output, sampled_logprobs, token_versions
from async_rl.engines.vllm_engine import hf_parameter_specs
from async_rl.weight_sync import EpochRejected, SyncAbandoned, WeightBroadcaster, plan_epoch, plan_packed
from async_rl.weight_sync import vllm as vllm_transport
from async_rl.weight_sync.base import SenderSide
from async_rl.weight_sync.gloo_chain import GlooChainSender
from async_rl.weight_sync.handshake import decode_arrival
from async_rl.weight_sync.plan import layout_id
from async_rl.weight_sync.records import (Arrival, Decision, Go, Group, arrived_key, decision_key, decode,
                                          encode)
from async_rl.weight_sync.vllm import VLLMWeightReceiver, check_arrivals
from async_rl.weight_sync.vllm_api import (VLLMUnavailable, init_info, pack_for_vllm, packed_chunk_sizes,
                                           parse_version, place_wire_params, require_vllm, supported_kwargs,
                                           update_info, vllm_world, wire_params)

NO_VLLM = "vLLM is not installed (its wheels pin a CUDA torch; CPU CI cannot run it)"


def _vllm_importable() -> bool:
    try:
        require_vllm()
    except VLLMUnavailable:
        return False
    return True


needs_vllm = pytest.mark.skipif(not _vllm_importable(), reason=NO_VLLM)
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="NCCL weight transfer needs two GPUs (trainer and vLLM worker)")


def _tiny_llama(path, *, hidden: int = 256, vocab: int = 128, seed: int = 0) -> str:
    """head_dim 64: small, but a size vLLM's attention kernels support."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, intermediate_size=2 * hidden,
                                      max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=1,
                                      bos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


# ------------------------------------------------------------- version check

@pytest.mark.parametrize("text,expected", [("0.16.0", (0, 16, 0)), ("0.16.1rc1.dev3+gabc", (0, 16, 1)),
                                           ("v1.2", (1, 2)), ("0.33.0+cu130", (0, 33, 0))])
def test_parse_version(text: str, expected: tuple[int, ...]) -> None:
    assert parse_version(text) == expected


def test_missing_vllm_is_one_line_naming_the_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(VLLMUnavailable, match=r"vLLM >= 0\.16.*not installed") as err:
        require_vllm()
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=r"vLLM >= 0\.16"):  # before any argument is looked at
        make_engine("vllm")


@pytest.mark.parametrize("version,ok", [("0.15.2", False), ("0.8.5", False), ("unknown", False),
                                        ("0.16.0rc1", True), ("0.33.0", True)])
def test_old_vllm_is_refused(monkeypatch: pytest.MonkeyPatch, version: str, ok: bool) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    if ok:
        assert require_vllm() is sys.modules["vllm"]
    else:
        with pytest.raises(VLLMUnavailable, match=rf"vLLM >= 0\.16 .*found {version}$"):
            require_vllm()


# ------------------------------------------------------------------ config

def test_config_rejects_vllm_on_cpu_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^model\.device: cpu cannot run actors\.engine=vllm"):
        build_config({"actors": {"engine": "vllm"}, "model": {"device": "cpu"}})
    for device in ("cuda", "auto"):
        assert build_config({"actors": {"engine": "vllm"}, "model": {"device": device}}).actors.engine == "vllm"


# ------------------------------------------------------- SyncOrder -> vLLM

def test_init_info_maps_sync_order() -> None:
    info = init_info(master_address="10.0.0.1", master_port=29600, rank=2, world_size=4)
    assert info == {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 2, "world_size": 4}
    # Two workers per engine: actor ranks 1..3 -> NCCL ranks 1-2, 3-4, 5-6 of a world of 7.
    wide = [init_info(master_address="h", master_port=1, rank=r, world_size=4, workers_per_engine=2)
            for r in (1, 2, 3)]
    assert [w["rank_offset"] for w in wide] == [1, 3, 5] and {w["world_size"] for w in wide} == {7}
    with pytest.raises(ValueError):
        init_info(master_address="h", master_port=1, rank=0, world_size=4)  # rank 0 is the learner
    # The port of vLLM's rendezvous travels in rank 0's decision, checked as network input.
    decision = decode(Decision, encode(Go({"vllm": Group((1, 2), port=29600)})), "sync decision")
    assert decision == Go({"vllm": Group((1, 2), port=29600)})
    for bad in (0, 70000, -1, "29600", "12; rm"):
        raw = msgspec.msgpack.encode({"type": "go", "groups": {"vllm": {"ranks": [1], "port": bad}}})
        with pytest.raises(ValueError, match="malformed sync decision"):
            decode(Decision, raw, "sync decision")
    with pytest.raises(ValueError, match="malformed sync decision"):
        decode(Decision, b"", "sync decision")


def test_update_info_and_wire_params_placement() -> None:
    specs = [("a.weight", (2, 3), torch.float32), ("b", (4,), torch.bfloat16)]
    assert update_info(specs) == {"names": ["a.weight", "b"], "dtype_names": ["float32", "bfloat16"],
                                  "shapes": [[2, 3], [4]]}
    wire = wire_params(bucket_mb=2)
    assert wire["packed"] is True and wire["packed_buffer_size_bytes"] == 2 * 2**20
    base = {"master_address", "master_port", "rank_offset", "world_size"}
    names = {"names", "dtype_names", "shapes"}
    packing = {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}
    # vLLM 0.16: packing travels with each update.
    assert place_wire_params(wire, base, names | packing) == ({}, wire)
    # Later vLLM: the trainer ships packing at the handshake.
    assert place_wire_params(wire, base | packing, names) == (wire, {})
    # A buffer count no version declares is dropped (it does not change the layout) ...
    assert place_wire_params(wire, base, names | {"packed", "packed_buffer_size_bytes"})[1] == {
        "packed": True, "packed_buffer_size_bytes": 2 * 2**20}
    # ... but packing itself is required.
    with pytest.raises(VLLMUnavailable, match="packed"):
        place_wire_params(wire, base, names)


def test_packed_layout_follows_vllm_rule_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [("w0", torch.randn(10, generator=gen)), ("w1", torch.randn(3, 2, generator=gen).to(torch.bfloat16)),
               ("w2", torch.randn(7, generator=gen)), ("w3", torch.arange(5, dtype=torch.int64))]
    specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
    # Bytes 40, 12, 28, 40 with a 48-byte buffer: a chunk closes after the tensor crossing 48.
    assert packed_chunk_sizes(specs, 48) == [52, 68]
    chunks = list(pack_for_vllm(iter(tensors), 48))
    assert [c.numel() for c in chunks] == [52, 68] and all(c.dtype == torch.uint8 for c in chunks)
    flat = torch.cat(chunks)
    offset = 0
    for _, t in tensors:  # what vLLM's consumer does: split by byte size, view as dtype and shape
        size = t.numel() * t.element_size()
        assert torch.equal(flat[offset:offset + size].view(t.dtype).view(t.shape), t)
        offset += size
    assert packed_chunk_sizes(specs, 10**6) == [120]


def test_hf_specs_follow_the_learner_order(tmp_path) -> None:
    from async_rl.engines.torch_engine import TorchEngine

    path = _tiny_llama(tmp_path / "m", hidden=32, vocab=16)
    specs = hf_parameter_specs(path)
    params = TorchEngine(path).parameters_for_sync()
    assert [(n, s) for n, s, _ in specs] == [(n, tuple(p.shape)) for n, p in params]
    assert "lm_head.weight" not in {n for n, _, _ in specs}  # tied: sent once, as the embedding
    assert {d for _, _, d in specs} == {torch.float32}


def test_supported_kwargs() -> None:
    def old(): ...
    def new(is_checkpoint_format: bool = False): ...
    def anything(**kw): ...
    wanted = {"is_checkpoint_format": True}
    assert supported_kwargs(old, wanted) == {} and supported_kwargs(new, wanted) == wanted
    assert supported_kwargs(anything, wanted) == wanted


# -------------------------------------------- rank 0's side of the protocol

def _sender_side(layout=None) -> SenderSide:
    """What a sender's `prepare` reads: the host to listen on, and the learner's layout."""
    return SenderSide(store=None, host="127.0.0.1", device=torch.device("cpu"), timeout_s=5, side_stream=None,
                      bucket_sets=[], layout=layout)


def test_plan_epoch_for_vllm_members() -> None:
    lay = layout_id([("w", (4,), torch.float32)], 64)
    arrival = Arrival("vllm", 1, lay)
    plan = plan_epoch({2: arrival, 1: arrival, 3: arrival}, served=("vllm",), engine="vllm")
    assert list(plan.members) == ["vllm"] and list(plan.members["vllm"]) == [1, 2, 3]
    assert check_arrivals(plan.members["vllm"], lay) == 4
    sender = vllm_transport.VLLMSender(_sender_side(lay))
    group = sender.prepare(1, plan.members["vllm"])
    try:  # the decision names the members in order, and a port rank 0 listens on
        assert group.ranks == (1, 2, 3)
        with socket.create_connection(("127.0.0.1", group.port), timeout=5):
            pass
    finally:
        sender.disconnect()
    # What each member derives from that decision fits rank 0's world, without overlap.
    wide = {1: Arrival("vllm", 2, lay), 2: Arrival("vllm", 2, lay)}
    world = check_arrivals(wide, lay)
    assert world == 5 == vllm_world(3, 2)
    infos = [init_info(master_address="h", master_port=1, rank=r, world_size=len(wide) + 1, workers_per_engine=2)
             for r in (1, 2)]
    assert {i["world_size"] for i in infos} == {world}
    assert sorted(i["rank_offset"] + w for i in infos for w in range(2)) == list(range(1, world))
    # Torch receivers: the collective ranks in their transport's group, IPC apart.
    torch_plan = plan_epoch({1: Arrival("gloo"), 2: Arrival("cuda_ipc"), 3: Arrival("gloo")},
                            served=("gloo", "cuda_ipc"), engine="torch")
    assert {name: list(m) for name, m in torch_plan.members.items()} == {"gloo": [1, 3], "cuda_ipc": [2]}
    assert GlooChainSender(_sender_side()).prepare(1, torch_plan.members["gloo"]) == Group((1, 3))


def _decide(raw_arrivals: dict[int, bytes], engine: str, layout: str = "abc") -> None:
    """Rank 0's decision up to "go" (epochs.form_epoch): decode, assign, the transport's checks."""
    arrivals = {rank: decode_arrival(rank, raw) for rank, raw in raw_arrivals.items()}
    plan = plan_epoch(arrivals, served=("vllm",) if engine == "vllm" else ("gloo", "cuda_ipc"), engine=engine)
    if "vllm" in plan.members:
        check_arrivals(plan.members["vllm"], layout)


VLLM_ABC, GLOO, IPC = encode(Arrival("vllm", 1, "abc")), encode(Arrival("gloo")), encode(Arrival("cuda_ipc"))


@pytest.mark.parametrize("arrivals,engine,match", [
    ({1: VLLM_ABC, 2: GLOO}, "vllm", "torch engine"),  # mixed epoch in a vLLM run
    ({1: VLLM_ABC, 2: GLOO}, "torch", "run vLLM"),  # mixed epoch in a torch run
    ({1: VLLM_ABC}, "torch", "actors.engine=torch"),
    ({1: IPC}, "vllm", "torch engine"),
    ({1: encode(Arrival("vllm", 1, "def"))}, "vllm", "wire layout def differs"),
    ({1: encode(Arrival("vllm"))}, "vllm", "wire layout None differs"),
    ({1: VLLM_ABC, 2: encode(Arrival("vllm", 2, "abc"))}, "vllm", "workers per engine"),
    ({1: encode(Arrival("nccl"))}, "torch", "does not serve"),  # not the learner's backend
    ({1: msgspec.msgpack.encode({"transport": "vllm", "workers": 0, "layout": "abc"})}, "vllm", "announced itself"),
    ({1: encode(Arrival("vllm", 1, "ABC;"))}, "vllm", "announced itself"),
    ({1: msgspec.msgpack.encode({"transport": "gloo", "extra": 1})}, "torch", "announced itself"),
    ({1: b"gloo"}, "torch", "announced itself"),
])
def test_plan_epoch_refuses(arrivals, engine, match) -> None:
    with pytest.raises(EpochRejected, match=match):
        _decide(arrivals, engine)


def _vllm_consumer(chunks, names, dtype_names, shapes, buffer_bytes):
    """What vLLM's packed consumer does (packed_tensor.py), receiving from `chunks`:
    cut by size, one broadcast per chunk, split, view as dtype and shape."""
    out, pending, size = {}, [], 0
    meta = [(n, getattr(torch, d), s) for n, d, s in zip(names, dtype_names, shapes)]

    def take():
        chunk = chunks()
        assert chunk.dtype == torch.uint8 and chunk.numel() == size, (chunk.numel(), size)
        sizes = [math.prod(s) * d.itemsize for _, d, s in pending]
        for (name, dtype, shape), part in zip(pending, chunk.split(sizes)):
            out[name] = part.contiguous().view(dtype).view(*shape).clone()

    for name, dtype, shape in meta:
        pending.append((name, dtype, shape))
        size += math.prod(shape) * dtype.itemsize
        if size > buffer_bytes:
            take()
            pending, size = [], 0
    if pending:
        take()
    return out


def test_packed_plan_is_what_vllm_unpacks() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [("w0", torch.randn(10, generator=gen)), ("w1", torch.randn(3, 2, generator=gen).to(torch.bfloat16)),
               ("w2", torch.randn(7, generator=gen)), ("w3", torch.randn(2, 2, generator=gen).to(torch.float16))]
    specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors]
    plan = plan_packed(specs, 48)
    assert [b.numel for b in plan] == packed_chunk_sizes(specs, 48) == [52, 36]
    assert all(b.dtype == torch.uint8 for b in plan)
    # Fill the plan's buckets the way the broadcaster's publish does, then unpack as vLLM.
    buckets = [torch.empty(b.numel, dtype=torch.uint8) for b in plan]
    slot = {e.name: (i, e) for i, b in enumerate(plan) for e in b.entries}
    for name, t in tensors:
        i, e = slot[name]
        buckets[i][e.offset:e.offset + e.numel].copy_(t.reshape(-1).view(torch.uint8))
    assert torch.equal(torch.cat(buckets), torch.cat(list(pack_for_vllm(iter(tensors), 48))))
    info = update_info(specs)
    got = _vllm_consumer(iter(buckets).__next__, info["names"], info["dtype_names"], info["shapes"], 48)
    assert all(torch.equal(got[n], t) for n, t in tensors)
    # The layout id: equal for equal layouts, names aside; another dtype or buffer size differs.
    assert layout_id(specs, 48) == layout_id([("x." + n, s, d) for n, s, d in specs], 48)
    assert layout_id(specs, 48) != layout_id(specs, 64)
    assert layout_id(specs, 48) != layout_id([(n, s, torch.float32) for n, s, _ in specs], 48)


# ---------------------------------- vLLM faked at its own API, our code real

class _FakeVLLM:
    """Stands in for vLLM's modules: StatelessProcessGroup, PyNcclCommunicator (chunks
    broadcast by rank 0 are queued for every other rank), the weight-transfer request and
    info classes (0.16 layout: packing fields in the update info), and an `LLM` whose
    weight-transfer calls run vLLM's packed consumer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, block_create: threading.Event | None = None):
        self.groups: list[dict] = []  # StatelessProcessGroup.create calls
        self.wires: dict[int, dict[int, queue.Queue]] = {}
        self.lock = threading.Lock()
        fake = self

        class StatelessProcessGroup:
            @staticmethod
            def create(host, port, rank, world_size, data_expiration_seconds=3600, store_timeout=300,
                       listen_socket=None):
                fake.groups.append(dict(host=host, port=port, rank=rank, world_size=world_size,
                                        store_timeout=store_timeout, listen_socket=listen_socket))
                if block_create is not None:
                    block_create.wait(10)
                return SimpleNamespace(port=port, rank=rank, world_size=world_size)

        class PyNcclCommunicator:
            def __init__(self, pg, device):
                self.pg, self.device = pg, device
                self.wire = fake.wire(pg.port, pg.world_size)

            def broadcast(self, tensor, src, stream=None):
                assert self.pg.rank == src == 0
                for q in self.wire.values():
                    q.put(tensor.clone())

        @dataclasses.dataclass
        class InitInfo:
            master_address: str
            master_port: int
            rank_offset: int
            world_size: int

        @dataclasses.dataclass
        class UpdateInfo:
            names: list
            dtype_names: list
            shapes: list
            packed: bool = False
            packed_buffer_size_bytes: int = 1 << 30
            packed_num_buffers: int = 2

        engine = SimpleNamespace(init_info_cls=InitInfo, update_info_cls=UpdateInfo)
        modules = {
            "vllm": SimpleNamespace(__version__="0.16.0"),
            "vllm.distributed": SimpleNamespace(),
            "vllm.distributed.utils": SimpleNamespace(StatelessProcessGroup=StatelessProcessGroup),
            "vllm.distributed.device_communicators": SimpleNamespace(),
            "vllm.distributed.device_communicators.pynccl": SimpleNamespace(PyNcclCommunicator=PyNcclCommunicator),
            "vllm.distributed.weight_transfer": SimpleNamespace(),
            "vllm.distributed.weight_transfer.base": SimpleNamespace(
                WeightTransferInitRequest=lambda init_info: SimpleNamespace(init_info=init_info),
                WeightTransferUpdateRequest=lambda update_info: SimpleNamespace(update_info=update_info)),
            "vllm.distributed.weight_transfer.nccl_engine": SimpleNamespace(NCCLWeightTransferEngine=engine),
        }
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)

    def wire(self, port: int, world_size: int) -> dict[int, queue.Queue]:
        with self.lock:
            return self.wires.setdefault(port, {r: queue.Queue() for r in range(1, world_size)})

    def llm(self) -> SimpleNamespace:
        fake = self
        llm = SimpleNamespace(inits=[], weights={}, updates=0)

        def init_weight_transfer_engine(request):
            info = request.init_info
            with socket.create_connection((info["master_address"], info["master_port"]), timeout=5):
                pass  # rank 0 listens on the port it published
            llm.inits.append(info)
            llm.inbox = fake.wire(info["master_port"], info["world_size"])[info["rank_offset"]]

        def update_weights(request):
            info = request.update_info
            assert info["packed"] is True
            llm.weights.update(_vllm_consumer(lambda: llm.inbox.get(timeout=5), info["names"], info["dtype_names"],
                                              info["shapes"], info["packed_buffer_size_bytes"]))
            llm.updates += 1

        llm.init_weight_transfer_engine, llm.update_weights = init_weight_transfer_engine, update_weights
        return llm


def _job(bc, version, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = bc.job()
        if job is not None and job.version == version:
            return job
        time.sleep(0.005)
    raise AssertionError(f"no broadcast job for version {version}")


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(8, 4, generator=gen)), ("norm.weight", torch.randn(4, generator=gen)),
            ("proj.weight", torch.randn(4, 6, generator=gen).to(torch.bfloat16)),
            ("head.bias", torch.randn(5, generator=gen))]


def _specs(tensors):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors]


def test_broadcaster_serves_vllm_members_through_vllms_api(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeVLLM(monkeypatch)
    first, second = _tensors(0), _tensors(1)
    bucket_mb = 100 / 2**20  # several chunks
    bc = WeightBroadcaster(_specs(first), bucket_mb=bucket_mb, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5, engine="vllm")
    llms = {k: fake.llm() for k in (4, 9)}
    receivers = {k: VLLMWeightReceiver(llm, _specs(first), bucket_mb=bucket_mb, backend="nccl", timeout_s=5)
                 for k, llm in llms.items()}
    errors = []

    def receive(actor_id, job):
        try:
            receivers[actor_id].receive(epoch=job.epoch, rank=job.rank_of(actor_id), world_size=3,
                                        store_host=bc.host, store_port=bc.port)
        except Exception as err:
            errors.append(err)

    try:
        bc.set_members([4, 9])
        for version, tensors in ((1, first), (2, second)):
            bc.publish(version, iter(tensors))
            if version == 1:
                job = _job(bc, version)  # waits in the rendezvous for the members
            else:  # same epoch: the fake group does not block, so the job may be over already
                deadline = time.time() + 5
                while bc.completed < 2 and time.time() < deadline:
                    time.sleep(0.005)
            threads = [threading.Thread(target=receive, args=(k, job)) for k in (4, 9)]
            [t.start() for t in threads]
            [t.join(timeout=10) for t in threads]
            assert not errors, errors
            for k, llm in llms.items():
                assert all(torch.equal(llm.weights[n], t) for n, t in tensors) and receivers[k].intact
        # One trainer group for the epoch, formed by rank 0 on the port it published, bounded.
        (group,) = fake.groups
        assert group["rank"] == 0 and group["world_size"] == 3 and group["store_timeout"] == 5
        assert group["listen_socket"] is not None and group["listen_socket"].getsockname()[1] == group["port"]
        for k, llm in llms.items():  # one init each (the epoch did not change), two updates
            assert llm.updates == 2 and llm.inits == [{"master_address": "127.0.0.1", "master_port": group["port"],
                                                        "rank_offset": job.rank_of(k), "world_size": 3}]
        assert bc.failures == 0 and bc.completed == 2
    finally:
        bc.close(wait_s=5)
        if fake.groups and fake.groups[0]["listen_socket"] is not None:
            fake.groups[0]["listen_socket"].close()


def test_go_names_the_port_rank_0_listens_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeVLLM(monkeypatch)
    tensors = _tensors(0)
    bc = WeightBroadcaster(_specs(tensors), bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5, engine="vllm")
    import datetime

    import torch.distributed as dist

    client = dist.TCPStore(bc.host, bc.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    try:
        bc.set_members([1])
        bc.publish(1, iter(tensors))
        job = _job(bc, 1)
        client.set(arrived_key(job.epoch, 1), encode(Arrival("vllm", 1, layout_id(_specs(tensors), 2**20))))
        client.wait([decision_key(job.epoch)], datetime.timedelta(seconds=5))
        decision = decode(Decision, client.get(decision_key(job.epoch)), "sync decision")
        assert isinstance(decision, Go) and decision.groups["vllm"].ranks == (1,)
        port = decision.groups["vllm"].port  # in the decision itself: there when "go" is
        with socket.create_connection((bc.host, port), timeout=5):
            pass
    finally:
        bc.close(wait_s=5)


def test_mixed_or_wrong_engine_epoch_is_refused_with_one_log_line(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    fake = _FakeVLLM(monkeypatch)
    tensors = _tensors(0)
    bc = WeightBroadcaster(_specs(tensors), bucket_mb=1, host="127.0.0.1", backend="gloo",
                           device=torch.device("cpu"), timeout_s=5)  # engine="torch"
    receiver = VLLMWeightReceiver(fake.llm(), _specs(tensors), bucket_mb=1, backend="nccl", timeout_s=5)
    try:
        with caplog.at_level(logging.WARNING, logger="async_rl.sync"):
            bc.set_members([1])
            bc.publish(1, iter(tensors))
            job = _job(bc, 1)
            with pytest.raises(SyncAbandoned):
                receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
            deadline = time.time() + 5
            while bc.failures == 0 and time.time() < deadline:
                time.sleep(0.01)
        assert bc.failures >= 1 and not fake.groups
        assert any("run vLLM, but this learner was built for actors.engine=torch" in r.getMessage()
                   for r in caplog.records)
    finally:
        bc.close(wait_s=5)


def test_trainer_group_formation_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    _FakeVLLM(monkeypatch, block_create=release)  # a member that never joins: create never returns
    sock = vllm_transport.reserve_port("127.0.0.1")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not form within"):
            vllm_transport.open_group(sock, "127.0.0.1", 2, torch.device("cpu"), timeout_s=0.3)
        assert time.monotonic() - started < 2
    finally:
        release.set()
        sock.close()


# ---------------------------------------------------------- output parsing

def _logprob(value: float) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=1)


def test_completion_from_vllm_output() -> None:
    out = SimpleNamespace(index=0, token_ids=[5, 7, 1], finish_reason="stop",
                          logprobs=[{5: _logprob(-0.5)}, {7: _logprob(-1.25), 3: _logprob(-0.1)}, {1: _logprob(0.0)}])
    c = completion_from_output(out, version=4)
    assert c.tokens.tolist() == [5, 7, 1] and c.tokens.dtype == torch.int64
    assert c.logprobs.tolist() == [-0.5, -1.25, 0.0] and c.logprobs.dtype == torch.float32
    assert c.versions.tolist() == [4, 4, 4] and c.versions.dtype == torch.int32 and c.finished
    cut = SimpleNamespace(index=0, token_ids=[5], finish_reason="length", logprobs=[{5: _logprob(-2.0)}])
    assert not completion_from_output(cut, version=0).finished


def test_missing_logprobs_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="no per-token log-probs"):
        sampled_logprobs([1, 2], None)
    with pytest.raises(RuntimeError, match="lack the sampled token 2"):
        sampled_logprobs([1, 2], [{1: _logprob(-1.0)}, {3: _logprob(-1.0)}])


def test_weight_version_spans_set_token_versions() -> None:
    spans = [SimpleNamespace(start=0, end=3, version="6"), SimpleNamespace(start=3, end=5, version="7")]
    assert token_versions(5, 6, spans).tolist() == [6, 6, 6, 7, 7]
    foreign = [SimpleNamespace(start=0, end=5, version="step-x")]  # labels not set by us: ignored
    assert token_versions(5, 2, foreign).tolist() == [2] * 5
    assert token_versions(3, 1, None).tolist() == [1, 1, 1]


# ------------------------------------------------------- needs vLLM + GPU

@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory):
    if not _vllm_importable():
        pytest.skip(NO_VLLM)
    if not torch.cuda.is_available():
        pytest.skip("the vLLM engine needs a CUDA GPU")
    path = _tiny_llama(tmp_path_factory.mktemp("vllm_model") / "m")
    return make_engine("vllm", model_or_path=path, device="cuda", dtype="float32", enforce_eager=True,
                       max_model_len=128), path


@needs_vllm
def test_vllm_generate_contract(vllm_engine) -> None:
    engine, _ = vllm_engine
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10]]
    out = engine.generate(prompts, n=3, max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    assert len(out) == 3 and all(len(g) == 3 for g in out)
    for group in out:
        for c in group:
            assert 1 <= len(c) <= 6 and c.logprobs.shape == c.tokens.shape == c.versions.shape
            assert bool((c.logprobs <= 0).all()) and set(c.versions.tolist()) == {0}
            assert c.finished == (c.tokens[-1].item() in engine.eos_token_ids)


@needs_vllm
def test_vllm_logprobs_are_under_the_tempered_distribution(vllm_engine) -> None:
    engine, path = vllm_engine
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt, temperature = [3, 4, 5], 0.7
    c = engine.generate([prompt], n=1, max_new_tokens=5, temperature=temperature,
                        generator=torch.Generator().manual_seed(1))[0][0]
    seq = torch.tensor([prompt + c.tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, c.tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(c.logprobs, ref, atol=2e-3, rtol=0)


@needs_two_gpus
@needs_vllm
def test_vllm_weight_update_through_transfer_api(vllm_engine, tmp_path) -> None:
    import datetime

    import torch.distributed as dist

    from async_rl.weight_sync.vllm import open_trainer_group

    engine, path = vllm_engine
    new_path = _tiny_llama(tmp_path / "new", seed=1)
    new = transformers.AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    from vllm.utils.network_utils import get_open_port  # vLLM's helper, as in its RLHF examples

    port = get_open_port()
    store.set(decision_key(1), encode(Go({"vllm": Group((1,), port=port)})))
    receiver = engine.weight_receiver(bucket_mb=1, backend="nccl", timeout_s=60)

    def trainer() -> None:
        group = open_trainer_group("127.0.0.1", port, 2, torch.device("cuda:1"))
        for chunk in pack_for_vllm(((n, p.data.to("cuda:1")) for n, p in new.named_parameters()), 2**20):
            group.broadcast(chunk, src=0)
        torch.cuda.synchronize("cuda:1")

    sender = threading.Thread(target=trainer)
    sender.start()
    receiver.receive(epoch=1, rank=1, world_size=2, store_host="127.0.0.1", store_port=store.port)
    sender.join(timeout=60)
    engine.set_version(1)
    assert receiver.intact
    c = engine.generate([[3, 4, 5]], n=1, max_new_tokens=4, greedy=True)[0][0]
    seq = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        greedy = new.generate(seq, max_new_tokens=len(c), do_sample=False, eos_token_id=None)[0, 3:]
    assert c.tokens.tolist() == greedy.tolist() and set(c.versions.tolist()) == {1}


@needs_two_gpus
@needs_vllm
def test_vllm_weight_update_from_the_broadcaster(vllm_engine, tmp_path) -> None:
    """The learner's real path: WeightBroadcaster(engine="vllm") on cuda:1, vLLM on cuda:0."""
    engine, _ = vllm_engine
    new = transformers.AutoModelForCausalLM.from_pretrained(_tiny_llama(tmp_path / "new2", seed=2),
                                                            dtype=torch.float32)
    device = torch.device("cuda", 1)
    specs = [(n, tuple(p.shape), p.dtype) for n, p in new.named_parameters()]
    bc = WeightBroadcaster(specs, bucket_mb=0.25, host="127.0.0.1", backend="nccl", device=device, timeout_s=60,
                           engine="vllm")
    receiver = engine.weight_receiver(bucket_mb=0.25, backend="nccl", timeout_s=60)
    try:
        bc.set_members([1])
        bc.publish(1, ((n, p.data.to(device)) for n, p in new.named_parameters()))
        job = _job(bc, 1, timeout=60)
        receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        engine.set_version(1)
        assert receiver.intact
        c = engine.generate([[3, 4, 5]], n=1, max_new_tokens=4, greedy=True)[0][0]
        with torch.no_grad():
            greedy = new.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=len(c), do_sample=False,
                                  eos_token_id=None)[0, 3:]
        assert c.tokens.tolist() == greedy.tolist()
        deadline = time.time() + 30
        while bc.completed < 1 and time.time() < deadline:
            time.sleep(0.01)
        assert bc.completed == 1 and bc.failures == 0
    finally:
        bc.close(wait_s=5)
