"""TorchEngine: batching, log-prob bookkeeping, EOS, versions, determinism, sync names."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch
import transformers

from async_rl.actor.engines import Completion, GenerationEngine, make_engine
from async_rl.actor.engines.torch_engine import TorchEngine, sample_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [3, 3, 11, 12]]  # deliberately ragged
# The engine under test runs the model in float64 (its bookkeeping is the same in any
# dtype), where its cached, padded forwards and a plain forward differ by ~1e-16; in
# float32 they differ by what the CPU's kernels make of the different shapes. Both then
# take the softmax of float32 logits (as the engine does in any dtype), and transformers'
# RMSNorm computes in float32, so a rounding may land on either side: a few float32
# epsilons of the logits' scale.
ROUNDING = 16 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        # A large init makes next-token distributions peaked, so greedy argmax is
        # not decided by float noise between cached and uncached forwards.
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(model_dir: str) -> TorchEngine:
    return TorchEngine(model_dir, eos_token_id=None, dtype=torch.float64)


def response_logits(model: torch.nn.Module, prompt: list[int], c: Completion) -> torch.Tensor:
    """float32 logits predicting c.tokens, from one uncached, unpadded forward over prompt + response."""
    seq = torch.tensor(prompt + c.tokens.tolist()).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=seq.to(model.device)).logits[0].float().cpu()
    # Logits at position k predict token k + 1: response tokens are predicted by
    # positions len(prompt) - 1 ... len(seq) - 2.
    return logits[len(prompt) - 1 : seq.shape[1] - 1]


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], c: Completion, temperature: float
) -> torch.Tensor:
    """Log-probs of c.tokens from one uncached, unpadded forward over prompt + response."""
    logits = response_logits(model, prompt, c)
    return torch.log_softmax(logits / temperature, -1).gather(-1, c.tokens.unsqueeze(-1)).squeeze(-1)


def assert_full_forward_logprobs(model: torch.nn.Module, prompt: list[int], c: Completion,
                                 temperature: float) -> None:
    ref = reference_logprobs(model, prompt, c, temperature)
    bound = ROUNDING * float(response_logits(model, prompt, c).abs().max()) / temperature
    assert float((c.logprobs - ref).abs().max()) <= bound, (c.logprobs, ref)


@pytest.mark.parametrize(("prompts", "kw", "message"), [
    (PROMPTS, {"n": 0, "max_new_tokens": 4}, "need n >= 1"),
    (PROMPTS, {"max_new_tokens": 0}, "need n >= 1"),
    ([[1, 2], []], {"max_new_tokens": 4}, "empty prompt"),
    (PROMPTS, {"max_new_tokens": 4, "temperature": 0.0}, "need temperature > 0"),
    (PROMPTS, {"max_new_tokens": 4, "top_p": 1.5}, "need temperature > 0"),
])
def test_generate_refuses_bad_arguments(engine: TorchEngine, prompts, kw, message) -> None:
    """GenerationEngine.generate checks the arguments for every engine, before `_generate`."""
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, **kw)


def test_generate_allows_what_greedy_ignores_and_no_prompts(engine: TorchEngine) -> None:
    assert engine.generate([], max_new_tokens=4) == []
    out = engine.generate(PROMPTS[:1], max_new_tokens=2, greedy=True, temperature=0.0, top_p=0.0)
    assert len(out) == 1 and len(out[0]) == 1 and 1 <= len(out[0][0]) <= 2


def test_factory_and_interface(model_dir: str) -> None:
    eng = make_engine("torch", model_or_path=model_dir)
    assert isinstance(eng, TorchEngine) and isinstance(eng, GenerationEngine)
    if importlib.util.find_spec("vllm") is None:  # the factory names the missing optional dependency
        with pytest.raises(RuntimeError, match=r"vLLM >= 0\.32"):
            make_engine("vllm")


def test_shapes_and_grouping(engine: TorchEngine) -> None:
    n, T = 3, 5
    gen = torch.Generator().manual_seed(1)
    out = engine.generate(PROMPTS, n=n, max_new_tokens=T, generator=gen)
    assert len(out) == len(PROMPTS) and all(len(group) == n for group in out)
    for group in out:
        for c in group:
            assert c.tokens.dtype == torch.int64 and c.tokens.shape == (T,)
            assert c.logprobs.dtype == torch.float32 and c.logprobs.shape == (T,)
            assert c.versions.dtype == torch.int32 and c.versions.shape == (T,)
            assert not c.finished  # no EOS configured
            assert bool((c.logprobs <= 0).all()) and bool(torch.isfinite(c.logprobs).all())
    # Greedy samples of one prompt are identical, and differ across prompts: this
    # pins result[i][j] to prompt i.
    greedy = engine.generate(PROMPTS, n=2, max_new_tokens=T, greedy=True)
    for i, group in enumerate(greedy):
        assert torch.equal(group[0].tokens, group[1].tokens)
        solo = engine.generate([PROMPTS[i]], max_new_tokens=T, greedy=True)[0][0]
        assert torch.equal(solo.tokens, group[0].tokens)  # batching/padding does not change results


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(engine: TorchEngine, temperature: float) -> None:
    gen = torch.Generator().manual_seed(2)
    out = engine.generate(PROMPTS, n=4, max_new_tokens=8, temperature=temperature, generator=gen)
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert_full_forward_logprobs(engine.model, prompt, c, temperature)


# A shared start of 9 tokens (as a chat template's system turn gives every prompt), ragged after it.
SHARED = [5, 1, 7, 2, 9, 3, 11, 4, 13]
SHARED_PROMPTS = [SHARED + [6], SHARED + [8, 10, 12, 14, 6], SHARED + [2, 2], SHARED]


@pytest.mark.parametrize("greedy", [False, True])
def test_shared_start_is_prefilled_once_with_the_same_results(engine: TorchEngine, monkeypatch, greedy) -> None:
    """The prompts' common first tokens are prefilled once, with the padding between them
    and each prompt's rest: the log-probs are those of a full forward over each prompt
    alone, and greedy tokens do not change."""
    forwards = []
    real = engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, *a: forwards.append(ids.shape) or real(ids, *a))
    out = engine.generate(SHARED_PROMPTS, n=2, max_new_tokens=6, greedy=greedy,
                          generator=torch.Generator().manual_seed(3))
    assert forwards[0] == (1, 8)  # the shared part, less the shortest prompt's last token
    assert forwards[1] == (4, 6)  # each prompt's rest, left-padded
    for prompt, group in zip(SHARED_PROMPTS, out):
        for c in group:
            assert_full_forward_logprobs(engine.model, prompt, c, 1.0)
    if greedy:
        monkeypatch.setattr(engine, "MIN_SHARED_PREFIX", 10 ** 6)
        alone = engine.generate(SHARED_PROMPTS, n=2, max_new_tokens=6, greedy=True)
        assert all(torch.equal(a.tokens, b.tokens) for ga, gb in zip(out, alone) for a, b in zip(ga, gb))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_kernel_is_the_one_asked_for(model_dir: str, attention: str) -> None:
    """actors.engine.attention picks the model's kernel, loaded from a path or given as a
    module; the log-probs stay those of a full forward with that kernel."""
    from_path = TorchEngine(model_dir, eos_token_id=None, dtype=torch.float64, attention=attention)
    module = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    from_module = TorchEngine(module, eos_token_id=None, dtype=torch.float64, attention=attention)
    for eng in (from_path, from_module):
        assert eng.model.config._attn_implementation == attention
        out = eng.generate(SHARED_PROMPTS, n=2, max_new_tokens=6, generator=torch.Generator().manual_seed(4))
        for prompt, group in zip(SHARED_PROMPTS, out):
            for c in group:
                assert_full_forward_logprobs(eng.model, prompt, c, 1.0)


def test_greedy_matches_argmax(engine: TorchEngine) -> None:
    a = engine.generate(PROMPTS, max_new_tokens=8, greedy=True)
    b = engine.generate(PROMPTS, max_new_tokens=8, greedy=True)
    for prompt, ga, gb in zip(PROMPTS, a, b):
        c = ga[0]
        assert torch.equal(c.tokens, gb[0].tokens)
        seq = torch.tensor(prompt + c.tokens.tolist()).unsqueeze(0)
        with torch.no_grad():
            logits = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1]
        assert torch.equal(c.tokens, logits.argmax(-1))
        # Greedy reports the temperature-1 log-prob of the chosen token.
        assert_full_forward_logprobs(engine.model, prompt, c, 1.0)


def test_top_p_logprobs_are_renormalised(engine: TorchEngine) -> None:
    temperature, top_p = 0.8, 0.7
    gen = torch.Generator().manual_seed(7)
    out = engine.generate(PROMPTS, n=4, max_new_tokens=6, temperature=temperature, top_p=top_p, generator=gen)
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            seq = torch.tensor(prompt + c.tokens.tolist()).unsqueeze(0)
            with torch.no_grad():
                logits = engine.model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float()
            for t, tok in enumerate(c.tokens.tolist()):
                probs = torch.softmax(logits[t] / temperature, -1)
                # Nucleus: the most likely tokens until their mass reaches top_p.
                kept, mass = [], 0.0
                for idx in probs.argsort(descending=True).tolist():
                    kept.append(idx)
                    mass += probs[idx].item()
                    if mass >= top_p:
                        break
                assert tok in kept
                expected = torch.log(probs[tok] / probs[kept].sum())
                bound = ROUNDING * float(logits[t].abs().max()) / temperature
                assert abs(c.logprobs[t].item() - expected.item()) <= bound


def test_tiny_top_p_is_greedy(engine: TorchEngine) -> None:
    greedy = engine.generate(PROMPTS, max_new_tokens=6, greedy=True)
    gen = torch.Generator().manual_seed(3)
    nucleus = engine.generate(PROMPTS, n=2, max_new_tokens=6, top_p=1e-6, generator=gen)
    for g, group in zip(greedy, nucleus):
        for c in group:
            assert torch.equal(c.tokens, g[0].tokens)
            # Only one token survives the nucleus, so it had probability 1.
            torch.testing.assert_close(c.logprobs, torch.zeros_like(c.logprobs))


def test_eos_stops_rows(model_dir: str, engine: TorchEngine) -> None:
    # Make the greedy first token of prompt 0 the EOS: that row must stop after one token.
    first = engine.generate([PROMPTS[0]], max_new_tokens=1, greedy=True)[0][0].tokens.item()
    eos_engine = TorchEngine(model_dir, eos_token_id=first, dtype=torch.float64)
    out = eos_engine.generate([PROMPTS[0]], n=2, max_new_tokens=10, greedy=True)[0]
    for c in out:
        assert c.finished and c.tokens.tolist() == [first] and len(c.logprobs) == 1 == len(c.versions)

    gen = torch.Generator().manual_seed(4)
    T = 12
    out = eos_engine.generate(PROMPTS, n=16, max_new_tokens=T, temperature=1.5, generator=gen)
    flat = [c for group in out for c in group]
    assert any(c.finished for c in flat) and any(not c.finished for c in flat)
    for c in flat:
        toks = c.tokens.tolist()
        if c.finished:
            assert toks[-1] == first and first not in toks[:-1]
        else:
            assert len(toks) == T and first not in toks
    # Early-stopped rows must not disturb the others: log-probs still match.
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert_full_forward_logprobs(eos_engine.model, prompt, c, 1.5)


def test_versions(engine: TorchEngine) -> None:
    engine.set_version(7)
    try:
        c = engine.generate(PROMPTS, max_new_tokens=4, greedy=True)[1][0]
        assert engine.version == 7 and c.versions.tolist() == [7] * 4

        # A version bump between decode steps (a future in-flight sync) shows per token.
        def bump() -> None:
            engine.version += 1

        engine._between_steps = bump  # type: ignore[method-assign]
        c = engine.generate(PROMPTS, max_new_tokens=4, greedy=True)[1][0]
        assert c.versions.tolist() == [7, 8, 9, 10]
    finally:
        del engine._between_steps
        engine.set_version(0)


def test_sample_rows_draws_the_given_distribution() -> None:
    """Inverse transform sampling: frequencies match each row's probabilities (within 4
    standard errors over 40k draws), zero-mass indices, first and last, never come out."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_rows(probs, generator) for _ in range(20_000)])  # [draws, 2]
    counts = torch.bincount(draws[:, 0], minlength=6).double() / len(draws)
    stderr = (probs[0].double() * (1 - probs[0].double()) / len(draws)).sqrt()
    assert torch.all((counts - probs[0].double()).abs() <= 4 * stderr + 1e-12)
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.all(draws[:, 1] == 4)


def test_sample_rows_never_passes_the_last_index_with_mass(monkeypatch) -> None:
    """u * total rounding up to total still lands on a token with mass (u = 1 forced)."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1, dtype=torch.float64))
    assert sample_rows(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), None).tolist() == [1]


def test_seeded_generator_is_reproducible(engine: TorchEngine) -> None:
    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        out = engine.generate(PROMPTS, n=4, max_new_tokens=8, temperature=0.9, top_p=0.9, generator=gen)
        return [c.tokens.tolist() for group in out for c in group]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_parameters_for_sync(model_dir: str, engine: TorchEngine) -> None:
    names = [name for name, _ in engine.parameters_for_sync()]
    fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert names == [name for name, _ in fresh.named_parameters()]
    assert "lm_head.weight" not in names  # tied to the embedding: sent once
    # The returned tensors are the live ones: an in-place write changes generation.
    embed = dict(engine.parameters_for_sync())["model.embed_tokens.weight"]
    before = engine.generate(PROMPTS, max_new_tokens=4, greedy=True)
    embed.mul_(-1.0)  # frozen parameters: in-place writes need no torch.no_grad()
    after = engine.generate(PROMPTS, max_new_tokens=4, greedy=True)
    embed.mul_(-1.0)
    assert [g[0].tokens.tolist() for g in before] != [g[0].tokens.tolist() for g in after]


@pytest.mark.cuda
def test_cuda(model_dir: str) -> None:
    eng = TorchEngine(model_dir, device="cuda")
    for gen in (torch.Generator().manual_seed(8), torch.Generator(device="cuda").manual_seed(8)):
        out = eng.generate(PROMPTS, n=2, max_new_tokens=6, temperature=0.7, generator=gen)
        for prompt, group in zip(PROMPTS, out):
            for c in group:
                assert c.tokens.device.type == "cpu"  # results always come back on the CPU
                ref = reference_logprobs(eng.model, prompt, c, 0.7)
                torch.testing.assert_close(c.logprobs, ref, atol=1e-4, rtol=0)


def test_throughput(model_dir: str) -> None:
    engine = TorchEngine(model_dir, eos_token_id=None)  # float32, as actors run
    prompts = [[1 + (i % 12), 2, 3, 4, 5][: 3 + i % 3] for i in range(512)]
    gen = torch.Generator().manual_seed(0)
    engine.generate(prompts[:8], max_new_tokens=4, generator=gen)  # warm-up
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=4, generator=gen)
    seconds = time.perf_counter() - start
    n_tokens = sum(len(c) for group in out for c in group)
    rate = n_tokens / seconds
    print(f"\nTorchEngine, 1 thread: batch 512 x 4 new tokens: {rate:,.0f} tokens/s ({seconds * 1e3:.1f} ms)")
