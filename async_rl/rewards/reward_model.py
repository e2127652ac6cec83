"""A learned reward model as a reward source: a Hugging Face sequence-classification
model with one output (the `AutoModelForSequenceClassification` head that TRL's
RewardTrainer and OpenRLHF's reward models train), scoring prompt and response.

The pair is written as the tokenizer's chat template writes a user turn and the
assistant's answer when it has one, else as prompt + response; the score is the head's
output at the last token (transformers' own pooling: the last token that is not
padding). Batches are padded on the right, so each row's score is its own. A model
`async-rl rm` wrote carries its scores' mean and std over its training pairs: scores are
normalized by them (`normalize`, default on) and clipped to +-`clip` when it is set.

A reward component (`reward: reward_model`, `model: PATH`) runs it in the reward's
worker processes (one float32 copy per worker), which score a chunk of calls in batches
of 8 on one torch thread, or a prompt's group at a time beside a group-scope component
(rewards/worker.py); in the actor's thread (`reward.executor: thread`) it scores one
sample at a time; with `placement: server` one copy in the reward server scores every
actor's samples, a batch at a time (async_rl/reward_server/).

A process reward model (`reward: prm`) is the same kind of model read at more places:
the response is cut into steps at `separator`, and one forward pass over the rendered
pair gives the head's output at the last token of each step (the token holding the
step's last character, by the tokenizer's offsets): with causal attention each is the
score of the text up to that step, what the model would say had the response ended
there. `aggregate: steps` returns them as step rewards (StepRewards, for
train.advantage.name=grpo_process); `min`, `last` or `mean` one score.
"""
from __future__ import annotations

import json
from pathlib import Path

from async_rl.rewards.outcome import StepRewards

REWARD_MODEL = "reward_model"  # a component's `reward` that means a reward model at `model`
PROCESS_REWARD_MODEL = "prm"  # ... a process reward model: its head read at each step's end


NORMALIZATION_FILE = "reward_normalization.json"  # the scores' mean and std, as `async-rl rm` writes them


class RewardModel:
    def __init__(self, path: str | Path, *, batch_size: int = 8, max_tokens: int = 4096, normalize: bool = True,
                 clip: float | None = None, device: str = "cpu") -> None:
        """`normalize`: scores as (score - mean) / std by the directory's NORMALIZATION_FILE,
        when it has one; `clip`: then clamped to +-clip."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.batch_size, self.max_tokens = torch, batch_size, max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device(device)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        self.model = self.model.to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: a reward model has one output, this one has "
                             f"{self.model.config.num_labels} (num_labels)")
        # Rows are padded with the id transformers' pooling skips: its last token that is not padding.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
                else self.tokenizer.eos_token_id
        self.tokenizer.pad_token_id = self.model.config.pad_token_id
        self.tokenizer.padding_side = "right"
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self.shift, self.scale, self.clip = 0.0, 1.0, clip
        stats = Path(path) / NORMALIZATION_FILE
        if normalize and stats.is_file():
            figures = json.loads(stats.read_text())
            self.shift, self.scale = float(figures["mean"]), 1.0 / max(float(figures["std"]), 1e-6)

    def normalized(self, score: float) -> float:
        value = (score - self.shift) * self.scale
        return value if self.clip is None else min(max(value, -self.clip), self.clip)

    def text(self, prompt: str, response: str) -> str:
        """The pair as the model reads it."""
        if self.templated:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return prompt + response

    def count_tokens(self, prompt: str, response: str, answer: str = "") -> int:
        """The tokens the model reads for this pair (what the reward server batches by)."""
        return min(len(self.tokenizer(self.text(prompt, response), add_special_tokens=not self.templated)["input_ids"]),
                   self.max_tokens)

    def score_batch(self, prompts: list[str], responses: list[str], answers: list[str] | None = None) -> list[float]:
        """One score per (prompt, response), computed `batch_size` at a time."""
        scores: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            texts = [self.text(p, r) for p, r in zip(prompts[start:start + self.batch_size],
                                                     responses[start:start + self.batch_size])]
            batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                   max_length=self.max_tokens, add_special_tokens=not self.templated).to(self.device)
            with self.torch.inference_mode():
                scores += [self.normalized(x) for x in self.model(**batch).logits[:, 0].float().tolist()]
        return scores

    def __call__(self, prompt: str, response: str, answer: str, **fields) -> float:
        return self.score_batch([prompt], [response])[0]


class ProcessRewardModel(RewardModel):
    def __init__(self, path: str | Path, *, separator: str = "\n\n", aggregate: str = "steps", **options) -> None:
        super().__init__(path, **options)
        self.separator, self.aggregate = separator, aggregate
        self.head = getattr(self.model, "score", None)
        if self.head is None:
            raise ValueError(f"process reward model {path}: no `score` head to read at each step")

    def step_scores(self, prompt: str, response: str) -> StepRewards:
        """The head's output at the end of each step of `response`, in one forward pass."""
        text = self.text(prompt, response)
        start = text.rfind(response)
        if start < 0:
            raise ValueError("the reward model's chat template changed the response's text")
        steps = StepRewards.split(response, [0.0] * (response.count(self.separator) + 1), self.separator)
        ends = [end for end, _ in steps.steps]
        batch = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=self.max_tokens,
                               add_special_tokens=not self.templated, return_offsets_mapping=True)
        offsets = batch.pop("offset_mapping")[0]
        batch = batch.to(self.device)
        positions = [_token_at(offsets, start + max(end, 1) - 1) for end in ends]
        with self.torch.inference_mode():
            hidden = self.model.base_model(**batch).last_hidden_state[0]
            scores = self.head(hidden[positions]).float()[:, 0].tolist()
        return StepRewards([(max(end, 1), self.normalized(score)) for end, score in zip(ends, scores)])

    def score_batch(self, prompts: list[str], responses: list[str],
                    answers: list[str] | None = None) -> list[StepRewards | float]:
        """Per (prompt, response): its steps' scores, or their min, last or mean."""
        out: list[StepRewards | float] = []
        for prompt, response in zip(prompts, responses):
            steps = self.step_scores(prompt, response)
            scores = [score for _, score in steps.steps]
            out.append(steps if self.aggregate == "steps" else {"min": min(scores), "last": scores[-1],
                                                                "mean": sum(scores) / len(scores)}[self.aggregate])
        return out


def weights_version(path: str | Path) -> str:
    """A model directory's version: the first 12 hex digits of the SHA-256 of its config
    and weight files, in name order (a retrained model in the same place is another)."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(Path(path).iterdir()):
        if file.name == "config.json" or file.suffix in (".safetensors", ".bin"):
            digest.update(file.name.encode())
            with file.open("rb") as stream:
                while chunk := stream.read(1 << 24):
                    digest.update(chunk)
    return digest.hexdigest()[:12]


def _token_at(offsets, char: int) -> int:
    """The token whose characters hold `char` (or the last one that starts before it: a
    step's end past the truncation reads the last token)."""
    starts = offsets[:, 0].tolist()
    ends = offsets[:, 1].tolist()
    best = 0
    for k, (a, b) in enumerate(zip(starts, ends)):
        if b > a and a <= char:
            best = k
            if char < b:
                return k
    return best
