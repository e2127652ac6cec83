"""Peer benchmark: TRL's GRPOTrainer against async-rl, time to a target held-out accuracy.

    python benchmarks/bench_peer.py [--config configs/demo.yaml] [--seeds 0 1 2] [--target 0.9]
                                  [--max-steps 1000] [--eval-every 50] [--out runs/bench-peer]
                                  [--set key=value ...] [--async-rl-set key=value ...]
                                  [--trl-set key=value ...] [--systems trl async-rl]
                                  [--trl-threads 2] [--model DIR]

Install TRL next to async-rl, keeping the CPU torch (an unpinned install may pull a
newer, CUDA torch):

    pip install -e ".[bench]" -c <(echo torch==$(python -c 'import torch; print(torch.__version__.split("+")[0])'))

For each seed, both systems start from the same model: --model DIR, else the config's
model.path (configs/smollm2.yaml: the converted SmolLM2-135M-Instruct), else the demo
model warm-started once into OUT/seedS/base_model as `async-rl train` builds it. They run
one after the other (the order alternates from seed to seed), each as a subprocess of
this script: async-rl as `async-rl train CONFIG`, TRL as benchmarks/peer_trl.py, one
process with --trl-threads torch threads. Both train on the same prompts in the same
order (task.train_prompt(0), (1), ...) rendered the same way (the chat template when the
config uses one; peer_trl.py checks the token ids), score them with the task's own reward
on the decoded completion without special tokens, and evaluate greedily on the first
eval.size held-out prompts with the same code (async_rl.actor.rollout.rollout.Rollout.scores) every
--eval-every steps and at step 0.

Figures per system (one JSON line per seed on stdout; with several seeds a last line with
the median, min and max over seeds; all also appended to OUT/results.jsonl; progress on stderr):
  protocols          per way of scoring a policy, the step and clocks of the first
                     evaluation reaching the target, and the curve:
                       own      as the system itself samples: TRL's weights under its bf16
                                autocast with its attention kernel; async-rl's actors' engine
                                (the config's actors.engine), scored by its evaluator
                       float32  both by the same torch engine in float32 (the actors'
                                attention kernel); async-rl's evaluator scores its master
                                weights there (eval.also_dtypes=[float32])
                     each with two clocks:
                       with_eval_s     TRL: seconds from the start of its first step to
                                       the end of the step evaluated, its evaluations
                                       (which pause its training) included; async-rl:
                                       the learner's clock when it made that version
                                       (`version_time`), which counts whatever the
                                       evaluation cost it (the evaluator shares the CPU)
                       without_eval_s  TRL: the same minus its evaluations; async-rl: the
                                       same as with (its evaluator runs beside the
                                       learner: there is nothing to subtract)
  time_to_target_s   the own protocol, evaluation counted (with_eval_s).
  steps_to_target    learner (optimizer) steps up to that evaluation.
  samples_per_s      steps_to_target * samples per step / time_to_target_s.
  cpu_s_per_sample   user+system CPU seconds of the system's whole process tree
                     (RUSAGE_CHILDREN around the subprocess; imports, model loading,
                     evaluation and shutdown included, for both) / (steps_run * samples per
                     step): per trained sample (async-rl trains on while its evaluator's
                     lines come in, so steps_run may pass steps_to_target).
  first_step_s       the same clock at the end of step 1 (async-rl: mostly start-up).
  ratio_trl_over_async_rl  TRL time_to_target_s / async-rl's (> 1: async-rl is faster);
  ratios             the same per protocol and clock, and at each evaluated step both
                     reached ("same_step", own protocol, evaluation counted).
A run goes on until every protocol has reached the target (async-rl is then stopped by
SIGTERM, its checkpoint written after the measurement) or --max-steps.
Without the target reached, the *_to_target fields are null and samples/s and CPU/sample
cover the steps run.

Settings: TRL's are derived from the resolved async-rl config (CONFIG, the seed, --set and
then --trl-set overrides, --max-steps, --eval-every; peer_trl.trl_settings), so
`--set train.batch_groups=8` shrinks both, and --async-rl-set changes async-rl's alone.
configs/demo.yaml gives 64 prompts x 8 samples per step (per_device_train_batch_size =
512, num_generations = 8, one optimizer step per batch), max 4 new tokens, temperature 1,
top_p 1 and no top-k, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), lr 5e-4 with
cosine decay to 0.1 x lr over max_steps and no warmup, grad-norm clip 1, no KL (beta 0),
PPO clip 0.2/0.2, loss averaged over all tokens of the batch, advantages (r - mean) / std
per group, and the learner's precision and attention kernel (demo: fp32; smollm2.yaml:
bf16, which in TRL is accelerate's bf16 autocast over fp32 weights, as FSDP2's bf16
policy is in async-rl, and eager attention).
Differences that remain:
  - async-rl is asynchronous (the demo's max_staleness): its samples may come from weights
    up to that many steps old, weighted by decoupled PPO's capped importance weight. TRL generates each
    batch with the current weights (in both, one optimizer step per batch: ratio 1, no clip).
  - Corrections: async-rl applies train.correction (smollm2.yaml: IcePop) to the gap
    between its actors' numbers and the learner's; TRL samples with the model it trains
    (under the same autocast), so it has no such gap to correct.
  - GRPO's std epsilon: TRL divides by std + 1e-4, async-rl by std + 1e-6 (both unbiased
    std; with 0/1 rewards a group's nonzero std is >= 0.35, so advantages differ < 0.03%).
  - Warmup, when set: TRL's is step/warmup, async-rl's (step+1)/warmup (the demo has none).
  - Layout: async-rl runs the config's learner ranks and actors (both configs: 1 and 1,
    1 thread each); TRL one process of --trl-threads threads that generates, then trains.
"""
from __future__ import annotations

import argparse
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

from async_rl.run.directory import RunDir  # noqa: E402  (after the path above)


def load_run_config(config: Path, seed: int, sets: list[str], max_steps: int, eval_every: int,
                    model: Path | None = None):
    from async_rl.config import load_config

    overrides = [f"seed={seed}", *sets, f"train.max_steps={max_steps}", f"eval.every={eval_every}"]
    return load_config(config, overrides + ([f"model.path={model}"] if model else []))


def run_config(args, seed: int, system: str, model: Path | None = None):
    """The resolved config one system runs: --set for both, then --trl-set or --async-rl-set."""
    extra = args.trl_set if system == "trl" else args.async_rl_set
    return load_run_config(args.config, seed, [*args.set, *extra], args.max_steps, args.eval_every, model)


def base_model(args, seed: int) -> Path:
    """--model, else the config's model.path, else (`path: demo`) the demo model warm-started
    exactly as `async-rl train` does (launcher.prepare_run_dir)."""
    if args.model:
        return args.model.resolve()
    cfg = run_config(args, seed, "async-rl")
    if cfg.model.path != "demo":
        return Path(cfg.model.path).resolve()  # as `async-rl train` reads it: from the working directory
    from async_rl.run.demo_model import ensure_demo_model

    say(f"seed {seed}: the demo base model in {args.out / f'seed{seed}' / 'base_model'}")
    return ensure_demo_model(cfg, (args.out / f"seed{seed}" / "base_model").resolve())


def say(message: str) -> None:
    print(f"[bench_peer] {message}", file=sys.stderr, flush=True)


# How a policy is scored: as its own system samples (TRL: its weights under its bf16
# autocast; async-rl: its actors' engine), or in float32 by the same torch engine.
PROTOCOLS = {"own": "eval/accuracy", "float32": "eval/accuracy@float32"}
# Each system's clock at an evaluation, with and without the time evaluation cost it.
# async-rl's evaluator scores saved versions beside the learner, so its learner's clock
# at a version (`version_time`) is the only one: nothing is left to subtract, and it
# counts the evaluator's share of the CPU.
CLOCKS = {"trl": {"with_eval": "time_with_eval", "without_eval": "time"},
          "async-rl": {"with_eval": "version_time", "without_eval": "version_time"}}


def first_hit(evals: list[dict], target: float, key: str = "eval/accuracy") -> dict | None:
    """The first evaluation after training started (step >= 1) whose `key` reaches the target."""
    return next((e for e in evals if e["step"] >= 1 and e.get(key) is not None and e[key] >= target), None)


def all_hit(evals: list[dict], target: float) -> bool:
    """Every protocol the lines score has reached the target (a run may stop)."""
    keys = [key for key in PROTOCOLS.values() if evals and key in evals[0]]
    return bool(keys) and all(first_hit(evals, target, key) for key in keys)


def clock(system: str, line: dict, which: str) -> float:
    return line.get(CLOCKS[system][which], line["time"])


def protocol_figures(system: str, evals: list[dict], target: float) -> dict:
    """Per protocol: the step and both clocks of the first evaluation reaching the target
    (None when it was not reached), and the curve (step, clock with evaluation, accuracy)."""
    out = {}
    for name, key in PROTOCOLS.items():
        if not evals or key not in evals[0]:
            continue
        hit = first_hit(evals, target, key)
        out[name] = {"step": hit["step"] if hit else None,
                     **{f"{which}_s": round(clock(system, hit, which), 2) if hit else None
                        for which in ("with_eval", "without_eval")},
                     "curve": [(e["step"], round(clock(system, e, "with_eval"), 1), e[key]) for e in evals]}
    return out


def speedups(trl: dict, ours: dict) -> dict:
    """TRL's time over async-rl's, per protocol and clock; and at each evaluated step both
    reach (clocks with evaluation)."""
    out = {}
    for name in PROTOCOLS:
        a, b = trl.get("protocols", {}).get(name), ours.get("protocols", {}).get(name)
        if not a or not b:
            continue
        out[name] = {which: round(a[f"{which}_s"] / b[f"{which}_s"], 3) if a[f"{which}_s"] and b[f"{which}_s"]
                     else None for which in ("with_eval", "without_eval")}
    theirs = {step: t for step, t, _ in trl.get("protocols", {}).get("own", {}).get("curve", []) if step}
    mine = {step: t for step, t, _ in ours.get("protocols", {}).get("own", {}).get("curve", []) if step}
    out["same_step"] = {step: round(theirs[step] / mine[step], 3) for step in sorted(theirs.keys() & mine.keys())
                        if mine[step] > 0}
    return out


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
                if stop_at_target and not stopped and all_hit(evals, target):
                    proc.send_signal(signal.SIGTERM)  # the launcher checkpoints and stops its processes
                    stopped = True
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.returncode, cpu


def figures(system: str, evals: list[dict], last_step: int, last_time: float, first_step_s: float | None,
            cpu_s: float, samples_per_step: int, target: float) -> dict:
    """The per-system JSON fields from its evaluation lines (own protocol, evaluation
    counted: CLOCKS["with_eval"])."""
    hit = first_hit(evals, target)
    seconds = clock(system, hit, "with_eval") if hit else None
    steps, seconds_run = (hit["step"], seconds) if hit else (last_step, last_time)
    samples = steps * samples_per_step
    return {"reached": hit is not None,
            "time_to_target_s": round(seconds, 2) if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "samples_per_s": round(samples / seconds_run, 1) if seconds_run > 0 else None,
            "cpu_s_per_sample": round(cpu_s / (last_step * samples_per_step), 5) if last_step else None,
            "cpu_s": round(cpu_s, 1), "steps_run": last_step,
            "first_step_s": round(first_step_s, 2) if first_step_s is not None else None,
            "eval_first": evals[0]["eval/accuracy"] if evals else None,
            "eval_last": evals[-1]["eval/accuracy"] if evals else None}


def run_async_rl(args, seed: int, model: Path) -> dict:
    cfg = run_config(args, seed, "async-rl", model)
    run_dir = (args.out / f"seed{seed}" / "async-rl").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)  # the launcher refuses a directory that holds a run
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(args.config), f"run_dir={run_dir}", f"model.path={model}",
           f"seed={seed}", "eval.placement=evaluator", "eval.also_dtypes=[float32]", *args.set, *args.async_rl_set,
           f"train.max_steps={args.max_steps}",
           f"eval.every={args.eval_every}"]
    code, cpu_s = run_measured("async-rl", cmd, run_dir, run_dir.parent / "async-rl.log", args.target, True)
    steps, evals = RunDir(run_dir).steps_and_evals()
    if code not in (0, 143) or not steps:
        raise SystemExit(f"async-rl failed (exit {code}); see {run_dir.parent / 'async-rl.log'}")
    samples_per_step = cfg.train.batch_groups * cfg.train.group_size
    return {**figures("async-rl", evals, steps[-1]["step"], steps[-1]["time"], steps[0]["time"], cpu_s,
                      samples_per_step, args.target),
            "protocols": protocol_figures("async-rl", evals, args.target), "exit": code, "run_dir": str(run_dir)}


def run_trl(args, seed: int, model: Path) -> dict:
    run_dir = (args.out / f"seed{seed}" / "trl").resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, str(ROOT / "benchmarks/peer_trl.py"), "--config", str(args.config), "--seed", str(seed),
           "--model", str(model), "--out", str(run_dir), "--target", str(args.target),
           "--max-steps", str(args.max_steps), "--eval-every", str(args.eval_every), "--threads", str(args.trl_threads),
           *[f"--set={s}" for s in [*args.set, *args.trl_set]]]
    code, cpu_s = run_measured("trl", cmd, run_dir, run_dir.parent / "trl.log", args.target, False)
    if code != 0 or not (run_dir / "result.json").exists():
        raise SystemExit(f"TRL failed (exit {code}); see {run_dir.parent / 'trl.log'}")
    worker = json.loads((run_dir / "result.json").read_text())
    evals = RunDir(run_dir).evals()
    return {**figures("trl", evals, worker["last_step"], worker["last_time_with_eval"], worker["first_step_s"],
                      cpu_s, worker["samples_per_step"], args.target),
            "protocols": protocol_figures("trl", evals, args.target),
            "eval_s_subtracted": round(worker["eval_s"], 2), "trl_version": worker["trl_version"],
            "run_dir": str(run_dir)}


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
                "config": str(args.config), "set": args.set, "async_rl_set": args.async_rl_set,
                "trl_set": args.trl_set, "trl": result.get("trl"), "async_rl": result.get("async-rl"),
                "ratio_trl_over_async_rl": round(times[0] / times[1], 3) if all(times) else None,
                "ratios": speedups(result.get("trl") or {}, result.get("async-rl") or {})}
        emit(args, line)
        pairs.append(line)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one pair of runs per seed")
    parser.add_argument("--target", type=float, default=0.9, help="held-out eval accuracy to reach")
    parser.add_argument("--max-steps", type=int, default=1000,
                        help="train.max_steps: the lr schedule's length and a cap")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every this many steps (and at step 0)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-peer"), help="output directory")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the async-rl config both are set up from")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both systems (repeatable); TRL follows the settings it maps")
    parser.add_argument("--async-rl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for async-rl only, after --set (its best settings)")
    parser.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for TRL only, after --set")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="which systems to run")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory both start from (default: the demo model built per seed)")
    args = parser.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        pairs = run_pairs(args)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if len(args.seeds) > 1:
        seconds = {s: [p[s]["time_to_target_s"] for p in pairs if p[s] and p[s]["reached"]]
                   for s in ("trl", "async_rl")}
        ratios = [p["ratio_trl_over_async_rl"] for p in pairs if p["ratio_trl_over_async_rl"] is not None]
        by_protocol = {name: {which: spread([p["ratios"][name][which] for p in pairs
                                            if p["ratios"].get(name, {}).get(which) is not None])
                              for which in ("with_eval", "without_eval")} for name in PROTOCOLS}
        emit(args, {"summary": True, "seeds": args.seeds, "target": args.target, "pairs_with_ratio": len(ratios),
                    "ratio_trl_over_async_rl": spread(ratios), "trl_time_to_target_s": spread(seconds["trl"]),
                    "async_rl_time_to_target_s": spread(seconds["async_rl"]), "ratios": by_protocol})
    return 0


if __name__ == "__main__":
    sys.exit(main())
