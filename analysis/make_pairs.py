"""Preference pairs from a model's own answers, judged by the task's verifiable reward:
for each training prompt, `--samples` answers sampled as the run's actors sample them
(the config's engine, chat template, stop tokens, temperature), and one pair of the best
and the worst answer when their rewards differ. The JSON lines file is what `async-rl rm
CONFIG rm.data=FILE` trains on (`prompt`, `chosen`, `rejected`, and the rewards).

    python analysis/make_pairs.py CONFIG MODEL_DIR OUT.jsonl [--prompts 512] [--samples 4] [overrides ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def make_pairs(cfg, model: str, prompts: int, samples: int, batch: int = 16) -> tuple[list[dict], dict]:
    """(pairs, counts): one pair per training prompt whose samples' rewards differ."""
    from async_rl.actor.engines import make_engine
    from async_rl.actor.rollout.rollout import Rollout
    from async_rl.tasks import PromptIndex, task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids
    from async_rl.wire import WorkGrant

    cfg.train.group_size = samples
    prompt_format = prompt_format_for(model, cfg.task)
    stops = dict(eos_token_id=stop_token_ids(model, prompt_format.tokenizer))
    if cfg.actors.stop:
        stops.update(stop_strings=cfg.actors.stop, tokenizer=prompt_format.tokenizer)
    engine = make_engine("torch", model_or_path=model, device=torch.device("cpu"), **stops,
                         dtype=getattr(torch, cfg.actors.engine.dtype), attention=cfg.actors.engine.attention)
    task = task_from_config(cfg.task, cfg.seed)
    index = PromptIndex(task)
    rollout = Rollout.from_config(cfg, engine, prompt_format, task, torch.Generator().manual_seed(cfg.seed))
    pairs, counts = [], {"prompts": 0, "tied": 0, "correct_frac": 0.0}
    rewards_seen = []
    try:
        for start in range(0, prompts, batch):
            ids = list(range(start, min(prompts, start + batch)))
            for g in rollout.experience(WorkGrant(groups=ids, prompt_ids=ids), actor_id=0):
                counts["prompts"] += 1
                rewards = g.rewards.tolist()
                rewards_seen += rewards
                best, worst = max(range(samples), key=rewards.__getitem__), min(range(samples), key=rewards.__getitem__)
                if rewards[best] == rewards[worst]:
                    counts["tied"] += 1
                    continue
                texts = [prompt_format.response_text(r.tokens.tolist()) for r in g.responses()]
                pairs.append({"prompt": index[g.prompt_id].text, "chosen": texts[best], "rejected": texts[worst],
                              "chosen_reward": rewards[best], "rejected_reward": rewards[worst]})
    finally:
        rollout.close()
    counts["correct_frac"] = sum(r > 0 for r in rewards_seen) / max(len(rewards_seen), 1)
    return pairs, counts


def main(argv: list[str] | None = None) -> int:
    from async_rl.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [*args.overrides, f"model.path={args.model}"])
    started = time.perf_counter()
    pairs, counts = make_pairs(cfg, args.model, args.prompts, args.samples)
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    print(json.dumps({"pairs": len(pairs), **counts, "seconds": round(time.perf_counter() - started, 1),
                      "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
