"""Score a model directory on a run config's held-out prompts, outside any run.

    python analysis/eval_model.py CONFIG MODEL_DIR [overrides ...] [--show N] [--threads 2]

The same path as an actor's evaluation round: the config's task, chat template, stop
tokens and reward, the torch engine at the config's dtype and attention (vLLM actors:
float32 here), `eval.size` prompts, `eval.pass_k` samples each, `eval.temperature`
(greedy by default) and `eval.max_new_tokens`, in chunks of `eval.batch_size`. Use it
to compare a base model with a run's `final/`, or to ask how much of a gain is format:
`eval.max_new_tokens=64` scores both without the training length limit.

Prints one JSON line (the run's `eval/*` keys plus `model`, `max_new_tokens`, `seconds`,
and `reward/errors_<reason>` when reward calls failed and scored `reward.fallback`, as
in a run) and, with --show N, the first N prompts as the model saw them with its responses.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("model", help="an HF model directory (a run's final/, or the base model)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. eval.max_new_tokens=64")
    ap.add_argument("--show", type=int, default=0, help="print this many prompts and responses")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from async_rl.actor.engines import make_engine
    from async_rl.actor.rollout.rollout import Rollout, Scores
    from async_rl.config import ConfigError, load_config
    from async_rl.coordinator.eval_rounds import summarize
    from async_rl.models.loading import quiet_libraries
    from async_rl.tasks import task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids
    from async_rl.wire.messages import FAILURE_REASONS

    try:
        cfg = load_config(args.config, [*args.overrides, f"model.path={args.model}"])
    except ConfigError as err:
        print(f"eval_model: {err}", file=sys.stderr)
        return 2
    quiet_libraries()
    torch.set_num_threads(args.threads)
    prompt_format = prompt_format_for(cfg.model.path, cfg.task)
    stops = dict(eos_token_id=stop_token_ids(args.model, prompt_format.tokenizer))
    if cfg.actors.stop:
        stops.update(stop_strings=cfg.actors.stop, tokenizer=prompt_format.tokenizer)
    # The config's torch engine settings, as its actors evaluate: a bf16 policy can score
    # differently in float32 (override actors.engine.dtype=float32 to ask).
    engine_cfg = cfg.actors.engine
    options = dict(dtype=getattr(torch, engine_cfg.dtype), attention=engine_cfg.attention) \
        if engine_cfg.name == "torch" else {}
    engine = make_engine("torch", model_or_path=args.model, device=torch.device("cpu"), **stops, **options)
    task = task_from_config(cfg.task, cfg.seed)
    e = cfg.eval
    prompts = task.eval_prompts()[:e.size]
    max_new = e.max_new_tokens or cfg.actors.max_new_tokens
    # An actor's evaluation, chunk by chunk: episodes, the guarded reward, the same limits.
    rollout = Rollout.from_config(cfg, engine, prompt_format, task, torch.Generator().manual_seed(cfg.seed))
    started = time.perf_counter()
    groups = [g for i in range(0, len(prompts), e.batch_size)
              for g in rollout.evaluation([p.id for p in prompts[i:i + e.batch_size]])]
    seconds = time.perf_counter() - started
    scores = Scores.of(groups)
    line = {"model": args.model, "max_new_tokens": max_new,
            **summarize(scores.rewards, scores.lengths, scores.truncated), "seconds": round(seconds, 1)}
    for field, prefix in (("reward_errors", "reward"), ("env_errors", "env")):
        if sum(scores.failures[field]):
            line.update({f"{prefix}/errors_{reason}": n for reason, n in zip(FAILURE_REASONS, scores.failures[field])})
    if scores.failures["first_failure"]:
        line["first_failure"] = scores.failures["first_failure"]
    print(json.dumps(line), flush=True)
    for i, prompt in enumerate(prompts[:args.show]):
        print(f"--- held-out prompt {i} (answer {prompt.answer}, reward {scores.rewards[i, 0]:g})\n"
              f"{prompt_format.render(prompt)}{prompt_format.response_text(groups[i][0].tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
