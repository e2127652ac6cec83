"""Peer benchmark: TRL's GRPOTrainer against async-rl on the CPU demo, time to a target accuracy.

    python analysis/bench_peer.py [--seeds 0 1 2] [--target 0.9] [--max-steps 1000] [--eval-every 50]
                                  [--out runs/bench-peer] [--set key=value ...] [--systems trl async-rl]
                                  [--trl-threads 2] [--model DIR]

Install TRL next to async-rl, keeping the CPU torch (an unpinned install may pull a
newer, CUDA torch):

    pip install -e ".[bench]" -c <(echo torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])'))

For each seed, both systems start from the same warm-started demo model (built once
into OUT/seedS/base_model, as `async-rl train` builds it; --model DIR uses DIR instead)
and run one after the other (the order alternates from seed to seed); each runs as a
subprocess of this script, async-rl as `async-rl train configs/demo.yaml`, TRL as this
script with --_trl-worker, one process with --trl-threads torch threads. Both train on
the same prompts in the same order (task.train_prompt(0), (1), ...), score them with
the task's own reward on the decoded completion without special tokens, and evaluate
greedily on the first eval.size held-out prompts with the same code
(async_rl.evaluation.score_prompts) every --eval-every steps and at step 0. A run stops
at the first evaluation after step 0 that reaches --target (async-rl by SIGTERM, its
checkpoint written after the measurement) or at --max-steps.

Figures per system (one JSON line per seed on stdout; with several seeds a last line with
the median, min and max over seeds; all also appended to OUT/results.jsonl; progress on stderr):
  time_to_target_s   async-rl: the `time` of the first eval line >= target in metrics.jsonl
                     (as analysis/summarize.py): seconds since the learner started, so it
                     includes the actors' start-up before the first batch and the eval
                     round's own latency; evaluation never pauses the learner (actors run it).
                     TRL: seconds from the start of its first step to the end of the step
                     whose evaluation reaches the target, minus the time spent evaluating
                     (evaluation pauses TRL's training, and is not part of its cost).
  steps_to_target    learner (optimizer) steps up to that evaluation.
  samples_per_s      steps_to_target * samples per step / time_to_target_s.
  cpu_s_per_sample   user+system CPU seconds of the system's whole process tree
                     (RUSAGE_CHILDREN around the subprocess; imports, model loading,
                     evaluation and shutdown included, for both) / (steps_to_target * samples
                     per step).
  first_step_s       the same clock at the end of step 1 (async-rl: mostly start-up).
  ratio_trl_over_async_rl  TRL time_to_target_s / async-rl's (> 1: async-rl is faster).
Without the target reached, the *_to_target fields are null and samples/s and CPU/sample
cover the steps run.

Settings: TRL's are derived from the resolved async-rl config (configs/demo.yaml, the seed,
--set overrides, --max-steps, --eval-every), so `--set train.batch_groups=8` shrinks both:
64 prompts x 8 samples per step (per_device_train_batch_size = 512, num_generations = 8, one
optimizer step per batch), max 4 new tokens, temperature 1, top_p 1 and no top-k, AdamW
(betas 0.9/0.999, eps 1e-8, no weight decay), lr 5e-4 with cosine decay to 0.1 x lr over
max_steps and no warmup, grad-norm clip 1, fp32, no KL (beta 0), PPO clip 0.2/0.2,
loss averaged over all tokens of the batch, advantages (r - mean) / std per group.
Differences that remain:
  - async-rl is asynchronous (the demo's max_staleness): its samples may come from weights
    up to that many steps old, weighted by decoupled PPO's capped importance weight. TRL generates each
    batch with the current weights (in both, one optimizer step per batch: ratio 1, no clip).
  - GRPO's std epsilon: TRL divides by std + 1e-4, async-rl by std + 1e-6 (both unbiased
    std; with 0/1 rewards a group's nonzero std is >= 0.35, so advantages differ < 0.03%).
  - Warmup, when set: TRL's is step/warmup, async-rl's (step+1)/warmup (the demo has none).
  - Layout: async-rl runs the demo's learner ranks (auto: 1 on CPU) and 1 actor, 1 thread
    each; TRL one process of --trl-threads threads that generates, then trains.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's async_rl, whatever copy is installed
CONFIG = ROOT / "configs/demo.yaml"
SYSTEMS = ("trl", "async-rl")

from async_rl.run_dir import RunDir  # noqa: E402  (after the path above)


def load_run_config(args, seed: int, model: Path | None = None):
    from async_rl.config import load_config

    overrides = [f"seed={seed}", *args.set, f"train.max_steps={args.max_steps}", f"eval.every={args.eval_every}"]
    return load_config(CONFIG, overrides + ([f"model.path={model}"] if model else []))


def base_model(args, seed: int) -> Path:
    """The demo model warm-started exactly as `async-rl train` does (launcher.prepare_run_dir)."""
    if args.model:
        return args.model.resolve()
    from async_rl.launcher import ensure_demo_model

    say(f"seed {seed}: the demo base model in {args.out / f'seed{seed}' / 'base_model'}")
    return ensure_demo_model(load_run_config(args, seed), (args.out / f"seed{seed}" / "base_model").resolve())


def say(message: str) -> None:
    print(f"[bench_peer] {message}", file=sys.stderr, flush=True)


def first_hit(evals: list[dict], target: float) -> dict | None:
    """The first evaluation after training started (step >= 1) that reaches the target."""
    return next((e for e in evals if e["step"] >= 1 and e["eval/accuracy"] >= target), None)


def run_measured(name: str, cmd: list[str], run_dir: Path, log_path: Path, target: float,
                 stop_at_target: bool) -> tuple[int, float]:
    """Run `cmd` to its end, echoing the evaluations of run_dir/metrics.jsonl; SIGTERM it at the
    target when asked. Returns (exit status, CPU seconds of the process and all it waited for)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    seen, stopped = 0, False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(0.25)
                evals = RunDir(run_dir).evals()
                for e in evals[seen:]:
                    say(f"  {name} step {e['step']}: eval accuracy {e['eval/accuracy']:.3f} at {e['time']:.1f} s")
                seen = len(evals)
                if stop_at_target and not stopped and first_hit(evals, target):
                    proc.send_signal(signal.SIGTERM)  # the launcher checkpoints and stops its processes
                    stopped = True
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.returncode, cpu


def figures(evals: list[dict], last_step: int, last_time: float, first_step_s: float | None, cpu_s: float,
            samples_per_step: int, target: float) -> dict:
    """The per-system JSON fields from its evaluation lines ({"step", "time", "eval/accuracy"})."""
    hit = first_hit(evals, target)
    steps, seconds = (hit["step"], hit["time"]) if hit else (last_step, last_time)
    samples = steps * samples_per_step
    return {"reached": hit is not None,
            "time_to_target_s": round(hit["time"], 2) if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "samples_per_s": round(samples / seconds, 1) if seconds > 0 else None,
            "cpu_s_per_sample": round(cpu_s / samples, 5) if samples else None,
            "cpu_s": round(cpu_s, 1), "steps_run": last_step,
            "first_step_s": round(first_step_s, 2) if first_step_s is not None else None,
            "eval_first": evals[0]["eval/accuracy"] if evals else None,
            "eval_last": evals[-1]["eval/accuracy"] if evals else None}


def run_async_rl(args, seed: int, model: Path) -> dict:
    cfg = load_run_config(args, seed, model)
    run_dir = (args.out / f"seed{seed}" / "async-rl").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)  # the launcher refuses a directory that holds a run
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(CONFIG), f"run_dir={run_dir}", f"model.path={model}",
           f"seed={seed}", *args.set, f"train.max_steps={args.max_steps}", f"eval.every={args.eval_every}"]
    code, cpu_s = run_measured("async-rl", cmd, run_dir, run_dir.parent / "async-rl.log", args.target, True)
    steps, evals = RunDir(run_dir).steps_and_evals()
    if code not in (0, 143) or not steps:
        raise SystemExit(f"async-rl failed (exit {code}); see {run_dir.parent / 'async-rl.log'}")
    samples_per_step = cfg.train.batch_groups * cfg.train.group_size
    return {**figures(evals, steps[-1]["step"], steps[-1]["time"], steps[0]["time"], cpu_s, samples_per_step,
                      args.target),
            "exit": code, "run_dir": str(run_dir)}


def run_trl(args, seed: int, model: Path) -> dict:
    run_dir = (args.out / f"seed{seed}" / "trl").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_trl-worker", "--seeds", str(seed), "--model", str(model),
           "--out", str(run_dir), "--target", str(args.target), "--max-steps", str(args.max_steps),
           "--eval-every", str(args.eval_every), "--trl-threads", str(args.trl_threads),
           *[f"--set={s}" for s in args.set]]
    code, cpu_s = run_measured("trl", cmd, run_dir, run_dir.parent / "trl.log", args.target, False)
    if code != 0 or not (run_dir / "result.json").exists():
        raise SystemExit(f"TRL failed (exit {code}); see {run_dir.parent / 'trl.log'}")
    worker = json.loads((run_dir / "result.json").read_text())
    evals = RunDir(run_dir).evals()
    return {**figures(evals, worker["last_step"], worker["last_time"], worker["first_step_s"], cpu_s,
                      worker["samples_per_step"], args.target),
            "eval_s_subtracted": round(worker["eval_s"], 2), "trl_version": worker["trl_version"],
            "run_dir": str(run_dir)}


# -- the TRL side, in its own process ------------------------------------------------
def trl_settings(cfg, output_dir: Path) -> dict:
    """GRPOConfig arguments equal to the async-rl run config's settings (see the docstring)."""
    t = cfg.train
    if (t.loss != "ppo" or t.advantage not in ("grpo", "drgrpo") or t.minibatches != 1 or t.entropy_coef
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
    if t.lr_schedule == "cosine":  # ours: min_ratio + (1 - min_ratio) * cosine, as HF's cosine_with_min_lr
        schedule = {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": t.lr_min_ratio}}
    elif t.lr_schedule == "linear" and t.lr_min_ratio == 0.0:
        schedule = {"lr_scheduler_type": "linear"}
    elif t.lr_schedule == "constant":
        schedule = {"lr_scheduler_type": "constant_with_warmup" if t.warmup_steps else "constant"}
    else:
        raise SystemExit("bench_peer: train.lr_schedule=linear decays to 0 in TRL; set train.lr_min_ratio=0")
    samples = t.batch_groups * t.group_size
    return dict(
        output_dir=str(output_dir), seed=cfg.seed, max_steps=t.max_steps, **schedule,
        per_device_train_batch_size=samples, num_generations=t.group_size, gradient_accumulation_steps=1,
        num_iterations=1, shuffle_dataset=False,  # prompts in index order, as async-rl's coordinator grants them
        max_completion_length=cfg.actors.max_new_tokens, temperature=cfg.actors.temperature,
        top_p=cfg.actors.top_p, top_k=0,
        learning_rate=t.lr, warmup_steps=t.warmup_steps, weight_decay=t.weight_decay, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=t.grad_clip,  # torch AdamW defaults, ours
        beta=t.kl.coef, epsilon=t.ppo.eps_low, epsilon_high=t.ppo.eps_high, loss_type=loss_types[t.agg],
        # "group": (r - mean) / (std + 1e-4) per prompt group, unbiased std, as group_advantages' grpo.
        scale_rewards="group" if t.advantage == "grpo" else "none",
        mask_truncated_completions=cfg.train.overlong.filter,
        bf16=False, gradient_checkpointing=False,  # TRL defaults both to True; async-rl: fp32, no checkpointing
        use_cpu=cfg.model.device == "cpu", report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
    )


def trl_worker(args) -> int:
    import torch

    torch.set_num_threads(args.trl_threads)
    import numpy as np
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.engines.torch_engine import TorchEngine
    from async_rl.evaluation import score_prompts, summarize
    from async_rl.prompting import stop_token_ids
    from async_rl.runtime import make_prompt_format, make_task_from_config

    seed, run_dir = args.seeds[0], args.out
    cfg = load_run_config(args, seed, args.model)
    task, prompt_format = make_task_from_config(cfg), make_prompt_format(cfg)
    assert not prompt_format.uses_chat, "bench_peer passes TRL plain-text prompts"
    prompts = [task.train_prompt(i) for i in range(cfg.train.max_steps * cfg.train.batch_groups)]
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})

    # TRL tokenizes a text prompt with the tokenizer's special tokens (<bos> prompt), as
    # async-rl's PromptFormat.encode does without a chat template, and decodes completions
    # up to and with the first EOS with skip_special_tokens=True, as response_text does.
    def task_reward(prompts, completions, answer, **_):
        return [task.reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    eval_prompts = task.eval_prompts()[:cfg.eval.size]
    stops = stop_token_ids(args.model, prompt_format.tokenizer)
    e = cfg.eval

    def held_out_accuracy(model) -> float:
        """An actor's evaluation round, on a copy of the model (TorchEngine freezes what it gets)."""
        engine = TorchEngine(copy.deepcopy(model), device=model.device, eos_token_id=stops)
        generator = torch.Generator().manual_seed(cfg.seed)
        parts = [score_prompts(engine, prompt_format, task, eval_prompts[i:i + e.batch_size], samples=e.pass_k,
                               max_new_tokens=e.max_new_tokens or cfg.actors.max_new_tokens,
                               temperature=e.temperature, generator=generator)
                 for i in range(0, len(eval_prompts), e.batch_size)]
        return summarize(*(np.concatenate([p[k] for p in parts]) for k in range(3)))["eval/accuracy"]

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
            t0 = time.perf_counter()
            accuracy = held_out_accuracy(model)
            seconds = time.perf_counter() - t0
            self.eval_s += seconds
            metrics.write(json.dumps({"step": step, "time": round(train_s, 3), "eval/accuracy": accuracy,
                                      "eval/seconds": round(seconds, 3)}) + "\n")
            return accuracy

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.evaluate(model, 0, 0.0)

        def on_step_begin(self, args_, state, control, **kwargs):
            if self.started is None:
                self.started, self.eval_s = time.perf_counter(), 0.0

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            step = self.last_step = state.global_step
            self.last_time = self.train_seconds()
            if step == 1:
                self.first_step_s = self.last_time
            if (e.every and step % e.every == 0) or step == cfg.train.max_steps:
                if self.evaluate(model, step, self.last_time) >= args.target:
                    control.should_training_stop = True

        def on_log(self, args_, state, control, logs=None, **kwargs):
            metrics.write(json.dumps({"step": state.global_step, **(logs or {})}) + "\n")

    clock = HeldOutEval()
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=GRPOConfig(**trl_settings(cfg, run_dir)),
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(str(args.model)),
                          callbacks=[clock])
    trainer.train()
    metrics.close()
    (run_dir / "result.json").write_text(json.dumps({
        "last_step": clock.last_step, "last_time": clock.last_time, "first_step_s": clock.first_step_s,
        "eval_s": clock.eval_s,
        "samples_per_step": cfg.train.batch_groups * cfg.train.group_size, "trl_version": trl.__version__}))
    return 0


# -- driver --------------------------------------------------------------------------
def spread(values: list[float]) -> dict | None:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)} if values else None


def emit(args, line: dict) -> None:
    print(json.dumps(line), flush=True)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def run_pairs(args) -> list[dict]:
    """Per seed: both systems from the same base model, one after the other; one JSON line each."""
    runners = {"trl": run_trl, "async-rl": run_async_rl}
    pairs = []
    for n, seed in enumerate(args.seeds):
        model = base_model(args, seed)
        order = args.systems if n % 2 == 0 else args.systems[::-1]  # alternate: drift of a shared machine cancels
        result = {}
        for system in order:
            say(f"seed {seed}: {system} ...")
            result[system] = runners[system](args, seed, model)
            say(f"seed {seed}: {system} done: {json.dumps(result[system])}")
        times = [result.get(s, {}).get("time_to_target_s") for s in SYSTEMS]
        line = {"seed": seed, "target": args.target, "max_steps": args.max_steps, "eval_every": args.eval_every,
                "set": args.set, "trl": result.get("trl"), "async_rl": result.get("async-rl"),
                "ratio_trl_over_async_rl": round(times[0] / times[1], 3) if all(times) else None}
        emit(args, line)
        pairs.append(line)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one pair of runs per seed")
    parser.add_argument("--target", type=float, default=0.9, help="held-out eval accuracy to reach")
    parser.add_argument("--max-steps", type=int, default=1000, help="train.max_steps: the lr schedule's length and a cap")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every this many steps (and at step 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-peer"), help="output directory")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="async-rl config override (repeatable); TRL follows the settings it maps")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="which systems to run")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory both start from (default: the demo model built per seed)")
    parser.add_argument("--_trl-worker", dest="trl_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args)

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        pairs = run_pairs(args)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if len(args.seeds) > 1:
        seconds = {s: [p[s]["time_to_target_s"] for p in pairs if p[s] and p[s]["reached"]] for s in ("trl", "async_rl")}
        ratios = [p["ratio_trl_over_async_rl"] for p in pairs if p["ratio_trl_over_async_rl"] is not None]
        emit(args, {"summary": True, "seeds": args.seeds, "target": args.target, "pairs_with_ratio": len(ratios),
                    "ratio_trl_over_async_rl": spread(ratios), "trl_time_to_target_s": spread(seconds["trl"]),
                    "async_rl_time_to_target_s": spread(seconds["async_rl"])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
