"""Weight-sync bandwidth: the bucketed sync of async_rl.weight_transfer against one
flat-buffer broadcast of the same bytes, over the same process group.

    python benchmarks/bench_sync.py [--sizes-mb 10 50 200] [--bucket-mb 16] [--receivers 2]
                                  [--reps 15] [--warmup 2] [--dtype float32] [--threads 1]
                                  [--link-mbit 1000]

Rank 0 is this process: a real `WeightSender` (its TCPStore, its background
broadcast thread, its double-buffered bucket sets). The receivers are N spawned
processes, each a real `ParameterReceiver` holding its own copy of the parameters (as
views of its buckets, as in an actor). Backend: gloo on CPU over loopback; NCCL with
device buckets, sent from a side stream, when CUDA is available (one GPU per rank
needed: NCCL refuses two ranks on one device; an actor sharing the learner's GPU
uses CUDA IPC instead, which this script does not time).

--link-mbit R puts rank 0 and each receiver on a node of its own (a network namespace
with its own interface and address, benchmarks/netns_bed.py; needs root) and limits every
node's link to R Mbit/s each way with tc tbf: the link, not the CPU, is then the limit,
and each measurement also gives `over_link_s`, its median over the time the payload
takes on one link (model bytes x 8 / R).

The parameters are a synthetic list shaped like a scaled-down Qwen2 (embedding, then
per layer q/k/v with biases, o, gate/up/down, two RMSNorm weights; final norm; tied
head), sized to about each --sizes-mb.

Modes, measured on the SAME group and the same processes, alternating within each
repetition (the order rotates from one repetition to the next); warm-up rounds (the
first also builds the group) are excluded and medians reported:

  flat      one broadcast of a preallocated flat tensor holding all the bytes (the
            reference: no copies, one collective)
  bucketed  the real path, end to end: `publish()` copies the source tensors into the
            free bucket set while the broadcast thread already sends each bucket as
            soon as it is filled; each receiver's `receive()` takes the buckets
            straight into its parameters (views of its persistent buckets: no copy);
            timed from the publish call until every receiver has returned and the
            broadcaster has counted the sync complete. On gloo the buckets go down a
            pipelined chain (async_rl/weight_transfer/gloo_chain.py; `schedule` in the
            output), which one flat buffer cannot: that, not the bucketing itself,
            is where the bucketed path gains on the reference
  unverified  the same as bucketed without the check of what arrived (rank 0 writes no
            fingerprint, the receivers compute none: weight_transfer/fingerprint.py);
            the comparison's `verify_share` is the check's share of a bucketed sync
  nocopy    the same bucket plan and schedule, from/into preallocated buckets, nothing
            copied: isolates the schedule from publish's copy-in
Each round is timed on rank 0 from just before its first action until every receiver
has reported completion over a pipe (same overhead for every mode). Bandwidth =
model bytes / seconds (payload each receiver gets, not summed over receivers).

Output, one JSON object per line on stdout:
  {"kind": "measurement", ...}  one per (size, bucket_mb, mode): median/min seconds,
                                 GB/s, every repetition; bucketed also carries the
                                 publish (copy-in, overlapping the sends) time, the
                                 broadcast thread's own duration (`wire_s`, from
                                 taking the set up), the receivers' receive() time
                                 and what writing the version's fingerprint took publish
  {"kind": "comparison", ...}   one per (size, bucket_mb): bucketed_over_flat =
                                 bucketed GB/s / flat GB/s (from the medians),
                                 nocopy_over_flat, verify_share (1 - unverified /
                                 bucketed time), and the medians of per-repetition
                                 paired ratios
  {"kind": "summary", ...}      last line: device ("cpu": gloo; "cuda": NCCL, a path
                                 written but not yet run anywhere), backend, bucketed_over_flat (the
                                 smallest over the comparisons) and meets_0_8
A sanity check (checksums of the received parameters against the source, then zeroed)
follows the first bucketed round; a mismatch aborts the benchmark. What it measured is
in docs/scale.md (Benchmarks).
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

from async_rl.weight_transfer.gloo_chain import chained, receive_chain, send_chain  # noqa: E402
from async_rl.weight_transfer.groups import broadcast
from async_rl.weight_transfer.receiver import ParameterReceiver
from async_rl.weight_transfer.sender import WeightSender  # noqa: E402

MODES = ("flat", "bucketed", "unverified", "nocopy")


def qwen2_like_specs(target_bytes: int, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """A scaled-down Qwen2 parameter list of about `target_bytes` (Qwen2-0.5B ratios:
    intermediate ~5.4 x hidden, 2 KV heads of 64, embedding ~1/4 of the parameters)."""
    item = torch.empty((), dtype=dtype).element_size()
    n = target_bytes // item
    hidden = 256 if n < 6e6 else 512 if n < 25e6 else 768 if n < 80e6 else 1024
    inter = int(round(hidden * 5.43 / 64)) * 64
    kv = 128
    per_layer = (hidden * hidden + hidden) + 2 * (kv * hidden + kv) + hidden * hidden + 3 * hidden * inter + 2 * hidden
    vocab = max(1024, int(round(0.25 * n / hidden / 64)) * 64)
    layers = max(1, int(round((n - vocab * hidden - hidden) / per_layer)))
    specs = [("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "self_attn.q_proj.weight", (hidden, hidden), dtype),
                  (p + "self_attn.q_proj.bias", (hidden,), dtype),
                  (p + "self_attn.k_proj.weight", (kv, hidden), dtype), (p + "self_attn.k_proj.bias", (kv,), dtype),
                  (p + "self_attn.v_proj.weight", (kv, hidden), dtype), (p + "self_attn.v_proj.bias", (kv,), dtype),
                  (p + "self_attn.o_proj.weight", (hidden, hidden), dtype),
                  (p + "mlp.gate_proj.weight", (inter, hidden), dtype),
                  (p + "mlp.up_proj.weight", (inter, hidden), dtype),
                  (p + "mlp.down_proj.weight", (hidden, inter), dtype),
                  (p + "input_layernorm.weight", (hidden,), dtype),
                  (p + "post_attention_layernorm.weight", (hidden,), dtype)]
    specs.append(("model.norm.weight", (hidden,), dtype))
    return specs


def down_a_chain(backend: str, buckets: int, world: int) -> bool:
    """Whether the real path sends these buckets down the gloo chain (the same rule as
    the broadcaster's and receivers' ends)."""
    return backend == "gloo" and chained(buckets, world)


def numel_of(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checksum(tensors) -> float:
    return float(sum(t.double().sum().item() for t in tensors))


# -- receiver processes ---------------------------------------------------------------
def worker(conn, rank: int, threads: int, device_name: str, namespace: str | None = None) -> None:
    if namespace is not None:  # --link-mbit: this receiver is a node of the bed
        import netns_bed

        netns_bed.enter(namespace)
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    receiver = flat = buckets = None
    try:
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "stop":  # skip the teardown of gloo's threads, which can abort at exit
                conn.close()
                os._exit(0)
            if op == "setup":
                _, specs, bucket_mb, backend, timeout_s = msg
                params = [(n, torch.zeros(shape, dtype=dt, device=device)) for n, shape, dt in specs]
                receiver = ParameterReceiver(params, bucket_mb=bucket_mb, backend=backend, timeout_s=timeout_s)
                flat = torch.empty(sum(numel_of(s) for _, s, _ in specs), dtype=specs[0][2], device=device)
                buckets = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in receiver.plan]
                conn.send(("ok",))
                continue
            started = time.perf_counter()
            if op in ("bucketed", "unverified"):
                _, epoch, world, host, port, version = msg
                receiver.verify = op == "bucketed"
                receiver.receive(epoch=epoch, rank=rank, world_size=world, store_host=host, store_port=port,
                                 version=version)
            elif op == "flat":  # the receiver's own group (formed by the first bucketed round)
                broadcast(receiver.group, flat)
            elif op == "nocopy":  # the same schedule as receive(), into buckets of its own
                _, world = msg
                if down_a_chain(receiver.transport, len(buckets), world):
                    receive_chain(receiver.group, buckets, rank=rank, world=world, timeout_s=receiver.timeout_s)
                else:
                    for b in buckets:
                        broadcast(receiver.group, b)
            elif op == "checksum":  # then zeroed, so that the next check sees only what the next round wrote
                conn.send(("checksum", checksum(receiver.params.values())))
                for t in receiver.params.values():
                    t.zero_()
                continue
            sync(device)
            conn.send(("done", time.perf_counter() - started))
    except EOFError:
        return


# -- rank 0 ---------------------------------------------------------------------------
class Bench:
    def __init__(self, receivers: int, threads: int, device: torch.device, backend: str, timeout_s: float,
                 host: str = "127.0.0.1", namespaces: list[str] | None = None, link_mbit: float | None = None):
        self.device, self.backend, self.timeout_s = device, backend, timeout_s
        self.host, self.link_mbit = host, link_mbit
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        ndev = torch.cuda.device_count() if device.type == "cuda" else 0
        for rank in range(1, receivers + 1):
            parent, child = ctx.Pipe()
            dev = f"cuda:{rank % ndev}" if ndev else "cpu"
            namespace = namespaces[rank - 1] if namespaces else None
            p = ctx.Process(target=worker, args=(child, rank, threads, dev, namespace), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def tell(self, msg) -> None:
        for c in self.conns:
            c.send(msg)

    def collect(self) -> list:
        out = []
        for c in self.conns:
            if not c.poll(self.timeout_s):
                raise TimeoutError("a receiver did not answer")
            reply = c.recv()
            out.append(reply[1] if len(reply) > 1 else None)
        return out

    def run_size(self, specs, bucket_mb: float, reps: int, warmup: int) -> list[dict]:
        dev = self.device
        g = torch.Generator().manual_seed(0)
        source = [(n, torch.randn(shape, generator=g).to(dt).to(dev)) for n, shape, dt in specs]
        total_numel = sum(numel_of(s) for _, s, _ in specs)
        dtype = specs[0][2]
        nbytes = total_numel * torch.empty((), dtype=dtype).element_size()
        flat = torch.randn(total_numel, generator=g).to(dtype).to(dev)
        bc = WeightSender(specs, bucket_mb=bucket_mb, host=self.host, backend=self.backend, device=dev,
                               timeout_s=self.timeout_s)
        nocopy = [torch.randn(b.numel, generator=g).to(b.dtype).to(dev) for b in bc.plan]
        self.tell(("setup", specs, bucket_mb, self.backend, self.timeout_s))
        self.collect()
        world = len(self.conns) + 1
        bc.set_members(range(1, world))
        epoch = 1  # the first membership is the broadcaster's epoch 1
        version = 0
        modes = MODES
        want = checksum(t for _, t in source)
        times = {m: [] for m in modes}
        extra = {"publish_s": [], "wire_s": [], "receive_s": [], "fingerprint_s": []}
        try:
            for rep in range(warmup + reps):
                order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                if rep == 0:
                    order = ("bucketed",) + tuple(m for m in modes if m != "bucketed")  # builds the group
                for mode in order:
                    if mode in ("bucketed", "unverified"):
                        version += 1
                        bc.verify = mode == "bucketed"
                        self.tell((mode, epoch, world, bc.host, bc.port, version))
                        t0 = time.perf_counter()
                        bc.publish(version, iter(source))
                        t_pub = time.perf_counter() - t0
                        recv_s = self.collect()
                        while bc.completed < version:
                            if time.perf_counter() - t0 > self.timeout_s:
                                raise TimeoutError("the broadcaster never completed")
                            time.sleep(0.0002)
                        dt = time.perf_counter() - t0
                        if rep >= warmup and mode == "bucketed":
                            extra["publish_s"].append(t_pub)
                            extra["wire_s"].append(bc.last_broadcast_s)
                            extra["receive_s"].append(max(recv_s))
                            extra["fingerprint_s"].append(bc.last_fingerprint_s)
                    else:
                        self.tell((mode, world))
                        t0 = time.perf_counter()
                        if mode == "flat":
                            broadcast(bc.group, flat)
                        elif down_a_chain(self.backend, len(nocopy), world):  # the broadcaster's own schedule
                            send_chain(bc.group, nocopy, world=world, wait_ready=lambda i: None,
                                       timeout_s=self.timeout_s)
                        else:
                            for b in nocopy:
                                broadcast(bc.group, b)
                        sync(dev)
                        self.collect()
                        dt = time.perf_counter() - t0
                    if rep >= warmup:
                        times[mode].append(dt)
                    elif rep == 0 and mode == "bucketed":
                        self.tell(("checksum",))
                        got = self.collect()
                        if any(abs(x - want) > 1e-6 * max(1.0, abs(want)) for x in got):
                            raise RuntimeError(f"{mode}: received parameters differ from the source: {got} vs {want}")
        finally:
            bc.close(wait_s=5)
        common = {"device": dev.type, "backend": self.backend, "receivers": len(self.conns),
                  "model_mb": round(nbytes / 2**20, 2), "tensors": len(specs),
                  "dtype": str(dtype).replace("torch.", ""),
                  "bucket_mb": bucket_mb, "buckets": len(bc.plan),
                  "schedule": "chain" if down_a_chain(self.backend, len(bc.plan), world) else "broadcast per bucket",
                  "link_mbit": self.link_mbit}
        lines = []
        med = {}
        for mode in modes:
            ts = times[mode]
            med[mode] = statistics.median(ts)
            line = {"kind": "measurement", **common, "mode": mode, "reps": len(ts),
                    "median_s": round(med[mode], 6), "min_s": round(min(ts), 6),
                    "gbps": round(nbytes / med[mode] / 1e9, 4), "times_s": [round(t, 6) for t in ts]}
            if self.link_mbit:  # the time the payload takes on one link at its rate
                line["over_link_s"] = round(med[mode] / (nbytes * 8 / (self.link_mbit * 1e6)), 4)
            if mode == "bucketed":
                line.update({k: round(statistics.median(v), 6) for k, v in
                             (("publish_median_s", extra["publish_s"]), ("wire_median_s", extra["wire_s"]),
                              ("receive_median_s", extra["receive_s"]),
                              ("fingerprint_median_s", extra["fingerprint_s"]))})
            lines.append(line)
        flat_gbps = nbytes / med["flat"] / 1e9
        bucketed_gbps = nbytes / med["bucketed"] / 1e9
        nocopy_gbps = nbytes / med["nocopy"] / 1e9
        lines.append({"kind": "comparison", **common, "flat_gbps": round(flat_gbps, 4),
                      "bucketed_gbps": round(bucketed_gbps, 4), "nocopy_gbps": round(nocopy_gbps, 4),
                      "bucketed_over_flat": round(bucketed_gbps / flat_gbps, 4),
                      "nocopy_over_flat": round(nocopy_gbps / flat_gbps, 4),
                      "paired_bucketed_over_flat": round(statistics.median(
                          f / b for f, b in zip(times["flat"], times["bucketed"])), 4),
                      # The check's share of a sync: what a verified round takes beyond an unverified one.
                      "verify_share": round(1 - med["unverified"] / med["bucketed"], 4),
                      "paired_verify_share": round(statistics.median(
                          1 - u / b for u, b in zip(times["unverified"], times["bucketed"])), 4)})
        return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 50, 200])
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[16.0],
                    help="one or more bucket sizes (a sweep); default the config default, 16")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15,
                    help="timed rounds per mode; 15 keeps the medians steady on a loaded 2-core machine")
    ap.add_argument("--warmup", type=int, default=2,
                    help="rounds of every mode left out; 2 so that both of publish's double buffers are touched")
    ap.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU even when CUDA is available")
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="rank 0 and each receiver on a node of their own (network namespaces, netns_bed.py; "
                         "root), every node's link limited to this rate each way")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.reps < 1:
        ap.error("--warmup and --reps must be at least 1")

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
        if torch.cuda.device_count() < args.receivers + 1:
            ap.error(f"NCCL needs one GPU per rank: {args.receivers + 1} ranks, "
                     f"{torch.cuda.device_count()} GPU(s) (use fewer --receivers or --cpu)")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    torch.set_num_threads(args.threads)

    bed = None
    place: dict = {}
    if args.link_mbit:
        if cuda:
            ap.error("--link-mbit: the namespace bed is for the CPU path (gloo)")
        import netns_bed

        reason = netns_bed.Bed.unavailable()
        if reason:
            ap.error(f"--link-mbit: {reason}")
        bed = netns_bed.Bed(["learner"] + [f"receiver{k}" for k in range(1, args.receivers + 1)])
        for node in bed.nodes:
            bed.set_rate(node, args.link_mbit)
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the nodes' own interface, in every process
        netns_bed.enter(bed.namespace("learner"))
        place = {"host": bed.address("learner"), "namespaces": [bed.namespace(n) for n in bed.nodes[1:]],
                 "link_mbit": args.link_mbit}
    bench = Bench(args.receivers, args.threads, device, backend, args.timeout_s, **place)
    comparisons = []
    try:
        for size in args.sizes_mb:
            specs = qwen2_like_specs(int(size * 2**20), dtype)
            for bucket_mb in args.bucket_mb:
                for line in bench.run_size(specs, bucket_mb, args.reps, args.warmup):
                    print(json.dumps(line), flush=True)
                    if line["kind"] == "comparison":
                        comparisons.append(line)
    finally:
        bench.close()
        if bed is not None:
            bed.close()
    worst = min(comparisons, key=lambda c: c["bucketed_over_flat"])
    print(json.dumps({"kind": "summary", "device": device.type, "backend": backend,
                      "cuda_available": torch.cuda.is_available(), "receivers": args.receivers,
                      "threads": args.threads, "reps": args.reps, "warmup": args.warmup,
                      "link_mbit": args.link_mbit,
                      "cpu_count": os.cpu_count(),
                      "bucketed_over_flat": worst["bucketed_over_flat"],
                      "verify_share_max": max(c["verify_share"] for c in comparisons),
                      "worst_case": {"model_mb": worst["model_mb"], "bucket_mb": worst["bucket_mb"]},
                      "by_size": [{k: c[k] for k in ("model_mb", "bucket_mb", "buckets", "flat_gbps", "bucketed_gbps",
                                                      "nocopy_gbps", "bucketed_over_flat")} for c in comparisons],
                      "meets_0_8": worst["bucketed_over_flat"] >= 0.8}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
