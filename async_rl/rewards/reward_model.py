"""A learned reward model as a reward source: a Hugging Face sequence-classification
model with one output (the `AutoModelForSequenceClassification` head that TRL's
RewardTrainer and OpenRLHF's reward models train), scoring prompt and response.

The pair is written as the tokenizer's chat template writes a user turn and the
assistant's answer when it has one, else as prompt + response; the score is the head's
output at the last token (transformers' own pooling: the last token that is not
padding). Batches are padded on the right, so each row's score is its own.

A reward component (`reward: reward_model`, `model: PATH`) runs it in the reward's
worker processes (one float32 copy per worker), which score a chunk of calls in batches
of 8 on one torch thread, or a prompt's group at a time beside a group-scope component
(rewards/worker.py); in the actor's thread (`reward.executor: thread`) it scores one
sample at a time.
"""
from __future__ import annotations

from pathlib import Path

REWARD_MODEL = "reward_model"  # a component's `reward` that means a reward model at `model`


class RewardModel:
    def __init__(self, path: str | Path, *, batch_size: int = 8, max_tokens: int = 4096) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.batch_size, self.max_tokens = torch, batch_size, max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: a reward model has one output, this one has "
                             f"{self.model.config.num_labels} (num_labels)")
        if self.model.config.pad_token_id is None:  # transformers finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, prompt: str, response: str) -> str:
        """The pair as the model reads it."""
        if self.templated:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return prompt + response

    def score_batch(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One score per (prompt, response), computed `batch_size` at a time."""
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            texts = [self.text(p, r) for p, r in zip(prompts[start:start + self.batch_size],
                                                     responses[start:start + self.batch_size])]
            batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                   max_length=self.max_tokens, add_special_tokens=not self.templated)
            with self.torch.inference_mode():
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> float:
        return self.score_batch([prompt], [response])[0]
