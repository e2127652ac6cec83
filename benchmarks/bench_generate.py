"""Generation throughput of the actors' engines on one model: the torch engine and vLLM,
in float32 and bfloat16, on the same prompts and settings; the torch engine also with
LoRA adapters.

    python benchmarks/bench_generate.py [--config configs/smollm2.yaml]
        [--variants torch:float32,torch:bfloat16,vllm:float32,vllm:bfloat16]
        [--prompts 8] [--n 8] [--max-new-tokens 24] [--temperature 0.7] [--calls 4] [--threads 1]
        [--path engine|rollout|eval] [--set key=value ...]

The prompts are the config's task's first training prompts, through its chat template,
with its stop ids, as an actor sends them; each call samples --n responses per prompt
(one actor request of --prompts groups). Each variant runs in a process of its own (vLLM
keeps one engine per process) with --threads intra-op threads; its first call is left
out (warm-up), and tokens/s = generated tokens / wall time of `generate`.

`--path rollout` times what an actor does with a work grant instead of `generate` alone:
the same call through the actors' sample-making path (generate, score every response
with the guarded reward, encode one ExperienceGroup per prompt), and reports samples/s
(responses) beside tokens/s. `--path eval` times an evaluation chunk instead: the config's
first --prompts held-out prompts scored as an actor scores an eval grant (eval.pass_k
samples each, greedy unless eval.temperature > 0, eval.max_new_tokens), so --n and
--temperature do not apply; samples_per_s is then prompts scored per second. `--set`
overrides config keys (e.g. `model.path=DIR` for the demo config, whose model is built
into a run directory). The torch variants use the config's actors.engine.attention when
its actors run the torch engine.

A third field `compile` compiles the torch engine's transformer blocks
(actors.engine.compile; the first call, left out, pays for compiling: its time is
`warmup_s`). A field adds LoRA adapters of that rank to a torch variant (on the config's
model.lora.target_modules): `torch:float32:lora8` as an actor runs it (merged into the
weights in float32, lora/folded.py), `torch:float32:lora8-unmerged` with peft's adapter
matmuls in every forward. Fresh adapters compute the base exactly, so every variant
samples the same tokens.

Output: one JSON object per variant on stdout
  {"engine", "dtype", "threads", "init_s", "calls_tokens_per_s" (timed calls),
   "tokens_per_s" (their median), "samples_per_s" (median, --path rollout), "peak_rss_gb"}
then one line per variant with its ratio to the first variant.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_variant(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from async_rl.actor.engines import make_engine
    from async_rl.config import load_config
    from async_rl.run.processes import peak_rss_mb
    from async_rl.tasks import task_from_config
    from async_rl.tasks.prompt_format import prompt_format_for, stop_token_ids

    engine_name, dtype, *extra = args.worker.split(":")
    cfg = load_config(args.config, args.set)
    prompt_format = prompt_format_for(cfg.model.path, cfg.task)
    task = task_from_config(cfg.task, cfg.seed)
    prompts = [prompt_format.encode(task.train_prompt(i)) for i in range(args.prompts)]
    options = dict(eos_token_id=stop_token_ids(cfg.model.path, prompt_format.tokenizer))
    if engine_name == "vllm":
        options.update(dtype=dtype, threads=args.threads, seed=cfg.seed)
    else:  # the config's kernel when its actors run the torch engine
        options.update(dtype=getattr(torch, dtype), attention=getattr(cfg.actors.engine, "attention", None))
    lora = next((e for e in extra if e.startswith("lora")), "")
    if "compile" in extra:
        options["compile"] = True
    if lora:
        options["lora"] = cfg.model.lora.model_copy(update={"rank": int(lora.removeprefix("lora").split("-")[0])})
    started = time.perf_counter()
    engine = make_engine(engine_name, model_or_path=cfg.model.path, device="cpu", **options)
    if lora.endswith("-unmerged") and engine._folded is not None:
        engine.model.unmerge_adapter()
        engine._folded = None
    init_s = time.perf_counter() - started
    generator = torch.Generator().manual_seed(cfg.seed)
    make_samples = {"rollout": rollout_path, "eval": eval_path}.get(args.path)
    make_samples = make_samples(cfg, task, prompt_format, args) if make_samples else None
    rates, sample_rates, call_s = [], [], []
    for _ in range(args.calls):
        started = time.perf_counter()
        if make_samples is not None:
            tokens, samples = make_samples(engine, generator)
        else:
            out = engine.generate(prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, generator=generator)
            tokens, samples = sum(len(c) for group in out for c in group), args.prompts * args.n
        elapsed = time.perf_counter() - started
        call_s.append(elapsed)
        rates.append(tokens / elapsed)
        sample_rates.append(samples / elapsed)
    timed = rates[1:]
    return {"engine": engine_name, "dtype": ":".join([dtype, *extra]), "threads": args.threads,
            "path": args.path, "init_s": round(init_s, 1), "warmup_s": round(call_s[0], 2),
            "calls_tokens_per_s": [round(r, 1) for r in timed], "tokens_per_s": round(statistics.median(timed), 1),
            "samples_per_s": round(statistics.median(sample_rates[1:]), 1),
            "peak_rss_gb": round(peak_rss_mb() / 1024, 2)}


def rollout_path(cfg, task, prompt_format, args):
    """A function (engine, generator) -> (tokens, samples) that runs one work grant of
    the config's first --prompts training prompts through the actors' sample-making path."""
    from async_rl.actor.rollout.rollout import Rollout
    from async_rl.wire import WorkGrant, decode, encode

    cfg.train.group_size, cfg.actors.max_new_tokens, cfg.actors.temperature = args.n, args.max_new_tokens, \
        args.temperature
    grant = WorkGrant(groups=list(range(args.prompts)), prompt_ids=list(range(args.prompts)))

    def run(engine, generator):
        rollout = Rollout.from_config(cfg, engine, prompt_format, task, generator)
        groups = [decode(encode(g)) for g in rollout.experience(grant, actor_id=0)]  # as an actor pushes them
        return sum(int(g.response_lengths.sum()) for g in groups), sum(len(g.response_lengths) for g in groups)

    return run


def eval_path(cfg, task, prompt_format, args):
    """A function (engine, generator) -> (tokens, prompts) that scores one evaluation chunk
    of the config's first --prompts held-out prompts through the actors' scoring path."""
    from async_rl.actor.rollout.rollout import Rollout

    prompt_ids = [p.id for p in task.eval_prompts()[:args.prompts]]

    def run(engine, generator):
        scores = Rollout.from_config(cfg, engine, prompt_format, task, generator).scores(prompt_ids)
        return int(scores.lengths.sum()), len(prompt_ids)

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2.yaml")
    ap.add_argument("--variants", default="torch:float32,torch:bfloat16,vllm:float32,vllm:bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--calls", type=int, default=4, help="generate calls per variant; the first is a warm-up")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--path", choices=["engine", "rollout", "eval"], default="engine",
                    help="time engine.generate alone, the actors' whole sample-making path, or an eval chunk")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # engine:dtype, run in this process
    args = ap.parse_args(argv)
    if args.calls < 2:
        ap.error("--calls must be at least 2 (the first is a warm-up)")
    if args.worker:
        print(json.dumps(run_variant(args)), flush=True)
        return 0
    results = []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TRANSFORMERS_VERBOSITY="error")
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        proc = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                               "--worker", variant], cwd=ROOT, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"bench_generate: {variant} failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        results.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
    base = results[0]
    for r in results:
        print(f"{r['engine']}:{r['dtype']}: {r['tokens_per_s']:.0f} tokens/s "
              f"({min(r['calls_tokens_per_s']):.0f}-{max(r['calls_tokens_per_s']):.0f}), "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x {base['engine']}:{base['dtype']}, "
              f"start {r['init_s']:.0f} s, first call {r['warmup_s']:.1f} s, peak RSS {r['peak_rss_gb']:.2f} GiB"
              + (f", {r['samples_per_s']:.1f} samples/s" if r["path"] == "rollout" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
