"""async_rl/lora on real peft: adapters that start as the base, names both sides share,
targets checked against the model, the adapter directory peft loads, and an adapter-only
sync over a real gloo broadcast after which the actor's engine answers as the learner's
merged model does (over CUDA IPC where a GPU is visible)."""
import copy
import logging
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

peft = pytest.importorskip("peft")

from conftest import wait_for_job  # noqa: E402

from async_rl.actor.engines.torch_engine import TorchEngine  # noqa: E402
from async_rl.lora.adapters import adapter_parameters, base_only, check_targets, is_adapter, save_adapter, with_adapters  # noqa: E402
from async_rl.lora.config import LoraConfig  # noqa: E402
from async_rl.weight_transfer.receiver import ParameterReceiver  # noqa: E402
from async_rl.weight_transfer.sender import WeightSender  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
X = torch.tensor([[1, 5, 9, 12, 3, 7, 7, 2, 9, 4]])


def _trained(chat_model, seed=0):
    """The learner's policy after some training: its adapters moved off their init."""
    model = with_adapters(AutoModelForCausalLM.from_pretrained(chat_model), LORA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_fresh_adapters_compute_the_base_and_only_they_train(chat_model):
    base = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    model = with_adapters(copy.deepcopy(base), LORA).eval()
    torch.testing.assert_close(model(input_ids=X).logits, base(input_ids=X).logits, rtol=0, atol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in adapter_parameters(model)]
    assert trainable == names and len(names) == 2 * 3 * base.config.num_hidden_layers
    assert all(is_adapter(n) and ("lora_A" in n or "lora_B" in n) for n in names)
    cfg = model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (4, 8.0, {"q_proj", "v_proj", "down_proj"})


def test_base_only_computes_the_base_exactly_and_leaves_training_as_it_was(chat_model):
    base = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    model = _trained(chat_model)
    with torch.no_grad():
        adapted = model(input_ids=X).logits
        with base_only(model):
            torch.testing.assert_close(model(input_ids=X).logits, base(input_ids=X).logits, rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids=X).logits, adapted, rtol=0, atol=0)
    assert all(p.requires_grad for _, p in adapter_parameters(model))


def test_targets_the_model_lacks_are_one_line(chat_model):
    assert check_targets(str(chat_model), LORA.target_modules) is None
    problem = check_targets(str(chat_model), ["q_proj", "c_attn"])
    assert problem.startswith("model.lora.target_modules: LlamaForCausalLM has no linear layer named 'c_attn'")
    assert "\n" not in problem


def test_the_adapter_directory_loads_with_peft_on_the_base(chat_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoTokenizer

    model = _trained(chat_model)
    save_adapter(model.named_parameters(), LORA, str(chat_model), AutoTokenizer.from_pretrained(chat_model),
                 tmp_path / "final")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat_model), tmp_path / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=X).logits, model(input_ids=X).logits, rtol=0, atol=0)
    assert (tmp_path / "final" / "tokenizer.json").exists() and not (tmp_path / "final.partial").exists()


def test_an_adapter_only_sync_gives_the_actor_the_learners_merged_model(chat_model):
    learner = _trained(chat_model)
    engine = TorchEngine(str(chat_model), eos_token_id=None, lora=LORA)
    synced = engine.parameters_for_sync()
    sent = adapter_parameters(learner)
    assert [n for n, _ in synced] == [n for n, _ in sent]
    full = sum(p.numel() for p in learner.parameters())
    assert sum(p.numel() for _, p in sent) < 0.2 * full  # the tiny model; SmolLM2's share is in docs/lora.md
    bc = WeightSender([(n, tuple(p.shape), p.dtype) for n, p in sent], bucket_mb=0.001, host="127.0.0.1",
                           backend="gloo", device=torch.device("cpu"), timeout_s=20)
    try:
        bc.set_members([1])
        bc.publish(1, iter([(n, p.detach()) for n, p in sent]))
        job = wait_for_job(bc, [1])
        receiver = ParameterReceiver(synced, bucket_mb=0.001, backend="gloo", timeout_s=20)
        t = threading.Thread(target=receiver.receive, kwargs=dict(epoch=job.epoch, rank=job.rank_of(1), world_size=2,
                                                                 store_host=bc.host, store_port=bc.port))
        t.start()
        t.join(timeout=30)
    finally:
        bc.close()
    merged = copy.deepcopy(learner).merge_and_unload().eval()
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(chat_model).eval()
        # Received, not yet folded in: the engine still answers as the last whole version.
        torch.testing.assert_close(engine.model(input_ids=X).logits, base(input_ids=X).logits, rtol=0, atol=1e-5)
        engine.set_version(1)  # the actor's step once a whole sync has arrived
        torch.testing.assert_close(engine.model(input_ids=X).logits, merged(input_ids=X).logits, rtol=0, atol=1e-5)
    prompts = [X[0].tolist(), X[0, :4].tolist()]
    got = engine.generate(prompts, n=1, max_new_tokens=8, greedy=True)
    with torch.no_grad():
        want = [merged.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert [c.tokens.tolist() for [c] in got] == want


def _ipc_lora_actor(chat_model: str, host: str, port: int, epoch: int, conn) -> None:
    torch.cuda.set_device(0)
    engine = TorchEngine(chat_model, device="cuda", eos_token_id=None, lora=LORA)
    receiver = ParameterReceiver(engine.parameters_for_sync(), bucket_mb=0.001, backend="nccl", timeout_s=30)
    receiver.receive(epoch=epoch, rank=1, world_size=2, store_host=host, store_port=port)
    engine.set_version(1)
    with torch.no_grad():
        logits = engine.model(input_ids=X.cuda()).logits.cpu().tolist()
    [[completion]] = engine.generate([X[0].tolist()], n=1, max_new_tokens=8, greedy=True)
    conn.send((receiver.transport, logits, completion.tokens.tolist()))  # plain data: this process exits now


@pytest.mark.cuda
def test_an_adapter_only_cuda_ipc_sync_gives_the_actor_the_learners_merged_model(chat_model):
    """The same on one GPU: the actor maps the learner's adapter buckets over CUDA IPC."""
    import multiprocessing as mp

    device = torch.device("cuda", 0)
    learner = _trained(chat_model).to(device)
    sent = adapter_parameters(learner)
    bc = WeightSender([(n, tuple(p.shape), p.dtype) for n, p in sent], bucket_mb=0.001, host="127.0.0.1",
                           backend="nccl", device=device, timeout_s=30)
    parent, child = mp.get_context("spawn").Pipe()
    proc = None
    try:
        bc.set_members([1])
        bc.publish(1, iter([(n, p.detach()) for n, p in sent]))
        job = wait_for_job(bc, [1])
        proc = mp.get_context("spawn").Process(target=_ipc_lora_actor, daemon=True,
                                               args=(str(chat_model), bc.host, bc.port, job.epoch, child))
        proc.start()
        assert parent.poll(90)
        transport, logits, tokens = parent.recv()
    finally:
        bc.close(wait_s=5)
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    merged = copy.deepcopy(learner).merge_and_unload().eval()
    with torch.no_grad():
        want = merged(input_ids=X.to(device)).logits.cpu()
        greedy = merged.generate(X.to(device), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, X.shape[1]:].tolist()
    assert transport == "cuda_ipc"
    torch.testing.assert_close(torch.tensor(logits), want, rtol=0, atol=1e-4)
    assert tokens == greedy


def test_folding_version_after_version_drifts_by_rounding_alone(chat_model):
    """The float32 engine merges each version into its weights over the last one
    (lora/folded.py): after many versions it still answers as the learner's merged
    model, where a bf16 engine keeps its adapters unmerged."""
    engine = TorchEngine(str(chat_model), eos_token_id=None, lora=LORA)
    assert engine._folded is not None
    assert TorchEngine(str(chat_model), eos_token_id=None, lora=LORA, dtype=torch.bfloat16)._folded is None
    received = dict(engine.parameters_for_sync())
    versions = 100
    for version in range(1, versions + 1):
        learner = _trained(chat_model, seed=version)
        with torch.no_grad():
            for name, p in adapter_parameters(learner):
                received[name].copy_(p)
        engine.set_version(version)
    merged = learner.merge_and_unload().eval()
    # Each fold rounds a weight twice, by at most half a float32 ulp each time: after
    # `versions` folds it is within `versions` float32 epsilons of its tensor's scale, and
    # the logits computed from such weights within as much of theirs.
    drift = versions * torch.finfo(torch.float32).eps
    want = {n: p.detach() for n, p in merged.named_parameters()}
    folded = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): p.detach()
              for n, p in engine.model.named_parameters() if "lora_" not in n}
    assert folded.keys() == want.keys()
    for name, w in want.items():
        assert float((folded[name] - w).abs().max()) <= drift * float(w.abs().max()), name
    with torch.no_grad():
        got, logits = engine.model(input_ids=X).logits, merged(input_ids=X).logits
    assert float((got - logits).abs().max()) <= drift * float(logits.abs().max())


def test_lora_at_a_full_models_learning_rate_gets_one_line_naming_the_setting(chat_model, caplog):
    from async_rl.config import load_config
    from async_rl.run.checks import check_lora

    with caplog.at_level(logging.WARNING, logger="async_rl.launch"):
        check_lora(load_config(None, [f"model.path={chat_model}", "model.lora.rank=8", "train.lr=2e-5"]))
        (line,) = [r.getMessage() for r in caplog.records]
        caplog.clear()
        check_lora(load_config(None, [f"model.path={chat_model}", "model.lora.rank=8", "train.lr=2e-4"]))
        assert not caplog.records
    assert line.startswith("model.lora with train.lr=2e-05") and "docs/lora.md" in line and "train.lr=2e-4" in line
