"""Score a model directory on a run config's held-out prompts, outside any run:
`async-rl eval CONFIG MODEL [overrides]`.

The same path as an actor's evaluation round: the config's task, chat template, stop
tokens and reward, the torch engine at the config's dtype and attention (vLLM actors:
float32 here), `eval.size` prompts, `eval.pass_k` samples each, `eval.temperature`
(greedy by default) and `eval.max_new_tokens`, in chunks of `eval.batch_size`. So a
run's final/ scores here what its last evaluation said, and
`actors.engine.dtype=float32` asks what it scores in another precision.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from async_rl.config import Config


@dataclass
class Scored:
    line: dict  # the run's eval/* keys, plus model, dtype, max_new_tokens, seconds, failures
    shown: list[str]  # the first prompts as the model saw them, each with its first response


def evaluation_rollout(cfg: Config, model: str, dtype: str, lora=None):
    """(the rollout that scores held-out prompts as an actor does, its prompt format) for
    `model` (an HF directory; with `lora`, the config's model.lora, its adapters on top)
    on the torch engine in `dtype`: the config's task, chat template, stop tokens and
    reward, the task's own reward alone (no reward model or reward server is loaded)."""
    from async_rl.actor.engines import make_engine
    from async_rl.actor.rollout.rollout import Rollout
    from async_rl.tasks import task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids

    prompt_format = prompt_format_for(cfg.model.path, cfg.task)
    stops = dict(eos_token_id=stop_token_ids(model, prompt_format.tokenizer))
    if cfg.actors.stop:
        stops.update(stop_strings=cfg.actors.stop, tokenizer=prompt_format.tokenizer)
    engine_cfg = cfg.actors.engine
    options = dict(attention=engine_cfg.attention, compile=engine_cfg.compile) if engine_cfg.name == "torch" else {}
    engine = make_engine("torch", model_or_path=model, device=torch.device("cpu"), dtype=getattr(torch, dtype),
                         lora=lora, **stops, **options)
    cfg = cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"components": []})})
    rollout = Rollout.from_config(cfg, engine, prompt_format, task_from_config(cfg.task, cfg.seed),
                                  torch.Generator().manual_seed(cfg.seed))
    return rollout, prompt_format


def score_prompts(rollout, prompt_ids: list[int], batch_size: int, on_chunk=None):
    """(the held-out prompts' scored episodes, groups[i] prompt i's samples, their Scores),
    `batch_size` prompts per generate call, as an actor scores its chunks; `on_chunk()`
    after each."""
    from async_rl.actor.rollout.rollout import Scores

    groups = []
    for i in range(0, len(prompt_ids), batch_size):
        groups += rollout.evaluation(prompt_ids[i:i + batch_size])
        if on_chunk is not None:
            on_chunk()
    return groups, Scores.of(groups)


def eval_line(scores, prefix: str = "") -> dict:
    """A round's metrics (coordinator/eval_rounds.py: summarize), and its failed reward or
    environment calls per reason, keys `prefix` + reward/errors_<reason> (none if none failed)."""
    from async_rl.coordinator.eval_rounds import summarize
    from async_rl.wire.messages import FAILURE_REASONS

    line = summarize(scores.rewards, scores.lengths, scores.truncated)
    for field, kind in (("reward_errors", "reward"), ("env_errors", "env")):
        if sum(scores.failures[field]):
            line.update({f"{prefix}{kind}/errors_{reason}": n
                         for reason, n in zip(FAILURE_REASONS, scores.failures[field])})
    if scores.failures["first_failure"]:
        line[f"{prefix}first_failure"] = scores.failures["first_failure"]
    return line


def score_saved_model(cfg: Config, model: str, threads: int = 2, show: int = 0) -> Scored:
    """`model` (an HF directory) on `cfg`'s held-out prompts, as its actors evaluate."""
    from async_rl.models.loading import quiet_libraries
    from async_rl.tasks import task_from_config

    quiet_libraries()
    torch.set_num_threads(threads)
    engine_cfg = cfg.actors.engine
    dtype = engine_cfg.dtype if engine_cfg.name == "torch" else "float32"
    e = cfg.eval
    rollout, prompt_format = evaluation_rollout(cfg, model, dtype)
    prompts = task_from_config(cfg.task, cfg.seed).eval_prompts()[:e.size]
    started = time.perf_counter()
    try:
        groups, scores = score_prompts(rollout, [p.id for p in prompts], e.batch_size)
    finally:
        rollout.close()
    seconds = time.perf_counter() - started
    line = {"model": str(model), "dtype": dtype, "max_new_tokens": e.max_new_tokens or cfg.actors.max_new_tokens,
            **eval_line(scores), "seconds": round(seconds, 1)}
    shown = [f"--- held-out prompt {i} (answer {prompt.answer}, reward {scores.rewards[i, 0]:g})\n"
             f"{prompt_format.render(prompt)}{prompt_format.response_text(groups[i][0].tokens)}"
             for i, prompt in enumerate(prompts[:show])]
    return Scored(line, shown)
