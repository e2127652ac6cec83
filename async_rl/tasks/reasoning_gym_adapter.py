"""reasoning-gym's procedural datasets (`pip install 'async-rl[reasoning-gym]'`) as a
single-turn task, scored by each dataset's own `score_answer`.

    task: {name: reasoning_gym, dataset: leg_counting, dataset_options: {max_animals: 4}}

reasoning-gym makes entry `i` of a dataset from the dataset's seed and `i` alone, so
prompts stay a pure function of (run seed, index) as every task's must (tasks/base.py):
training prompts come from a pool of entries seeded by the run's seed (10,000, or
`dataset_options.size`),
walked epoch by epoch; the held-out set from a dataset seeded by `eval_seed` (the same
for every run seed), and a training entry whose question is held out is skipped.

The prompt is reasoning-gym's own: a system prompt asking for the final answer between
`<answer>` tags (its SYSTEM_PROMPTS["default"], or `task.system_prompt`), and the
entry's question. The reward is `dataset.score_answer(extract_answer(response), entry)`:
reasoning-gym's scorers need the whole entry (many read its metadata), so a prompt's
`answer` names the entry (`{"answer": ..., "split": ..., "index": ...}` as JSON) and the
reward rebuilds it, which costs microseconds and works in any process.
"""
from __future__ import annotations

import json

from async_rl.tasks.base import EVAL_ID_OFFSET, EpochSampler, Prompt

# Far from any run seed's pool: reasoning-gym seeds entry i with (seed + i), so nearby
# seeds would give shifted copies of the same entries.
EVAL_SEED_BASE = 1 << 40
TRAIN_SEED_STRIDE = 1 << 24
TRAIN_SIZE = 10_000  # a few datasets build their pool up front, in time growing with its size


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("task.name=reasoning_gym needs the reasoning-gym package: "
                         "pip install 'async-rl[reasoning-gym]'") from None
    return reasoning_gym


class ReasoningGymTask:
    NAME = "reasoning_gym"

    def __init__(self, *, seed: int, dataset: str, options: dict | None = None, eval_size: int = 256,
                 eval_seed: int = 0, system_prompt: str | None = None) -> None:
        rg = _reasoning_gym()
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        if dataset not in rg.factory.DATASETS:
            raise ValueError(f"task.dataset: reasoning-gym has no dataset {dataset!r} "
                             f"(it has {len(rg.factory.DATASETS)}, e.g. {', '.join(sorted(rg.factory.DATASETS)[:4])})")
        options = dict(options or {})
        if "seed" in options:
            raise ValueError("task.dataset_options.seed: the run's seed chooses the entries")
        train_size = int(options.pop("size", TRAIN_SIZE))
        self.dataset, self.options = dataset, options
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self._extract = extract_answer
        self._splits = {"train": self._make(seed=int(seed) * TRAIN_SEED_STRIDE, size=train_size),
                        "eval": self._make(seed=EVAL_SEED_BASE + int(eval_seed), size=eval_size)}
        self._eval = [self._splits["eval"][k] for k in range(eval_size)]
        self._reserved = {entry["question"] for entry in self._eval}
        self._sampler = EpochSampler(train_size, seed)

    def _make(self, seed: int, size: int):
        from reasoning_gym import create_dataset

        try:
            return create_dataset(self.dataset, seed=seed, size=size, **self.options)
        except (TypeError, ValueError, AssertionError) as err:  # the dataset's config refused an option
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"task.dataset_options: reasoning-gym's {self.dataset} refused them ({detail})") from None

    def _prompt(self, prompt_id: int, split: str, index: int, entry: dict) -> Prompt:
        answer = json.dumps({"answer": entry["answer"], "split": split, "index": index})
        return Prompt(id=prompt_id, text=entry["question"], answer=answer,
                      messages=(("system", self.system_prompt), ("user", entry["question"])))

    def train_prompt(self, index: int) -> Prompt:
        pool = self._splits["train"]
        j = self._sampler(index)
        for _ in range(len(pool)):  # a held-out question is rare: this loop almost always runs once
            entry = pool[j]
            if entry["question"] not in self._reserved:
                return self._prompt(index, "train", j, entry)
            j = (j + 1) % len(pool)
        raise ValueError(f"task.dataset {self.dataset}: every training question is also held out")

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(EVAL_ID_OFFSET + k, "eval", k, entry) for k, entry in enumerate(self._eval)]

    def reward(self, prompt: str, response: str, answer: str) -> float:
        where = json.loads(answer)
        dataset = self._splits[where["split"]]
        return float(dataset.score_answer(self._extract(response), dataset[int(where["index"])]))
