"""Greedy evaluation on the task's held-out prompts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalResult:
    accuracy: float      # fraction of prompts with reward >= 1 (exact match for the demo)
    reward_mean: float


def evaluate(engine, tokenizer, task, *, max_new_tokens: int, batch_size: int = 512) -> EvalResult:
    prompts = task.eval_prompts()
    rewards: list[float] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        token_ids = [tokenizer(p.text)["input_ids"] for p in chunk]
        outputs = engine.generate(token_ids, n=1, max_new_tokens=max_new_tokens, greedy=True)
        for prompt, (completion,) in zip(chunk, outputs):
            response = tokenizer.decode(completion.tokens.tolist(), skip_special_tokens=True)
            rewards.append(float(task.reward(prompt.text, response, prompt.answer)))
    n = max(1, len(rewards))
    return EvalResult(accuracy=sum(r >= 1.0 for r in rewards) / n, reward_mean=sum(rewards) / n)
