"""The GPU check: one command that, on a machine with one CUDA GPU, runs the project's CUDA
tests and measures what only a GPU can show; it writes gpu_check.json, gpu_check.md (one
table) and gpu_check.log (every section's output) into --out.

    python benchmarks/gpu_check.py --out DIR [--dry-run] [--sections ceilings,tests,...]

Sections, each in its own subprocess under its own time limit, so one that fails or
hangs costs only itself (the limits add up to 6 minutes):
  ceilings   GPU, memory, torch and CUDA versions; the bf16 rate of an 8192^3 matmul on
             random data and a device-to-device copy's bandwidth (bytes read + written):
             the ceilings the other figures are held against
  tests      `pytest -m cuda tests/unit`: every test that needs CUDA (they skip elsewhere)
  ipc_sync   benchmarks/bench_ipc.py: the weight sync to an actor on the learner's own GPU
             (CUDA IPC) of the Qwen2.5-0.5B shapes in float32, against one
             device-to-device copy of the same bytes
  learner    benchmarks/bench_learner.py: a bf16 FSDP2 train step on a random-weight
             Qwen2.5-0.5B (packed, and shared prompts), its model FLOP/s and MFU against
             the datasheet peak and against the measured matmul rate; then torch-engine
             generation tokens/s of the same model in bf16
  async_run  `async-rl train configs/demo.yaml model.device=cuda`: a short asynchronous
             run with the learner and its actor on the same GPU (weights over CUDA IPC)
--dry-run runs the same sections on the CPU at toy sizes: it checks the plumbing (what
CI runs), and its figures mean nothing. docs/scale.md says how to run it on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTIONS = ("ceilings", "tests", "ipc_sync", "learner", "async_run")
LIMIT_S = {"ceilings": 15, "tests": 50, "ipc_sync": 35, "learner": 150, "async_run": 110}
DATASHEET_BF16_TFLOPS = 989.0  # NVIDIA H100/H200 SXM dense bf16 tensor-core peak


def measure_ceilings(dry: bool) -> dict:
    """This machine's own rates, as the other sections see them (same torch, same device)."""
    import torch

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    n = 8192 if cuda else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul_s = timed(lambda: a @ b, 10)
    numel = (2**30 if cuda else 2**24) // 4
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    copy_s = timed(lambda: dst.copy_(src), 10)
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
           "cuda": torch.version.cuda, "matmul_n": n, "bf16_matmul_tflops": 2 * n**3 / matmul_s / 1e12,
           "copy_gbps_read_plus_written": 2 * numel * 4 / copy_s / 1e9}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        out.update(memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count)
    return out


# -- sections: each returns (command, parser of its stdout into a result dict) -----------------

def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def section_ceilings(dry: bool, work: Path):
    cmd = [sys.executable, __file__, "--ceilings"] + (["--dry-run"] if dry else [])
    return [cmd], lambda out: json_lines(out)[-1]


def section_tests(dry: bool, work: Path):
    xml = work / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "tests/unit", "-q", "-p", "no:cacheprovider",
           "--timeout", "60", f"--junitxml={xml}"]

    def parse(out: str) -> dict:
        import xml.etree.ElementTree as ET

        cases = ET.parse(xml).getroot().iter("testcase")
        result = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
        for case in cases:
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("skipped") is not None:
                result["skipped"] += 1
            elif case.find("failure") is not None or case.find("error") is not None:
                result["failed"] += 1
                result["failures"].append(name)
            else:
                result["passed"] += 1
        return result
    return [cmd], parse


def section_ipc_sync(dry: bool, work: Path):
    cmd = [sys.executable, "benchmarks/bench_ipc.py", "--reps", "10", "--warmup", "2"]
    cmd += ["--model", "tiny", "--cpu", "--reps", "3"] if dry else []
    return [cmd], lambda out: json_lines(out)[-1]


def section_learner(dry: bool, work: Path):
    cmd = [sys.executable, "benchmarks/bench_learner.py", "--ranks", "1", "--variants", "packed,shared",
           "--steps", "3", "--warmup", "1", "--peak-tflops", str(DATASHEET_BF16_TFLOPS)]
    cmd += ["--tiny", "--cpu", "--precision", "bf16", "--steps", "1"] if dry else ["--precision", "bf16"]

    def parse(out: str) -> dict:
        lines = json_lines(out)
        return {"learner": [line for line in lines if line["kind"] == "learner"],
                "generate": next(line for line in lines if line["kind"] == "generate")}
    return [cmd], parse


def section_async_run(dry: bool, work: Path):
    run_dir, model = work / "async-run", work / "demo-model"
    steps, every = (6, 3) if dry else (200, 100)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "configs/demo.yaml", f"run_dir={run_dir}",
           f"train.max_steps={steps}", f"eval.every={every}", "checkpoint.every=0", "learner.timeout_s=30",
           "model.device=" + ("cpu" if dry else "cuda")]
    # The dry run skips the demo's warm start (seconds of CPU that check nothing).
    cmds = [[sys.executable, __file__, "--untrained-demo", str(model)], cmd + [f"model.path={model}"]] if dry \
        else [cmd]

    def parse(out: str) -> dict:
        from async_rl.run.directory import RunDir

        run = RunDir(run_dir)
        steps_, evals = run.steps_and_evals()
        logs = "".join(p.read_text() for p in run.logs_dir.glob("actor-*.log"))
        transports = sorted(set(re.findall(r"synced to version \d+ \(epoch \d+, (\w+)\)", logs)))
        last = steps_[len(steps_) // 2:]
        median = lambda key: sorted(s[key] for s in last)[len(last) // 2]  # noqa: E731
        return {"steps": len(steps_), "transports": transports,
                "eval_accuracy_first": evals[0]["eval/accuracy"], "eval_accuracy_last": evals[-1]["eval/accuracy"],
                "samples_per_s": median("throughput/samples_per_s"), "sync_s": median("sync/seconds"),
                "staleness_max": max(s["staleness/max"] for s in steps_),
                "train_seconds": steps_[-1]["time"]}
    return cmds, parse


def run_section(name: str, dry: bool, work: Path) -> dict:
    """Run one section's command under its limit (the whole process group is killed
    past it); its stdout goes to a file the section's parser reads, everything it
    printed (and an async run's own logs) to the section's log, work/<name>.log."""
    with open(work / f"{name}.log", "w") as log:
        return _run_section(name, dry, work, log)


def _run_section(name: str, dry: bool, work: Path, log) -> dict:
    cmds, parse = globals()[f"section_{name}"](dry, work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
    if name == "learner":  # fewer stranded blocks between the step's differently sized [tokens, V] tensors
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    started = time.monotonic()
    stdout = work / f"{name}.out"
    code: int | None = 0
    with open(stdout, "w") as out_file:
        for cmd in cmds:
            log.write(f"\n===== {name}: {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out_file, stderr=log, start_new_session=True)
            try:
                code = proc.wait(timeout=max(1.0, LIMIT_S[name] - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the section and everything it started
                proc.wait()
                code = None
            if code != 0:
                break
    out = stdout.read_text()
    log.write(out)
    for extra in sorted((work / "async-run" / "logs").glob("*.log")) if name == "async_run" else ():
        log.write(f"----- {extra.name}\n{extra.read_text()}")
    log.flush()
    status = "timeout" if code is None else "ok" if code == 0 else f"exit {code}"
    result: dict = {"status": status, "seconds": round(time.monotonic() - started, 1)}
    try:
        result.update(parse(out))
    except Exception as err:  # a section that ran but left no figures
        result["status"] = "no result" if status == "ok" else status
        result["error"] = f"{type(err).__name__}: {err}"
    if code != 0:  # what the command said last, not what the parser made of its output
        result["error"] = last_error(Path(log.name).read_text()) or result.get("error", status)
    if name == "tests" and result["status"] == "ok" and result.get("failed"):
        result["status"] = "failed"
    return result


def last_error(text: str) -> str:
    """The line naming the failure in a section's log: its last exception line, else its
    last line, cut to 200 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b", line)]
    line = (errors or lines or [""])[-1]
    return re.sub(r"^\[rank\d+\]:\s*", "", line)[:200]


def markdown(report: dict) -> str:
    s = report["sections"]
    c = s.get("ceilings", {})
    rows = [("section", "status", "figures")]

    def fig(d: dict, key: str, fmt: str) -> str:
        return format(d[key], fmt) if isinstance(d.get(key), (int, float)) else "n/a"

    rows.append(("ceilings", c.get("status", "-"),
                 f"{c.get('device', '?')}, torch {c.get('torch', '?')}, CUDA {c.get('cuda')}; bf16 matmul "
                 f"{fig(c, 'bf16_matmul_tflops', '.3g')} TFLOP/s; copy {fig(c, 'copy_gbps_read_plus_written', '.0f')} "
                 "GB/s (read + written)"))
    t = s.get("tests", {})
    rows.append(("tests (-m cuda)", t.get("status", "-"),
                 f"{t.get('passed', '?')} passed, {t.get('failed', '?')} failed, {t.get('skipped', '?')} skipped"
                 + (f": {', '.join(t['failures'])}" if t.get("failures") else "")))
    i = s.get("ipc_sync", {})
    rows.append(("ipc_sync", i.get("status", "-"),
                 f"{i.get('transport', '?')}, {fig(i, 'bytes', ',')} B: sync {fig(i, 'sync_s', '.4f')} s, one copy "
                 f"{fig(i, 'copy_s', '.4f')} s, copy/sync {fig(i, 'copy_over_sync', '.2f')}"))
    lr = s.get("learner", {})
    peak = c.get("bf16_matmul_tflops")
    for line in lr.get("learner", []):
        vs_measured = f", {line['tflops'] / peak:.0%} of the measured matmul" if peak else ""
        rows.append((f"learner {line['variant']}", lr["status"],
                     f"{line['precision']} step {line['step_s']:.3f} s, {line['tokens']} tokens, "
                     f"{line['tflops']:.1f} TFLOP/s, MFU {line['mfu'] or 0:.1%} of {DATASHEET_BF16_TFLOPS:.0f}"
                     f"{vs_measured}, peak RSS {line['peak_rss_gb']:.1f} GiB"
                     + (f", peak GPU {line['peak_gpu_gb']:.1f} GiB" if line.get("peak_gpu_gb") else "")))
    if lr.get("generate"):
        g = lr["generate"]
        rows.append(("generate (torch engine)", lr["status"],
                     f"{g['precision']}, {g['prompts']} prompts x {g['new_tokens']} tokens: "
                     f"{g['tokens_per_s']:,.0f} tokens/s"))
    elif lr:
        rows.append(("learner", lr.get("status", "-"), lr.get("error", "")))
    a = s.get("async_run", {})
    rows.append(("async_run", a.get("status", "-"),
                 f"{a.get('steps', '?')} steps in {fig(a, 'train_seconds', '.0f')} s, transport {a.get('transports')}, "
                 f"accuracy {fig(a, 'eval_accuracy_first', '.3f')} -> {fig(a, 'eval_accuracy_last', '.3f')}, "
                 f"{fig(a, 'samples_per_s', '.0f')} samples/s, sync {fig(a, 'sync_s', '.4f')} s, "
                 f"staleness max {a.get('staleness_max', '?')}" + (f"; {a['error']}" if a.get("error") else "")))
    where = "dry run, CPU" if report["dry_run"] else "GPU"
    head = f"GPU check ({where}), {report['date']}, {report['seconds']:.0f} s\n\n"
    rows = rows[:1] + [r for r in rows[1:] if r[1] != "-"]  # sections that ran
    return head + "\n".join("| " + " | ".join(r) + " |" + ("\n|---|---|---|" if k == 0 else "")
                            for k, r in enumerate(rows)) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu-check", help="where gpu_check.json/.md/.log go")
    ap.add_argument("--dry-run", action="store_true", help="the same sections on the CPU, at toy sizes")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--jobs", type=int, default=1, help="sections at a time (more only for --dry-run: timings "
                                                         "taken side by side mean nothing)")
    ap.add_argument("--ceilings", action="store_true", help=argparse.SUPPRESS)  # the ceilings section's process
    ap.add_argument("--untrained-demo", help=argparse.SUPPRESS)  # the dry async run's model
    args = ap.parse_args(argv)
    if args.ceilings:
        print(json.dumps(measure_ceilings(args.dry_run)))
        return 0
    if args.untrained_demo:
        from async_rl.models.demo import build_demo_model

        build_demo_model(args.untrained_demo, seed=0, target_accuracy=0.0, min_mixed_fraction=0.0)
        return 0
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (use --dry-run to check the plumbing on a CPU)", file=sys.stderr)
        return 2
    if args.jobs > 1 and not args.dry_run:
        ap.error("--jobs > 1 only with --dry-run")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = {"dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d"), "sections": {}}
    with tempfile.TemporaryDirectory() as work:
        # On a GPU one section at a time: their timings must not share the machine.
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {name: pool.submit(run_section, name, args.dry_run, Path(work)) for name in sections}
            for name, future in futures.items():
                report["sections"][name] = result = future.result()
                print(f"gpu_check: {name}: {result['status']} ({result['seconds']} s)", flush=True)
        (out / "gpu_check.log").write_text("".join((Path(work) / f"{name}.log").read_text() for name in sections))
    report["seconds"] = time.monotonic() - started
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (out / "gpu_check.md").write_text(table)
    print(table)
    return 0 if all(r["status"] == "ok" for r in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
