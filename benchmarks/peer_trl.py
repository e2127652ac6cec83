"""The TRL side of benchmarks/bench_peer.py: one GRPOTrainer run, set up from an async-rl config.

    python benchmarks/peer_trl.py --config CONFIG --model DIR --out DIR [--seed 0] [--target 0.9]
                                [--max-steps N] [--eval-every K] [--threads 2] [--set key=value ...]

bench_peer.py starts this script as a subprocess and reads back OUT/metrics.jsonl (the
evaluations, in an async-rl run's format) and OUT/result.json. The settings
(`trl_settings`) are the async-rl run config's, mapped one by one; bench_peer.py's
docstring lists them and the differences that remain.

Prompts reach TRL as its users give them: plain text when the config uses no chat
template, else as a conversation (TRL renders it with the tokenizer's chat template and
the generation prompt). Before training, the worker checks that TRL's prompt tokens are
the ones an async-rl actor feeds the model (`PromptFormat.encode`), so both systems
train on the same inputs. Rewards are the task's own, on the completion text TRL decodes
without special tokens (as `PromptFormat.response_text`); the held-out evaluation is
async-rl's own code (`Rollout.scores` through a TorchEngine on a copy of the model) at
step 0 and every --eval-every steps, twice: as TRL samples (bf16 autocast when the
config's learner.precision is bf16, the model's attention kernel: `eval/accuracy`) and
in float32 with the actors' attention kernel (`eval/accuracy@float32`, as async-rl's
evaluator scores with eval.also_dtypes=[float32]). Each line carries both clocks: `time`
without the evaluations, `time_with_eval` with them.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_peer, beside this script
from bench_peer import load_run_config  # noqa: E402  (bench_peer puts this checkout's async_rl first)

from async_rl.device import device_type  # noqa: E402
from async_rl.run.directory import RunDir  # noqa: E402


def trl_settings(cfg, output_dir: Path) -> dict:
    """GRPOConfig arguments equal to the async-rl run config's settings."""
    t = cfg.train
    if (t.loss.name != "ppo" or t.advantage.name not in ("grpo", "drgrpo") or t.minibatches != 1 or t.entropy_coef
            or t.overlong.penalty_tokens or (t.kl.coef and (t.kl.estimator, t.kl.mode) != ("k3", "loss"))):
        raise SystemExit("bench_peer: TRL's GRPO is matched for train.loss=ppo, advantage grpo|drgrpo, "
                         "minibatches 1, no entropy bonus or overlong penalty, KL k3 in the loss only")
    # async-rl's token-mean divides the summed token losses by the response tokens of the
    # whole (global) batch; TRL's "dapo" divides by num_items_in_batch, the active tokens of
    # the whole generation batch, which is the same batch here (one process, one optimizer
    # step per generation batch). "bnpo" would also match here, but only per micro-batch.
    loss_types = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
    if t.agg not in loss_types:
        raise SystemExit(f"bench_peer: train.agg={t.agg} has no TRL loss_type")
    lr = t.lr_schedule
    if lr.name == "cosine":  # ours: min_ratio + (1 - min_ratio) * cosine, as HF's cosine_with_min_lr
        schedule = {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": lr.min_ratio}}
    elif lr.name == "linear" and lr.min_ratio == 0.0:
        schedule = {"lr_scheduler_type": "linear"}
    elif lr.name == "constant":
        schedule = {"lr_scheduler_type": "constant_with_warmup" if lr.warmup_steps else "constant"}
    else:
        raise SystemExit("bench_peer: train.lr_schedule=linear decays to 0 in TRL; set train.lr_schedule.min_ratio=0")
    samples = t.batch_groups * t.group_size
    return dict(
        output_dir=str(output_dir), seed=cfg.seed, max_steps=t.max_steps, **schedule,
        per_device_train_batch_size=samples, num_generations=t.group_size, gradient_accumulation_steps=1,
        num_iterations=1, shuffle_dataset=False,  # prompts in index order, as async-rl's coordinator grants them
        max_completion_length=cfg.actors.max_new_tokens, temperature=cfg.actors.temperature,
        top_p=cfg.actors.top_p, top_k=0,
        learning_rate=t.lr, warmup_steps=lr.warmup_steps, weight_decay=t.weight_decay, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=t.grad_clip,  # torch AdamW defaults, ours
        beta=t.kl.coef, epsilon=t.loss.eps_low, epsilon_high=t.loss.eps_high, loss_type=loss_types[t.agg],
        # "group": (r - mean) / (std + 1e-4) per prompt group, unbiased std, as group_advantages' grpo.
        scale_rewards="group" if t.advantage.name == "grpo" else "none",
        mask_truncated_completions=cfg.train.overlong.filter,
        # async-rl's learner.precision: bf16 compute over fp32 master weights is accelerate's
        # bf16 autocast; TRL defaults to bf16 and gradient checkpointing whatever the config.
        bf16=cfg.learner.precision == "bf16", gradient_checkpointing=cfg.learner.activation_checkpointing,
        use_cpu=device_type(cfg.model.device) == "cpu", report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True,
    )


def check_prompt_tokens(trainer, prompt_format, prompts, rows) -> None:
    """TRL's token ids for the first prompt (through the trainer's own prompt tokenization)
    must be the ones async-rl's actors feed the model."""
    theirs = list(trainer._tokenize_prompts(rows[:1])[0][0])
    ours = prompt_format.encode(prompts[0])
    if theirs != ours:
        raise SystemExit(f"bench_peer: TRL's prompt tokens differ from async-rl's:\n  TRL:      {theirs}\n"
                         f"  async-rl: {ours}")


def run(args) -> int:
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.actor.engines.torch_engine import TorchEngine
    from async_rl.actor.rollout.rollout import Rollout
    from async_rl.coordinator.eval_rounds import summarize
    from async_rl.tasks import task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids

    run_dir = args.out
    cfg = load_run_config(args.config, args.seed, args.set, args.max_steps, args.eval_every, args.model)
    task, prompt_format = task_from_config(cfg.task, cfg.seed), prompt_format_for(cfg.model.path, cfg.task)
    prompts = [task.train_prompt(i) for i in range(cfg.train.max_steps * cfg.train.batch_groups)]
    rows = [prompt_format.messages(p) if prompt_format.uses_chat else p.text for p in prompts]
    dataset = Dataset.from_dict({"prompt": rows, "text": [p.text for p in prompts],
                                 "answer": [p.answer for p in prompts]})

    def completion_text(completion) -> str:  # a conversation's completion is [{"role": "assistant", ...}]
        return completion if isinstance(completion, str) else completion[-1]["content"]

    def task_reward(completions, text, answer, **_):
        return [task.reward(p, completion_text(c), a) for p, c, a in zip(text, completions, answer)]

    eval_prompts = task.eval_prompts()[:cfg.eval.size]
    stops = stop_token_ids(args.model, prompt_format.tokenizer)
    e = cfg.eval

    autocast = cfg.learner.precision == "bf16"  # TRL's bf16=True: accelerate's autocast around the model

    def held_out_accuracy(model, own: bool) -> float:
        """An actor's evaluation round on a copy of the model (TorchEngine freezes what it
        gets). `own`: as TRL samples (its weights, its attention kernel, under its bf16
        autocast); else as async-rl's evaluator scores eval.also_dtypes=[float32] (float32,
        the actors' attention kernel)."""
        clean = copy.deepcopy(model)
        clean.__dict__.pop("forward", None)  # accelerate's autocast wrapper would call the original
        if not own and cfg.actors.engine.attention:
            clean.set_attn_implementation(cfg.actors.engine.attention)
        engine = TorchEngine(clean, device=model.device, eos_token_id=stops)
        rollout = Rollout.from_config(cfg, engine, prompt_format, task, torch.Generator().manual_seed(cfg.seed))
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=own and autocast):
            parts = [rollout.scores([p.id for p in eval_prompts[i:i + e.batch_size]])
                     for i in range(0, len(eval_prompts), e.batch_size)]
        return summarize(*(np.concatenate([getattr(p, k) for p in parts])
                           for k in ("rewards", "lengths", "truncated")))["eval/accuracy"]

    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = open(RunDir(run_dir).metrics_path, "a", buffering=1)  # read back as an async-rl run's

    class HeldOutEval(TrainerCallback):
        """Evaluates at step 0 and every eval.every steps, keeps the training clock without
        the evaluations, and stops training at the target."""
        started: float | None = None
        eval_s = 0.0
        last_step, last_time, first_step_s = 0, 0.0, None

        def train_seconds(self) -> float:
            return time.perf_counter() - self.started - self.eval_s

        def evaluate(self, model, step: int, train_s: float) -> float:
            """Both scores; returns the lower (training stops when both reach the target)."""
            t0 = time.perf_counter()
            with_eval = round(t0 - self.started, 3) if self.started is not None else 0.0
            own, in_float32 = held_out_accuracy(model, own=True), held_out_accuracy(model, own=False)
            seconds = time.perf_counter() - t0
            self.eval_s += seconds
            metrics.write(json.dumps({"step": step, "time": round(train_s, 3), "time_with_eval": with_eval,
                                      "eval/accuracy": own, "eval/accuracy@float32": in_float32,
                                      "eval/seconds": round(seconds, 3)}) + "\n")
            return min(own, in_float32)

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.evaluate(model, 0, 0.0)

        def on_step_begin(self, args_, state, control, **kwargs):
            if self.started is None:
                self.started, self.eval_s = time.perf_counter(), 0.0

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            step = self.last_step = state.global_step
            self.last_time = self.train_seconds()
            if step == 1:  # as the evaluation lines round it: a hit at step 1 is then never sooner
                self.first_step_s = round(self.last_time, 3)
            if (e.every and step % e.every == 0) or step == cfg.train.max_steps:
                if self.evaluate(model, step, self.last_time) >= args.target:
                    control.should_training_stop = True

        def on_log(self, args_, state, control, logs=None, **kwargs):
            metrics.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")

    clock = HeldOutEval()
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32,
                                                 attn_implementation=cfg.learner.attention)  # None: the default
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=GRPOConfig(**trl_settings(cfg, run_dir)),
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(str(args.model)),
                          callbacks=[clock])
    check_prompt_tokens(trainer, prompt_format, prompts, rows)
    trainer.train()
    metrics.close()
    (run_dir / "result.json").write_text(json.dumps({
        "last_step": clock.last_step, "last_time": clock.last_time, "first_step_s": clock.first_step_s,
        "last_time_with_eval": round(time.perf_counter() - clock.started, 3) if clock.started else 0.0,
        "eval_s": clock.eval_s,
        "samples_per_step": cfg.train.batch_groups * cfg.train.group_size, "trl_version": trl.__version__}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="the async-rl config TRL is set up from")
    parser.add_argument("--model", type=Path, required=True, help="HF model directory to start from")
    parser.add_argument("--out", type=Path, required=True, help="run directory (metrics.jsonl, result.json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.9, help="stop at the first evaluation that reaches it")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="async-rl config override")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
