"""A plain-PyTorch generation engine: batched sampling with a KV cache.

Works with any Hugging Face causal LM (CPU or CUDA). Prompts are left-padded so
that every row's next token sits in the last column, which lets one decode step
serve the whole batch with a single [B, 1] forward.

Four savings that matter for real models, where a prompt (chat template, system turn)
is often longer than its responses and response lengths vary widely:
- each distinct prompt is prefilled once and its KV cache repeated for its `n`
  samples (`Cache.batch_repeat_interleave`), instead of prefilling `n` copies;
- the tokens every prompt of a call starts with (a chat template's system turn) are
  prefilled once for the call: the prompts' own tokens follow them, left-padded, so
  the padding sits between the shared part and each prompt's rest, under a zero
  attention mask, with positions that continue the shared part's;
- the KV cache keeps room for the responses (engines/kv_cache.py), so a decoding step
  writes its keys and values in place instead of copying every layer's cache;
- rows that have stopped leave the batch (`Cache.batch_select_indices`) once they are
  a quarter of it, so the decode steps of the long responses do not carry them.
None changes a sampled token or a log-prob: rows never interact.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import torch
from torch import nn

from async_rl.actor.engines.base import Completion, GenerationEngine


def process_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Return log-probs [B, V] of the distribution we actually sample from.

    Temperature scaling first, then top-p (nucleus) truncation and renormalisation.
    The learner's importance ratios need the log-prob under *this* distribution,
    not the raw model's, so sampling and recording share one function.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        # Mass strictly before each token; keep a token while that is below top_p,
        # which always keeps the most likely token.
        mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of `probs` [B, V] (rows summing to 1) by inverse transform
    sampling (Devroye, Non-Uniform Random Variate Generation, 1986, sec. 2.1): the first
    index whose float64 cumulative mass exceeds u * total, u ~ U[0, 1).

    Exact up to float64 rounding, like torch.multinomial, which on a CPU draws an
    exponential variate per vocabulary entry: for a small model's 49k-token vocabulary
    that costs more per decoding step than a cumulative sum.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    # A CPU generator with a CUDA engine: draw where the generator lives. By type:
    # torch.Generator(device="cuda") reports "cuda", the logits "cuda:0".
    where = generator.device if generator is not None else probs.device
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=where).to(probs.device)
    total = cdf[:, -1:].contiguous()  # searchsorted copies (and warns about) a strided one
    tok = torch.searchsorted(cdf, u * total, right=True)
    # u * total may round up to total: then the last index with mass, never a zero-mass one.
    last = torch.searchsorted(cdf, total)
    return torch.minimum(tok, last).squeeze(-1)


class TorchEngine(GenerationEngine):
    """Sampling engine around a Hugging Face causal LM held in this process.

    A ready module is taken over, not copied: it is moved/cast in place, put in
    eval mode and frozen (so sync code can write into its parameters in place).
    """

    MIN_SHARED_PREFIX = 8  # fewer shared tokens are not worth a forward of their own

    def __init__(
        self,
        model_or_path: nn.Module | str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        stop_strings: Sequence[str] = (),
        tokenizer: object | None = None,
        lora=None,
        attention: str | None = None,
        compile: bool = False,
    ) -> None:
        """`stop_strings` end a response as soon as its text contains one (the token that
        completes it is kept); they need the `tokenizer` to read the text. `lora` (the
        config's model.lora): the model gets the learner's adapters, and a sync carries
        those alone; in float32 they stay merged into the weights, a sync lands aside and
        `set_version` folds it in (lora/folded.py). `attention`: the HF attention kernel
        ("sdpa", "eager"; None keeps the model's). `compile`: each transformer block
        compiled (models/compiled.py), for prefill and decode alike."""
        if isinstance(model_or_path, nn.Module):
            model = model_or_path
            if attention is not None:
                model.set_attn_implementation(attention)
        else:
            from transformers import AutoModelForCausalLM  # heavy import, only when loading

            kernel = {"attn_implementation": attention} if attention else {}
            model = AutoModelForCausalLM.from_pretrained(str(model_or_path), dtype=dtype, **kernel)
        self.device = torch.device(device)
        self.lora = lora
        base = model
        if lora is not None:
            from async_rl.lora.adapters import with_adapters

            model = with_adapters(model, lora)
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.model.requires_grad_(False)  # weights only change through in-place sync
        if compile:
            from async_rl.models.compiled import compile_blocks

            compile_blocks(self.model)
        self.version = 0
        self._folded = None
        if lora is not None:
            from async_rl.lora.folded import FoldedAdapters, foldable

            self._folded = FoldedAdapters(self.model) if foldable(dtype) else None

        # Unset ids fall back to the model config (getattr on None gives None).
        config = getattr(self.model, "config", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        # HF configs may hold one EOS id or a list of them.
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.eos_token_ids = [int(e) for e in eos]
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        # Padding only ever sits under a zero attention mask, so any valid id works.
        self.pad_token_id = int(pad_token_id)
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer")
        self.stop_strings = [s for s in stop_strings if s]
        self._tokenizer = tokenizer
        # Every token decodes to at least one character (a few more for byte pieces), so
        # the last len(longest stop string) + 4 tokens hold any stop string just completed.
        self._stop_window = max((len(s) for s in self.stop_strings), default=0) + 4
        # Only the last position's logits are needed; HF models that support
        # `logits_to_keep` then skip the [B, T, V] projection at prefill.
        params = inspect.signature(base.forward).parameters  # peft's wrapper passes them through
        self._logits_to_keep = "logits_to_keep" in params
        # transformers 5.x renamed the KV-cache argument (`past_key_values` is deprecated).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    # ----------------------------------------------------------------- protocol

    def set_version(self, version: int) -> None:
        if self._folded is not None:  # a whole version of the adapters has arrived
            self._folded.fold()
        self.version = int(version)

    def parameters_for_sync(self) -> list[tuple[str, torch.Tensor]]:
        # named_parameters() yields a tied tensor once, in registration order,
        # which is the same on the learner's copy of the same architecture.
        if self._folded is not None:
            return self._folded.received
        if self.lora is not None:
            from async_rl.lora.adapters import adapter_parameters

            return adapter_parameters(self.model)
        return list(self.model.named_parameters())

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float,
                  greedy: bool, generator: torch.Generator | None) -> list[list[Completion]]:
        dev = self.device
        cache = self._new_cache()
        shared = self._prefill_shared(prompts, cache)
        input_ids, mask = self._left_pad([p[shared:] for p in prompts])
        mask = torch.cat([torch.ones(len(prompts), shared, dtype=torch.long, device=dev), mask], dim=1)
        B, P = len(prompts) * n, mask.shape[1]
        # Whole-run buffers, indexed by original row; the decode loop works on `rows`,
        # the original ids of the rows still generating.
        tokens = torch.full((B, max_new_tokens), self.pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=dev)
        versions = torch.zeros(B, max_new_tokens, dtype=torch.int32, device=dev)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        # The attention mask grows by one column per step; it is passed as a prefix view.
        full_mask = torch.ones(B, P + max_new_tokens, dtype=torch.long, device=dev)
        full_mask[:, :P] = mask.repeat_interleave(n, dim=0)
        # Left padding shifts real tokens right; positions must still start at 0
        # for each row's first real token (pads get 0, they are masked anyway).
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        next_pos = (position_ids[:, -1:] + 1).repeat_interleave(n, dim=0)
        logits = self._forward(input_ids, mask, position_ids, cache)  # one prefill per distinct prompt
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        cache.reserve(max_new_tokens)  # decoding steps write in place from here
        rows = torch.arange(B, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # per current row

        for t in range(max_new_tokens):
            if t > 0:
                # Never before the first token: a response's oldest token, hence its
                # version, stays that of the weights its prompt was admitted for.
                self._between_steps()
                if 4 * int(done.sum()) >= len(rows):  # drop stopped rows from the batch
                    keep = (~done).nonzero().squeeze(-1)
                    cache.batch_select_indices(keep)
                    rows, done, next_pos = rows[keep], done[keep], next_pos[keep]
                logits = self._forward(tokens[rows, t - 1: t], full_mask[rows, : P + t], next_pos, cache)
                next_pos = next_pos + 1
            tok, lp = self._sample(logits, temperature, top_p, greedy, generator)
            # Rows already done keep padding; their samples are discarded.
            tok = tok.masked_fill(done, self.pad_token_id)
            tokens[rows, t] = tok
            logprobs[rows, t] = lp
            versions[rows, t] = self.version  # read per step: a sync may land in between
            stop = torch.isin(tok, self._eos) if self._eos.numel() else torch.zeros_like(done)
            if self.stop_strings:
                stop = stop | self._stop_string_hit(tokens, rows, t, done)
            stop &= ~done
            lengths[rows[stop]] = t + 1
            finished[rows[stop]] = True
            done |= stop
            if bool(done.all()):
                break

        return self._collect(tokens, logprobs, versions, lengths, finished, len(prompts), n)

    def _stop_string_hit(self, tokens: torch.Tensor, rows: torch.Tensor, t: int, done: torch.Tensor) -> torch.Tensor:
        """Which current rows' text just completed a stop string (decoded over a short window)."""
        hit = torch.zeros_like(done)
        window = tokens[rows, max(0, t + 1 - self._stop_window): t + 1].tolist()
        for i, ids in enumerate(window):
            if not done[i]:
                text = self._tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[union-attr]
                hit[i] = any(s in text for s in self.stop_strings)
        return hit

    # ------------------------------------------------------------------ helpers

    def _prefill_shared(self, prompts: list[list[int]], cache: object) -> int:
        """Prefill the prompts' common first tokens once into `cache`, repeated for every
        prompt; returns how many (0: nothing shared). Each prompt keeps at least one
        token of its own, whose forward gives its first logits."""
        if len(prompts) < 2:
            return 0
        shared = min(len(os.path.commonprefix(prompts)), min(len(p) for p in prompts) - 1)
        if shared < self.MIN_SHARED_PREFIX:
            return 0
        ids = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=self.device)
        ones = torch.ones_like(ids)
        self._forward(ids, ones, (ones.cumsum(-1) - 1), cache)
        cache.batch_repeat_interleave(len(prompts))
        return shared

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad the prompts into [len(prompts), longest] ids and attention mask."""
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _new_cache(self) -> object:
        from async_rl.actor.engines.kv_cache import ReservingCache  # imports transformers

        # With the config the cache knows each layer's kind (full or sliding window).
        return ReservingCache(config=getattr(self.model, "config", None))

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: object,
    ) -> torch.Tensor:
        """One cached forward; returns float32 logits [B, V] at the last position."""
        kwargs: dict = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
        )
        kwargs[self._cache_arg] = cache
        if self._logits_to_keep:
            # An index tensor, not the int 1: HF slices hidden[:, -1:, :], a strided view that
            # torch's matmul turns into a bmm against B expanded copies of the [H, V] head
            # (seconds per prefill of 50 prompts); indexing gathers a contiguous [B, 1, H].
            last = input_ids.shape[1] - 1
            kwargs["logits_to_keep"] = torch.tensor([last], device=self.device) if last else 1
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float()

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        temperature: float,
        top_p: float,
        greedy: bool,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick one token per row; return (token ids [B], their log-probs [B])."""
        if greedy:
            # Greedy has no sampling temperature; report the model's own log-prob.
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(dim=-1)
        else:
            logp = process_logits(logits, temperature, top_p)
            tok = sample_rows(logp.exp(), generator)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def _collect(
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        versions: torch.Tensor,
        lengths: torch.Tensor,
        finished: torch.Tensor,
        num_prompts: int,
        n: int,
    ) -> list[list[Completion]]:
        """Cut each row at its length and group rows by prompt (one pass, on CPU)."""
        tokens, logprobs, versions = tokens.cpu(), logprobs.cpu(), versions.cpu()
        lens, done = lengths.tolist(), finished.tolist()
        out: list[list[Completion]] = []
        for i in range(num_prompts):
            group = []
            for r in range(i * n, (i + 1) * n):
                L = lens[r]
                group.append(
                    Completion(
                        tokens=tokens[r, :L].clone(),
                        logprobs=logprobs[r, :L].clone(),
                        versions=versions[r, :L].clone(),
                        finished=done[r],
                    )
                )
            out.append(group)
        return out
