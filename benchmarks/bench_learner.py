"""Learner throughput and MFU under FSDP2, and torch-engine generation throughput.

    python benchmarks/bench_learner.py [--tiny] [--ranks 1] [--steps 3] [--warmup 1]
        [--variants padded,packed,padded+ac,packed+ac,...+compile] [--precision auto|fp32|bf16] [--attention eager]
        [--peak-tflops 989] [--prompt-len 64,256] [--response-len 32,1024]
        [--groups 32] [--group-size 8] [--minibatches 1] [--micro-batch-size 16] [--micro-batch-tokens 16384]
        [--pack-row-tokens N] [--gen-prompts 64]
        [--gen-tokens 256] [--no-gen] [--cpu] [--model HF_DIR]

Model: `--model HF_DIR` loads a real one (its weights do not matter here, its shape
does); otherwise a random-initialized `transformers.Qwen2Config` model. Default shape = Qwen2.5-0.5B
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings); `--tiny` = the demo's scale (hidden 64, 2 layers, vocab 16) with the demo's
batch shapes (64 groups x 8, prompts of 7 tokens, responses of 1-5), so it runs in
seconds on CPU. Weights are random: throughput does not depend on their values.

Learner: a world of --ranks processes (spawned here, or this process's torchrun world
when RANK is set), NCCL + one GPU per rank on CUDA, gloo on CPU; the policy is sharded
with the learner's own `shard_model` and trained with the real `train_step` (PPO,
GRPO, AdamW) on a synthetic batch whose lengths are uniform in --prompt-len and
--response-len; --minibatches > 1 splits the step into that many optimizer steps,
which adds a no-grad proximal forward over every micro-batch. Each variant builds its
model afresh; --warmup steps are discarded, then --steps timed steps, each between a
barrier and `torch.cuda.synchronize()`.
Precision: bf16 (FSDP2 MixedPrecisionPolicy) on CUDA, fp32 on CPU unless --precision.
--attention: the policy's attention kernel (learner.attention; default: the model's, sdpa).

FLOPs (useful model FLOPs, the PaLM paper's MFU, Chowdhery et al. 2022, arXiv
2204.02311, Appendix B), per step:
    6 * N_body * T_computed + 6 * V * H * T_scored + 12 * layers * H * sum_s T_s^2
    + (forward only) 2 * N_body * T_computed + 2 * V * H * T_scored + 4 * layers * H * sum_s T_s^2
      for each no-grad forward (the proximal policy when --minibatches > 1)
N_body = parameters without the V x H token embedding; T_computed = tokens the
decoder computes (real tokens: padding is not useful work; with shared prompts
(`shared` variants) each group's prompt counts once, as it is computed once);
T_scored = response tokens, the only ones whose next-token distribution the loss
needs, so the only useful V x H output projections (tied or not, the embedding lookup
is free); forward = 2 FLOPs per multiply-add, backward = 2x forward; attention
12 * layers * H * T per token of a T-token sequence (PaLM counts T without the causal
halving; so do we). Activation-checkpointing recompute is not counted (that would be
HFU).
MFU = FLOP/s per device / peak. On CUDA the peak is --peak-tflops (default 989 =
NVIDIA's H100/H200 SXM dense BF16 tensor-core peak, without sparsity). On CPU there
is no datasheet figure for one core, so the peak is measured in the same process,
dtype and thread count: the model's own matmuls (each linear layer's weight times a
micro-batch's tokens, and the output projection times its scored tokens) timed one by
one, peak = their FLOPs / their time (`matmul_peak_tflops`, reported on both devices).

Generation: `async_rl.actor.engines.torch_engine.TorchEngine` on one device (rank 0's),
an unsharded copy of the same model in the same dtype, --gen-prompts prompts x 1
sample, sampling exactly --gen-tokens new tokens (no EOS in the config, so no row
stops early); tokens/s = generated tokens / wall time of `generate`.

Output: one JSON object per line on stdout:
  {"kind": "learner", "variant", "pack", "share_prompt", "activation_checkpointing", "compile",
   "warmup_s" (the untimed steps: the first includes compiling), "first_loss" (the first step's loss:
   every variant starts from the same weights and batch), "precision", "attention",
   "device", "ranks", "params", "sequences", "tokens", "scored_tokens", "padded_tokens", "flops_per_step",
   "step_s" (median), "steps_s" (all), "tokens_per_s", "tflops" (per device), "matmul_peak_tflops",
   "mfu" (against the datasheet peak on CUDA, the measured matmul peak on CPU), "peak_rss_gb",
   "peak_gpu_gb" (torch's peak allocation during the variant's steps; null on CPU)}
  {"kind": "generate", "device", "precision", "params", "prompts", "new_tokens",
   "tokens", "seconds", "tokens_per_s"}
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from async_rl.learner.batching import assign_to_ranks, build_batch  # noqa: E402
from async_rl.run.processes import peak_rss_mb  # noqa: E402
from async_rl.wire import ExperienceGroup, Response  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, vocab_size=16, max_position_embeddings=64, tie_word_embeddings=True)
# name -> (learner.pack, learner.share_prompt, learner.activation_checkpointing, learner.compile)
VARIANTS = {f"{base}{ac}{compiled}": (pack, share, bool(ac), bool(compiled))
            for base, pack, share in (("padded", False, False), ("packed", True, False), ("shared", True, True))
            for ac in ("", "+ac") for compiled in ("", "+compile")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="demo-scale model and batch (CPU, seconds)")
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    ap.add_argument("--ranks", type=int, default=None, help="learner ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default="padded,packed,padded+ac,packed+ac")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--attention", choices=["sdpa", "eager"], default=None, help="learner.attention")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak (H100/H200 dense bf16)")
    ap.add_argument("--prompt-len", default=None, help="min,max prompt tokens")
    ap.add_argument("--response-len", default=None, help="min,max response tokens")
    ap.add_argument("--groups", type=int, default=None, help="prompt groups per step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--minibatches", type=int, default=1,
                    help="train.minibatches: > 1 adds a proximal forward over every micro-batch")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="rows per micro-batch")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per micro-batch")
    ap.add_argument("--pack-row-tokens", type=int, default=None, help="learner.pack_row_tokens (packed variants)")
    ap.add_argument("--gen-prompts", type=int, default=None)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--no-gen", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="an HF model directory instead of the random Qwen2 shape")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    # Presets: everything not given on the command line.
    preset = dict(prompt_len="7,7", response_len="1,5", groups=64, micro_batch_size=256, micro_batch_tokens=None,
                  gen_prompts=64, gen_tokens=8) if args.tiny else \
        dict(prompt_len="64,256", response_len="32,1024", groups=32, micro_batch_size=16,
             micro_batch_tokens=16384, gen_prompts=64, gen_tokens=256)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = "cuda" if cuda else "cpu"
    args.ranks = args.ranks or (torch.cuda.device_count() if cuda else 2)
    args.precision = ("bf16" if cuda else "fp32") if args.precision == "auto" else args.precision
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    return args


def model_config(args):
    from transformers import AutoConfig, Qwen2Config

    # No EOS: generation runs exactly --gen-tokens steps in every row.
    if args.model:
        return AutoConfig.from_pretrained(args.model, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    return Qwen2Config(**(TINY if args.tiny else QWEN25_05B), eos_token_id=None, bos_token_id=None,
                       pad_token_id=0)


def make_model(args, mcfg):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)  # identical initial weights on every rank and variant
    kernel = {"attn_implementation": args.attention} if args.attention else {}
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, config=mcfg, dtype=torch.float32, **kernel)
    return AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32, **kernel)


def synthetic_groups(args, vocab: int) -> list[ExperienceGroup]:
    """The same groups on every rank (seeded): lengths uniform in the given ranges."""
    rng = np.random.default_rng(args.seed)
    (p0, p1), (r0, r1) = (map(int, s.split(",")) for s in (args.prompt_len, args.response_len))
    groups = []
    for _ in range(args.groups):
        G = args.group_size
        lengths = rng.integers(r0, r1 + 1, size=G)
        prompt = rng.integers(1, vocab, size=int(rng.integers(p0, p1 + 1)))
        tokens = rng.integers(1, vocab, size=(G, r1))  # each response: a row's first `lengths` tokens
        logprobs = -rng.random((G, r1)) * 3
        groups.append(ExperienceGroup.from_responses(
            [Response(tokens[j, :n], logprobs[j, :n], np.zeros(n)) for j, n in enumerate(lengths)],
            actor_id=0, group=len(groups), prompt_id=0, version=0, prompt_tokens=prompt.astype(np.int32),
            rewards=rng.integers(0, 2, size=G).astype(np.float32), truncated=(lengths == r1).astype(np.uint8),
            gen_seconds=0.0))
    return groups


def step_flops(mcfg, n_params: int, seq_lengths: torch.Tensor, scored: int, no_grad_forwards: int = 0) -> float:
    """The module docstring's formula: useful FLOPs of one learner step."""
    head = mcfg.vocab_size * mcfg.hidden_size
    body = n_params - head * (1 if mcfg.tie_word_embeddings else 2)
    lengths = seq_lengths.double()
    forward = 2 * body * lengths.sum() + 2 * head * scored + 4 * mcfg.num_hidden_layers * mcfg.hidden_size * (
        lengths ** 2).sum()
    return float(forward * (3 + no_grad_forwards))


def linear_shapes(model: torch.nn.Module, tokens: int, scored: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every linear layer's forward matmul on a micro-batch: `tokens` rows,
    `scored` rows for the output projection."""
    head = model.get_output_embeddings()
    return [(scored if module is head else tokens, module.in_features, module.out_features)
            for module in model.modules() if isinstance(module, torch.nn.Linear)]


def matmul_peak_tflops(shapes: list[tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                       repeats: int = 5) -> float:
    """FLOPs / time of the given matmuls, each timed alone (median of `repeats`) after a
    warm-up: the rate this process reaches on the model's own shapes."""
    flops = seconds = 0.0
    for m, k, n in sorted(set(shapes)):
        count = shapes.count((m, k, n))
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        times = []
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            a @ b
            sync(device)
            times.append(time.perf_counter() - start)
        flops += 2.0 * m * k * n * count
        seconds += statistics.median(times[1:]) * count
    return flops / seconds / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_learner(args, rank: int, world: int, device: torch.device) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from async_rl.config import build_config
    from async_rl.learner.models import Models
    from async_rl.learner.optimizer import adamw
    from async_rl.learner.sharding import shard_model
    from async_rl.learner.step import micro_batch_plan, train_step

    mcfg = model_config(args)
    groups = synthetic_groups(args, mcfg.vocab_size)
    batch = build_batch(groups, pad_id=0)  # the whole step's rows, for its token counts
    local = build_batch(assign_to_ranks(groups, world, args.minibatches)[rank], pad_id=0).to(device)
    lengths = batch.attention.sum(-1)
    # With shared prompts a group is one sequence of its prompt and all its responses.
    trees = (batch.prompt_len.view(-1, args.group_size)[:, 0]
             + (lengths - batch.prompt_len).view(-1, args.group_size).sum(-1))
    mesh = init_device_mesh(device.type, (world,))
    out = []
    for variant in args.variants:
        pack, share, ac, compiled = VARIANTS[variant]
        cfg = build_config({
            "train": {"batch_groups": args.groups, "group_size": args.group_size, "loss": "ppo", "advantage": "grpo",
                      "minibatches": args.minibatches},
            "learner": {"ranks": world, "micro_batch_size": args.micro_batch_size, "pack": pack, "share_prompt": share,
                        "micro_batch_tokens": args.micro_batch_tokens, "precision": args.precision,
                        "attention": args.attention,
                        "pack_row_tokens": args.pack_row_tokens,
                        "activation_checkpointing": ac, "compile": compiled}})
        model = make_model(args, mcfg).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        policy = shard_model(model, mesh, precision=args.precision, activation_checkpointing=ac, compile=compiled)
        models = Models(policy, adamw(policy.parameters(), lr=1e-6, weight_decay=0.0))
        times, warmup_s, first_loss = [], [], None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.steps):
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            stats = train_step(cfg, models, local)
            sync(device)
            dist.barrier()  # the step ends when the slowest rank is done
            first_loss = stats["loss/total"] if first_loss is None else first_loss
            (times if i >= args.warmup else warmup_s).append(time.perf_counter() - start)
        computed = trees if share else lengths
        scored = int(batch.loss_mask.sum())
        flops = step_flops(mcfg, n_params, computed, scored, no_grad_forwards=int(args.minibatches > 1))
        step_s = statistics.median(times)
        tflops = flops / step_s / world / 1e12
        micros = sum(len(m) for m in micro_batch_plan(cfg, local))
        peak = matmul_peak_tflops(linear_shapes(model, int(computed.sum()) // world // micros,
                                                scored // world // micros),
                                  torch.bfloat16 if args.precision == "bf16" else torch.float32, device)
        out.append({"kind": "learner", "variant": variant, "pack": pack, "share_prompt": share,
                    "activation_checkpointing": ac, "compile": compiled, "warmup_s": warmup_s,
                    "first_loss": first_loss,
                    "precision": args.precision, "attention": model.config._attn_implementation,
                    "device": device.type, "ranks": world, "params": n_params,
                    "sequences": int(batch.tokens.shape[0]), "tokens": int(computed.sum()), "scored_tokens": scored,
                    "padded_tokens": int(batch.tokens.numel()), "flops_per_step": flops, "step_s": step_s,
                    "steps_s": times, "tokens_per_s": float(computed.sum()) / step_s, "tflops": tflops,
                    "matmul_peak_tflops": peak,
                    "mfu": tflops / (args.peak_tflops if device.type == "cuda" else peak),
                    # Monotone within the process: one variant per run for its own peak.
                    "peak_rss_gb": peak_rss_mb() / 1024,
                    "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None})
        del models, policy, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def bench_generate(args, device: torch.device) -> dict:
    from async_rl.actor.engines.torch_engine import TorchEngine

    mcfg = model_config(args)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    engine = TorchEngine(make_model(args, mcfg), device=device, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    p0, p1 = map(int, args.prompt_len.split(","))
    prompts = [rng.integers(1, mcfg.vocab_size, size=int(rng.integers(p0, p1 + 1))).tolist()
               for _ in range(args.gen_prompts)]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    engine.generate(prompts[:2], max_new_tokens=2, generator=gen)  # warm-up (kernels, allocator)
    sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=args.gen_tokens, generator=gen)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for row in out for c in row)
    return {"kind": "generate", "device": device.type, "precision": args.precision,
            "params": sum(p.numel() for p in engine.model.parameters()), "prompts": len(prompts),
            "new_tokens": args.gen_tokens, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def worker(rank: int, world: int, args, port: int | None) -> None:
    """One learner rank; rank 0 prints the JSON lines."""
    if port is not None:  # spawned here; under torchrun the environment is already set
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        for line in bench_learner(args, dist.get_rank(), dist.get_world_size(), device):
            if dist.get_rank() == 0:
                print(json.dumps(line), flush=True)
        if not args.no_gen and dist.get_rank() == 0:
            print(json.dumps(bench_generate(args, device)), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # inherited by the spawned ranks
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    if args.ranks == 1:
        worker(0, 1, args, free_port())
        return 0
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(args.ranks, args, free_port()), nprocs=args.ranks, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
