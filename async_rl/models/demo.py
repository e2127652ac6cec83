"""The built-in demo policy: a ~132k-parameter character-level Llama for addition.

``build_demo_model`` writes an ordinary Hugging Face model directory (config,
safetensors, tokenizer, generation config), so every part of the system treats it
like any other policy. The weights come from a short supervised warm start that is
stopped on purpose at low held-out accuracy (~30%): RL then has something to do,
yet most prompt groups contain both right and wrong samples. A model that is
confidently wrong gives all-wrong groups, whose group-relative advantages are all
zero, and RL stalls; the warm start therefore also checks that the right answer is
reachable by sampling, not only the greedy accuracy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from async_rl.tasks.arithmetic import ArithmeticTask
from async_rl.tasks.base import Prompt, Task

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "0123456789+="
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
INFO_FILE = "async_rl_demo.json"  # how the warm start went; ignored by loaders


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, ``<bos>`` prepended."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join characters without the WordLevel spaces
    pair = "<bos> $A <bos> $B"
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", pair=pair, special_tokens=[("<bos>", BOS_ID)])
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=64,
    )


# vLLM's CPU attention implements head sizes from 32 up: with vLLM actors the demo's four
# heads are 32 wide instead of 16 (q, k, v project the 64-wide stream to 128; 165k
# parameters instead of 132k). Two heads of 32 in the same 64 would keep the size, but
# their warm start stalled below 0.2 accuracy in 3000 steps; four of 32 learn as fast as
# four of 16.
VLLM_HEAD_DIM = 32


def build_config(head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(SPECIAL_TOKENS) + len(CHARACTERS),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        intermediate_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def _left_pad(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def greedy_responses(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], max_new_tokens: int
) -> list[str]:
    """Greedy completions (text before ``<eos>``), batched, without a KV cache.

    Sequences here are a dozen tokens, so recomputing the prefix is cheaper than
    cache bookkeeping and keeps this independent of transformers' generate().
    Special tokens other than ``<eos>`` are kept in the text, so they never pass as
    a correct answer.
    """
    ids, mask = _left_pad(tokenizer(list(prompts))["input_ids"])
    out = torch.empty((len(prompts), 0), dtype=torch.long)
    for _ in range(max_new_tokens):
        # Left padding shifts real tokens right; positions must still start at 0.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], 1)
        ids = torch.cat([ids, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    texts = []
    for row in out.tolist():
        row = row[: row.index(EOS_ID)] if EOS_ID in row else row
        texts.append(tokenizer.decode(row, skip_special_tokens=False))
    return texts


def greedy_accuracy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task, prompts: Sequence[Prompt]
) -> float:
    """Mean task reward of greedy answers (the accuracy for 0/1 rewards)."""
    budget = max(len(p.answer) for p in prompts) + 1
    responses = greedy_responses(model, tokenizer, [p.text for p in prompts], budget)
    return sum(task.reward(p.text, r, p.answer) for p, r in zip(prompts, responses)) / len(prompts)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, attention mask, labels


def _teacher_forced_batch(tokenizer: PreTrainedTokenizerFast, prompts: Sequence[Prompt]) -> Batch:
    """``<bos> prompt answer <eos>``, right-padded; labels only on answer and ``<eos>``."""
    # Two batched tokenizer calls: per-prompt calls cost more than the model step.
    heads = tokenizer([p.text for p in prompts])["input_ids"]
    tails = tokenizer([p.answer for p in prompts], add_special_tokens=False)["input_ids"]
    seqs = [h + t + [EOS_ID] for h, t in zip(heads, tails)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, h) in enumerate(zip(seqs, heads)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, len(h) : len(s)] = ids[i, len(h) : len(s)]
    return ids, mask, labels


@torch.no_grad()
def answer_statistics(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[Prompt] | Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced pass over ``<bos> prompt answer <eos>``.

    Returns ``(greedy_exact, p_correct)`` per prompt: whether greedy decoding yields
    exactly ``answer <eos>`` (true iff the argmax is the right token at every answer
    position, given the right prefix), and the probability that sampling at
    temperature 1 yields it. Four times cheaper than decoding. ``prompts`` may be
    an already encoded batch, so a fixed eval set is tokenized once.
    """
    is_encoded = isinstance(prompts, tuple) and isinstance(prompts[0], torch.Tensor)
    ids, mask, labels = prompts if is_encoded else _teacher_forced_batch(tokenizer, prompts)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target, on = labels[:, 1:], labels[:, 1:] != -100
    tok_logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    hit = (logits.argmax(-1) == target) | ~on
    return hit.all(-1), (tok_logp * on).sum(-1).exp()


def mixed_group_fraction(p_correct: torch.Tensor, group_size: int = 8) -> float:
    """Expected share of GRPO groups with both right and wrong samples (nonzero signal)."""
    return float((1 - p_correct**group_size - (1 - p_correct) ** group_size).mean())


def _warm_start(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task, *, target_accuracy: float,
    min_mixed_fraction: float, lr: float, batch_size: int, check_every: int, max_steps: int,
) -> dict[str, Any]:
    """Teacher-forced training until the first check that meets both stop criteria."""
    eval_set = task.eval_prompts()
    eval_batch = _teacher_forced_batch(tokenizer, eval_set)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    start, near = time.perf_counter(), False
    for step in range(1, max_steps + 1):
        model.train()
        batch = [task.train_prompt((step - 1) * batch_size + i) for i in range(batch_size)]
        ids, mask, labels = _teacher_forced_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        # Accuracy can jump by 0.2 within a few steps here; once halfway to the
        # target, check every step so the stop does not overshoot.
        if step % check_every and not near:
            continue
        model.eval()
        # Cheap gate first (one forward pass); the real greedy decode, scored by the
        # task's own reward, then decides.
        exact, p_correct = answer_statistics(model, tokenizer, eval_batch)
        gate, mixed = exact.float().mean().item(), mixed_group_fraction(p_correct)
        near = gate >= target_accuracy / 2
        if gate < target_accuracy or mixed < min_mixed_fraction:
            continue
        accuracy = greedy_accuracy(model, tokenizer, task, eval_set)
        if accuracy >= target_accuracy:
            return {"steps": step, "eval_accuracy": accuracy, "mixed_group_fraction": mixed,
                    "loss": loss.item(), "seconds": round(time.perf_counter() - start, 3)}
    raise RuntimeError(f"demo warm start did not reach accuracy {target_accuracy} in {max_steps} steps")


def build_demo_model(
    out_dir: Path | str,
    *,
    seed: int = 0,
    task: Task | None = None,
    target_accuracy: float = 0.3,
    min_mixed_fraction: float = 0.4,
    lr: float = 3e-3,
    batch_size: int = 64,
    check_every: int = 5,
    max_steps: int = 3000,
    num_threads: int = 1,
    head_dim: int = 16,
) -> Path:
    """Write the demo policy to ``out_dir`` and return that path.

    Training stops at the first check (every ``check_every`` steps; every step once
    halfway to the target) where held-out greedy accuracy reaches
    ``target_accuracy`` and at least ``min_mixed_fraction`` of 8-sample groups are
    expected to be mixed (see module docstring).
    Deterministic given ``seed`` and ``num_threads``. One thread by default: the
    model is too small to gain from more, and on a busy 2-core machine two OpenMP
    threads made a step ~100x slower (measured). Raises RuntimeError if
    ``max_steps`` pass without meeting the stop criteria.
    """
    out = Path(out_dir)
    task = task if task is not None else ArithmeticTask(seed=seed)
    for p in [*task.eval_prompts(), task.train_prompt(0)]:
        if any(c not in CHARACTERS for c in p.text + p.answer):
            raise ValueError(f"demo model vocabulary is {CHARACTERS!r}; prompt {p.text!r} -> {p.answer!r} is outside it")
    tokenizer = build_tokenizer()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(build_config(head_dim))
        info = _warm_start(model, tokenizer, task, target_accuracy=target_accuracy,
                           min_mixed_fraction=min_mixed_fraction, lr=lr, batch_size=batch_size,
                           check_every=check_every, max_steps=max_steps)
    finally:
        torch.set_num_threads(previous_threads)

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, max_new_tokens=8, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Name the portable class rather than transformers 5's "TokenizersBackend", so
    # older transformers and other loaders (vLLM) read the directory too.
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / INFO_FILE).write_text(json.dumps({"seed": seed, **info}, indent=2) + "\n")
    return out
