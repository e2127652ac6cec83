"""The weight-sync data paths: receivers whose parameters are views of their buckets,
publish overlapping the broadcast, the transport choice (gloo / NCCL / CUDA IPC) and the
CUDA-IPC handle format. The CUDA tests skip without a GPU."""
import multiprocessing as mp
import socket
import threading
import time

import msgspec
import pytest
import torch
import transformers
from conftest import wait_for_job

from async_rl.actor.engines.torch_engine import TorchEngine
from async_rl.config import ConfigError, build_config
from async_rl.weight_transfer import cuda_ipc
from async_rl.weight_transfer.buckets import plan_buckets
from async_rl.weight_transfer.errors import SyncAbandoned
from async_rl.weight_transfer.gloo_chain import chained
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.sender import WeightSender
from async_rl.weight_transfer.store import IpcBucket, LearnerInfo, decode, encode
from async_rl.weight_transfer.transports import choose_transport, learner_info

CPU = torch.device("cpu")


def specs(params):
    return [(n, tuple(p.shape), p.dtype) for n, p in params]


def tiny_tied_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=64, max_position_embeddings=64,
                                      tie_word_embeddings=True, initializer_range=0.5, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(config)


def test_receiver_makes_parameters_views_of_its_buckets_without_changing_the_model():
    engine = TorchEngine(tiny_tied_llama(0), eos_token_id=None)
    prompts = [[1, 2, 3], [4, 5]]
    before = engine.generate(prompts, max_new_tokens=6, greedy=True)
    receiver = ParameterReceiver(engine.parameters_for_sync(), bucket_mb=0.01, backend="gloo", timeout_s=5)
    assert len(receiver.plan) > 1
    after = engine.generate(prompts, max_new_tokens=6, greedy=True)
    for b, a in zip(before, after):
        assert torch.equal(b[0].tokens, a[0].tokens) and torch.equal(b[0].logprobs, a[0].logprobs)
    bases = {flat.untyped_storage().data_ptr() for flat in receiver.buckets}
    for _, param in engine.model.named_parameters():
        assert param.untyped_storage().data_ptr() in bases
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    # What lands in a bucket is what the model computes with.
    entry = receiver.plan[0].entries[0]
    receiver.buckets[0][entry.offset] = 123.0
    assert receiver.params[entry.name].reshape(-1)[0].item() == 123.0


def test_a_bf16_engine_receives_the_float32_learners_weights_in_bf16():
    """actors.engine.dtype=bfloat16: the learner publishes its float32 weights as bf16 (the copy
    into the buckets casts them), half the bytes, and the engine computes with them."""
    source = list(tiny_tied_llama(1).named_parameters())
    engine = TorchEngine(tiny_tied_llama(0), eos_token_id=None, dtype=torch.bfloat16)
    wire = [(n, shape, torch.bfloat16) for n, shape, _ in specs(source)]
    bc = WeightSender(wire, bucket_mb=0.001, host="127.0.0.1", backend="gloo", device=CPU, timeout_s=20)
    try:
        bc.set_members((0,))
        bc.publish(1, ((n, p.detach()) for n, p in source))
        job = wait_for_job(bc, (0,))
        receiver = ParameterReceiver(engine.parameters_for_sync(), bucket_mb=0.001, backend="gloo", timeout_s=20)
        assert [b.dtype for b in receiver.plan] == [b.dtype for b in bc.plan] == [torch.bfloat16] * len(bc.plan)
        receiver.receive(epoch=job.epoch, rank=job.rank_of(0), world_size=2, store_host=bc.host, store_port=bc.port)
        engine.set_version(1)
    finally:
        bc.close()
    assert sum(b.numel * 2 for b in bc.plan) == sum(p.numel() * 2 for _, p in source)  # 2 bytes a weight
    got = dict(engine.model.named_parameters())
    for name, param in source:
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], param.detach().to(torch.bfloat16)), name
    assert engine.generate([[1, 2, 3]], max_new_tokens=4, greedy=True)[0][0].tokens.numel() == 4


@pytest.mark.parametrize("bucket_bytes", [256, 2**20], ids=["chain", "one-bucket-broadcast"])
def test_staged_receiver_delivers_into_the_buckets_its_parameters_view(bucket_bytes):
    """sync.stage_on_actors (the default): a sync lands in a second bucket set, allocated
    once, and is then copied into the live buckets, which the parameters still view."""
    source = [(f"w{i}", torch.randn(64)) for i in range(4)]  # one 256-byte bucket each, or one bucket in all
    params = [(n, torch.zeros(64)) for n, _ in source]
    receiver = ParameterReceiver(params, bucket_mb=bucket_bytes / 2**20, backend="gloo", timeout_s=10)
    assert len(receiver.plan) == (4 if bucket_bytes == 256 else 1)
    assert [(t.shape, t.dtype, t.device) for t in receiver.staging] == [(t.shape, t.dtype, t.device)
                                                                         for t in receiver.buckets]
    live = {flat.untyped_storage().data_ptr() for flat in receiver.buckets}
    staging = [flat.data_ptr() for flat in receiver.staging]
    assert not live & {flat.untyped_storage().data_ptr() for flat in receiver.staging}
    bc = WeightSender(specs(source), bucket_mb=bucket_bytes / 2**20, host="127.0.0.1", backend="gloo",
                           device=CPU, timeout_s=10)
    try:
        bc.set_members([1])
        for version in (1, 2):
            bc.publish(version, iter([(n, t + version) for n, t in source]))
            deadline = time.time() + 10
            while (bc.job() is None or bc.job().version != version) and time.time() < deadline:
                time.sleep(0.005)
            job = bc.job()
            receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
            assert receiver.intact and all(torch.equal(p, s + version) for (_, p), (_, s) in zip(params, source))
        assert chained(len(receiver.plan), 2) == (bucket_bytes == 256)
        assert all(p.untyped_storage().data_ptr() in live for _, p in params)
        assert [flat.data_ptr() for flat in receiver.staging] == staging  # reused, not reallocated
    finally:
        bc.close()


def test_publish_broadcasts_a_bucket_before_the_rest_is_filled():
    source = [(f"w{i}", torch.full((64,), float(i))) for i in range(4)]  # one 256-byte bucket each
    bc = WeightSender(specs(source), bucket_mb=256 / 2**20, host="127.0.0.1", backend="gloo", device=CPU,
                           timeout_s=10)
    params = [(n, torch.zeros(64)) for n, _ in source]
    # Unstaged, so that bucket 0 shows in the parameters the moment it arrives.
    receiver = ParameterReceiver(params, bucket_mb=256 / 2**20, backend="gloo", timeout_s=10, staged=False)
    def receive(version):
        deadline = time.time() + 10
        while (bc.job() is None or bc.job().version != version) and time.time() < deadline:
            time.sleep(0.005)
        job = bc.job()
        receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)

    def slow_source():
        yield source[0]
        deadline = time.time() + 10  # bucket 0 must reach the receiver while publish is still here
        while time.time() < deadline and not torch.equal(params[0][1], source[0][1]):
            time.sleep(0.01)
        first_bucket_early.append(torch.equal(params[0][1], source[0][1]))
        yield from source[1:]

    first_bucket_early = []
    try:
        bc.publish(1, iter([(n, t + 100) for n, t in source]))  # no members yet: only fills a set
        bc.set_members([1])
        receive(1)
        assert all(torch.equal(p, s + 100) for (_, p), (_, s) in zip(params, source))
        t = threading.Thread(target=receive, args=(2,))
        t.start()
        bc.publish(2, slow_source())
        t.join(timeout=15)
        assert not t.is_alive() and first_bucket_early == [True]
        assert all(torch.equal(p, s) for (_, p), (_, s) in zip(params, source)) and receiver.intact
    finally:
        bc.close()


def test_one_bucket_set_makes_publish_wait_for_the_broadcast_that_reads_it():
    """sync.double_buffer=false: one full copy of the weights on rank 0, not two; a publish
    during a broadcast waits for it instead of overwriting what is being sent."""
    source = [(f"w{i}", torch.full((64,), float(i))) for i in range(4)]
    bc = WeightSender(specs(source), bucket_mb=256 / 2**20, host="127.0.0.1", backend="gloo", device=CPU,
                           timeout_s=10, double_buffer=False)
    params = [(n, torch.zeros(64)) for n, _ in source]
    receiver = ParameterReceiver(params, bucket_mb=256 / 2**20, backend="gloo", timeout_s=10)
    published = threading.Event()
    try:
        assert len(bc.buffers.sets) == 1
        bc.set_members([1])
        bc.publish(1, iter([(n, t + 100) for n, t in source]))
        job = wait_for_job(bc, [1])  # the thread now reads the set: it waits for the member to arrive
        assert job.version == 1
        second = threading.Thread(target=lambda: (bc.publish(2, iter(source)), published.set()))
        second.start()
        assert not published.wait(0.5)  # still waiting: the broadcast of version 1 holds the set
        receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        assert all(torch.equal(p, s + 100) for (_, p), (_, s) in zip(params, source))  # version 1, intact
        assert published.wait(10)
        deadline = time.time() + 10
        while (bc.job() is None or bc.job().version != 2) and time.time() < deadline:
            time.sleep(0.005)
        receiver.receive(epoch=bc.job().epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        assert all(torch.equal(p, s) for (_, p), (_, s) in zip(params, source)) and receiver.intact
        second.join(timeout=5)
    finally:
        bc.close()


def test_transport_choice_store_entry_and_config():
    cuda = torch.device("cuda", 0)
    nccl_learner = dict(learner_backend="nccl", learner_host="a", learner_gpu="GPU-1", host="a")

    def choose(requested, device, gpu, **where):
        return choose_transport(requested, device, **{**nccl_learner, **where}, gpu=gpu)

    cpu_learner = dict(learner_backend="gloo", learner_gpu=None)
    assert choose("auto", CPU, None, **cpu_learner) == "gloo"
    assert choose("auto", cuda, "GPU-2", **cpu_learner) == "gloo"  # the group is rank 0's: gloo, CUDA tensors
    assert choose("auto", cuda, "GPU-1") == "cuda_ipc"
    assert choose("auto", cuda, "GPU-2") == "nccl"
    assert choose("auto", cuda, "GPU-1", learner_host="b") == "nccl"  # same GPU model on another host
    assert choose("nccl", cuda, "GPU-1") == "nccl"  # forced: the user's call
    assert choose("gloo", cuda, "GPU-2", learner_backend="gloo") == "gloo"
    for requested, device, gpu in (("nccl", CPU, None), ("cuda_ipc", cuda, "GPU-2"), ("auto", CPU, None)):
        with pytest.raises(ValueError, match="sync.transport"):
            choose(requested, device, gpu)  # no CUDA; another GPU; a CPU actor in an NCCL group

    info = decode(LearnerInfo, encode(learner_info("auto", "gloo", CPU)), "transport entry")
    assert info == LearnerInfo(transport="auto", backend="gloo", host=socket.gethostname(), gpu=None)
    with pytest.raises(ValueError, match="malformed transport entry"):
        decode(LearnerInfo, b"\x93\x01\x02\x03", "transport entry")  # msgpack [1, 2, 3]: not the entry
    with pytest.raises(ValueError, match="malformed"):  # a field of the wrong type
        decode(LearnerInfo, encode(LearnerInfo("auto", "tcp", "a", None)), "transport entry")

    with pytest.raises(ConfigError, match=r"^sync\.transport: cuda_ipc needs model\.device=cuda"):
        build_config({"sync": {"transport": "cuda_ipc"}, "model": {"device": "cpu"}})
    with socket.socket() as s:  # transport.store_port: the broadcaster's store listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert build_config({"transport": {"store_port": port}}).transport.store_port == port
    bc = WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo", device=CPU,
                           timeout_s=5, port=port)
    try:
        assert bc.port == port
    finally:
        bc.close()


def test_a_vllm_run_refuses_torch_receivers_at_once():
    """engine="vllm" plans vLLM's packed layout, which a torch receiver cannot take: rank 0
    abandons the epoch (one log line) instead of letting anyone wait for the timeout."""
    with pytest.raises(ValueError, match="engine"):
        WeightSender([("w", (4,), torch.float32)], bucket_mb=1, host="127.0.0.1", backend="gloo", device=CPU,
                          timeout_s=5, engine="sglang")
    source = [("w0", torch.randn(16)), ("w1", torch.randn(4, 4).to(torch.bfloat16))]
    timeout_s = 30.0
    bc = WeightSender(specs(source), bucket_mb=1, host="127.0.0.1", backend="gloo", device=CPU, timeout_s=timeout_s,
                           engine="vllm")
    assert [b.dtype for b in bc.plan] == [torch.uint8] and bc.plan[0].numel == 16 * 4 + 16 * 2
    receiver = ParameterReceiver([(n, torch.zeros_like(t)) for n, t in source], bucket_mb=1, backend="gloo",
                              timeout_s=timeout_s)
    try:
        bc.set_members([1])
        bc.publish(1, iter(source))
        job = wait_for_job(bc, [1])
        started = time.monotonic()
        with pytest.raises(SyncAbandoned):
            receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        assert time.monotonic() - started < timeout_s and receiver.intact  # abandoned, not timed out
    finally:
        bc.close(wait_s=5)


def test_cuda_ipc_handle_format_round_trip_and_checks():
    plan = plan_buckets([("a", (8,), torch.float32), ("b", (4, 2), torch.float32)], bucket_bytes=32)
    entries = [IpcBucket(device=0, handle=bytes(64), size_bytes=4096, offset_bytes=512 * i,
                         ref_counter_handle=b"/torch_123_456", ref_counter_offset=i, event_handle=None,
                         event_sync_required=False, tensor_offset=0, numel=b.numel, dtype="float32")
               for i, b in enumerate(plan)]
    assert cuda_ipc.unpack(cuda_ipc.pack(entries), plan) == entries
    wrong = [msgspec.structs.replace(entries[0], numel=9)] + entries[1:]
    with pytest.raises(ValueError, match="do not match"):
        cuda_ipc.unpack(cuda_ipc.pack(wrong), plan)
    with pytest.raises(ValueError, match="not one entry per bucket"):
        cuda_ipc.unpack(cuda_ipc.pack(entries[:1]), plan)
    for bad in (msgspec.structs.replace(entries[0], handle="text"), msgspec.structs.replace(entries[0], size_bytes=-1)):
        with pytest.raises(ValueError, match="malformed"):
            cuda_ipc.unpack(cuda_ipc.pack([bad] + entries[1:]), plan)


def _ipc_actor(host: str, port: int, names, conn) -> None:
    torch.cuda.set_device(0)
    params = [(n, torch.zeros(8, 8, device="cuda")) for n in names]
    receiver = ParameterReceiver(params, bucket_mb=256 / 2**20, backend="nccl", timeout_s=30)
    epoch = conn.recv()
    receiver.receive(epoch=epoch, rank=1, world_size=2, store_host=host, store_port=port)
    conn.send((receiver.transport, [p.cpu().tolist() for _, p in params]))  # plain data: this process exits now


@pytest.mark.cuda
def test_cuda_ipc_actor_on_the_learners_gpu_gets_the_weights():
    device = torch.device("cuda", 0)
    source = [(f"w{i}", torch.randn(8, 8, device=device)) for i in range(3)]
    bc = WeightSender(specs(source), bucket_mb=256 / 2**20, host="127.0.0.1", backend="nccl",
                           device=device, timeout_s=30)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_actor, args=("127.0.0.1", bc.port, [n for n, _ in source], child), daemon=True)
    proc.start()
    try:
        bc.set_members([1])
        bc.publish(1, iter(source))
        parent.send(wait_for_job(bc, [1]).epoch)
        assert parent.poll(60)
        transport, got = parent.recv()
        assert transport == "cuda_ipc" and bc.group is None  # no NCCL group: one GPU
        assert all(g == s.cpu().tolist() for g, (_, s) in zip(got, source))
    finally:
        bc.close(wait_s=5)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.cuda(gpus=2)  # NCCL refuses two ranks on one GPU
def test_nccl_broadcast_from_the_side_stream():
    device = torch.device("cuda", 0)
    source = [(f"w{i}", torch.randn(64, device=device)) for i in range(5)]
    bc = WeightSender(specs(source), bucket_mb=256 / 2**20, host="127.0.0.1", backend="nccl",
                           device=device, timeout_s=30)
    errors = []

    def actor():
        try:
            torch.cuda.set_device(1)
            params = [(n, torch.zeros(64, device="cuda:1")) for n, _ in source]
            receiver = ParameterReceiver(params, bucket_mb=256 / 2**20, backend="nccl", timeout_s=30)
            job = wait_for_job(bc, [1])
            receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
            assert receiver.transport == "nccl"
            assert all(torch.equal(p.cpu(), s.cpu()) for (_, p), (_, s) in zip(params, source))
        except Exception as err:
            errors.append(err)

    try:
        bc.set_members([1])
        bc.publish(1, iter(source))
        t = threading.Thread(target=actor)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive() and not errors, errors
    finally:
        bc.close(wait_s=5)


@pytest.mark.cuda
def test_gloo_chain_with_gpu_buckets_on_both_ends():
    """sync.transport=gloo with a GPU learner and GPU actors: gloo's point-to-point ops
    take host memory, so rank 0 keeps its buckets on the host and members stage theirs."""
    device = torch.device("cuda", 0)
    source = [(f"w{i}", torch.randn(64, device=device)) for i in range(5)]
    bc = WeightSender(specs(source), bucket_mb=256 / 2**20, host="127.0.0.1", backend="nccl",
                           device=device, timeout_s=30, transport="gloo")
    assert bc.backend == "gloo" and all(t.device.type == "cpu" for t in bc.buffers.sets[0].tensors)
    errors, receivers = [], {}

    def actor(actor_id):
        try:
            torch.cuda.set_device(0)
            params = [(n, torch.zeros(64, device=device)) for n, _ in source]
            receivers[actor_id] = ParameterReceiver(params, bucket_mb=256 / 2**20, backend="gloo", timeout_s=30)
            job = wait_for_job(bc, [1, 2])
            receivers[actor_id].receive(epoch=job.epoch, rank=job.rank_of(actor_id), world_size=3,
                                        store_host=bc.host, store_port=bc.port)
            assert receivers[actor_id].transport == "gloo"
            assert all(torch.equal(p, s) for (_, p), (_, s) in zip(params, source))
        except Exception as err:
            errors.append(err)

    try:
        bc.set_members([1, 2])
        bc.publish(1, iter(source))
        threads = [threading.Thread(target=actor, args=(k,)) for k in (1, 2)]
        [t.start() for t in threads]
        [t.join(timeout=60) for t in threads]
        assert not any(t.is_alive() for t in threads) and not errors, errors
        assert chained(len(bc.plan), 3)
    finally:
        bc.close(wait_s=5)
