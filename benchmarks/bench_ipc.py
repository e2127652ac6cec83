"""Weight sync to an actor on the learner's own GPU (CUDA IPC) against a device-to-device
copy of the same bytes.

    python benchmarks/bench_ipc.py [--model qwen2.5-0.5b|tiny] [--dtype float32] [--bucket-mb 16]
                                 [--reps 10] [--warmup 2] [--timeout-s 120] [--cpu]

Rank 0 is this process: a real `WeightSender` (store, broadcast thread, double-
buffered bucket sets) on GPU 0. The actor is one spawned process on the same GPU
holding a real `ParameterReceiver`; sharing the learner's GPU, it takes the CUDA-IPC
transport (sync.transport=auto). The parameters have the shapes of a real architecture
(Qwen2.5-0.5B by default, from a meta-device skeleton: no weights are read), in the
learner's wire dtype (float32 master weights).

Timed per version, alternating with the reference, after --warmup rounds of each:
  sync  from `publish()` (the copy into the free bucket set) until the actor has
        copied the set into its own buckets and the broadcaster counts the sync
        complete: two device copies plus the store round trips that order them
  copy  one `dst.copy_(src)` of a flat tensor of the same bytes on the same GPU:
        what one device-to-device copy of the weights costs (the floor of any way to
        get them into a second buffer)
`copy_over_sync` = copy seconds / sync seconds (1.0 would be a sync as fast as one copy).
With --cpu (or no GPU) the same script runs on gloo with host buffers (its plumbing
check; the figures then mean nothing for CUDA IPC).

Output: one JSON object on stdout (kind "ipc_sync").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_learner import QWEN25_05B, TINY  # noqa: E402  (the learner benchmark's shapes)

from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.sender import WeightSender  # noqa: E402


def model_specs(shape: dict, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of a Qwen2 model's parameters, tied weights once."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(Qwen2Config(**shape))
    return [(name, tuple(p.shape), dtype) for name, p in skeleton.named_parameters()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def actor(conn, specs, bucket_mb: float, timeout_s: float, device_name: str) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params = [(n, torch.zeros(shape, dtype=dt, device=device)) for n, shape, dt in specs]
    receiver = ParameterReceiver(params, bucket_mb=bucket_mb, backend="nccl" if device.type == "cuda" else "gloo",
                              timeout_s=timeout_s)
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":  # skip the teardown of gloo's threads, which can abort at exit
            conn.close()
            os._exit(0)
        _, epoch, host, port = msg
        receiver.receive(epoch=epoch, rank=1, world_size=2, store_host=host, store_port=port)
        sync(device)
        checksum = float(sum(p.double().sum().item() for _, p in params)) if msg[0] == "check" else None
        conn.send(("done", receiver.transport, checksum))


def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    specs = model_specs(TINY if args.model == "tiny" else QWEN25_05B, dtype)
    g = torch.Generator().manual_seed(0)
    source = [(n, torch.randn(shape, generator=g).to(dtype).to(device)) for n, shape, _ in specs]
    nbytes = sum(t.numel() * t.element_size() for _, t in source)
    flat_src = torch.randn(nbytes // dtype.itemsize, generator=g).to(dtype).to(device)
    flat_dst = torch.empty_like(flat_src)
    bc = WeightSender(specs, bucket_mb=args.bucket_mb, host="127.0.0.1", backend="nccl" if cuda else "gloo",
                           device=device, timeout_s=args.timeout_s)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=actor, args=(child, specs, args.bucket_mb, args.timeout_s, str(device)), daemon=True)
    proc.start()
    child.close()

    def answer():
        if not conn.poll(args.timeout_s):
            raise TimeoutError("the actor did not answer")
        return conn.recv()

    times: dict[str, list[float]] = {"sync": [], "copy": []}
    transport = None
    try:
        answer()  # ready
        bc.set_members([1])
        want = float(sum(t.double().sum().item() for _, t in source))
        for version in range(1, args.warmup + args.reps + 1):
            conn.send(("check" if version == 1 else "sync", 1, bc.host, bc.port))
            t0 = time.perf_counter()
            bc.publish(version, iter(source))
            _, transport, got = answer()
            while bc.completed < version:
                if time.perf_counter() - t0 > args.timeout_s:
                    raise TimeoutError("the broadcaster never counted the sync complete")
                time.sleep(0.0001)
            sync_s = time.perf_counter() - t0
            if got is not None and abs(got - want) > 1e-6 * max(1.0, abs(want)):
                raise RuntimeError(f"the actor's weights differ from the source (checksum {got} vs {want})")
            sync(device)
            t0 = time.perf_counter()
            flat_dst.copy_(flat_src)
            sync(device)
            copy_s = time.perf_counter() - t0
            if version > args.warmup:
                times["sync"].append(sync_s)
                times["copy"].append(copy_s)
        conn.send(("stop",))
    finally:
        bc.close(wait_s=5)
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"kind": "ipc_sync", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "transport": transport, "model": args.model, "params": sum(t.numel() for _, t in source),
            "dtype": args.dtype, "bytes": nbytes, "buckets": len(bc.plan), "bucket_mb": args.bucket_mb,
            "reps": args.reps, "sync_s": med["sync"], "copy_s": med["copy"],
            "sync_gbps": nbytes / med["sync"] / 1e9, "copy_gbps": nbytes / med["copy"] / 1e9,
            "copy_over_sync": med["copy"] / med["sync"],
            "sync_s_all": [round(t, 6) for t in times["sync"]], "copy_s_all": [round(t, 6) for t in times["copy"]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="float32", help="wire dtype (the learner's master weights: float32)")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="rounds left out (both bucket sets touched)")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--cpu", action="store_true", help="gloo with host buffers, even when CUDA is available")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup must be at least 1")
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
