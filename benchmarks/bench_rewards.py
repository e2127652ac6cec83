"""What running rewards out of the actor's thread costs, measured in one run.

    python benchmarks/bench_rewards.py [--calls 4096] [--reps 5] [--workers 2] [--sandbox-runs 10]
                                     [--code-calls 64] [--demo-runs 0] [--slow-runs 0] [--skip-micro]
                                     [--out runs/bench-rewards]

- start: a RewardPool of --workers processes from nothing until every worker has
  built the task's reward (the demo's exact_match); their resident memory.
- per call: --calls calls of exact_match (the demo's reward, microseconds of work), as
  an actor makes them: one batch through the process pool, and one batch through the
  thread guard (actor/guard.py), repetitions alternated; medians (min-max) per call.
- past the deadline: a reward that spins; the seconds from its deadline until its
  worker's process is gone (the core is free), and until the pool answers.
- the sandbox: --sandbox-runs runs of a trivial program in LocalSandbox (isolated where
  this machine allows), and of `python -I -c pass` as the floor.
- code_tests: --code-calls calls of the coding task's reward (reference solutions
  against their tests, one sandboxed run each) through --workers workers: calls/s.
- --demo-runs N: N runs of `async-rl train configs/demo.yaml` each with
  reward.executor=thread and =process, alternated; samples/s of each (the summary line).
- --slow-runs N: N runs each of --slow-config (the demo; --slow-steps steps, batches of
  --slow-groups groups, 8 evaluation prompts) with a reward that sleeps --slow-ms per
  sample in --slow-workers workers, scored on the generation path (reward.in_flight=0)
  and off it (=2), alternated: samples/s from the end of step 1, and the actor's
  seconds per step generating, waiting for rewards (its `score` spans on the path, its
  `wait-for-rewards` spans off it) and waiting for admission (trace.json).
Prints one JSON line per measurement and a table; nothing is written unless --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from async_rl.actor.guard import Call as GuardedCall
from async_rl.actor.guard import Calls, Guard
from async_rl.rewards.outcome import as_reward
from async_rl.rewards.pool import Call, RewardPool
from async_rl.run.directory import read_trace
from async_rl.tasks.arithmetic import exact_match

ROOT = Path(__file__).resolve().parents[1]
DEMO_TASK = {"name": "arithmetic"}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def pool_start(workers: int, reps: int) -> dict:
    seconds, rss = [], []
    for _ in range(reps):
        pool = RewardPool(DEMO_TASK, 0, processes=workers, timeout_s=10)
        started = time.perf_counter()
        pool.start()
        seconds.append(time.perf_counter() - started)
        rss.append(statistics.mean(psutil.Process(w.process.pid).memory_info().rss for w in pool.workers) / 2**20)
        pool.close()
    return {"what": "start", "workers": workers, "seconds": spread(seconds), "rss_mb_per_worker": spread(rss)}


def per_call(calls: int, reps: int, workers: int) -> dict:
    batch = [Call("37+45=", str(82 + i % 2), "82") for i in range(calls)]
    guard = Guard("exact_match", timeout_s=10)
    process_us, thread_us = [], []
    with RewardPool(DEMO_TASK, 0, processes=workers, timeout_s=10) as pool:
        pool.score(batch[:64])  # warm
        for rep in range(reps):
            for mode in (("process", "thread") if rep % 2 == 0 else ("thread", "process")):
                started = time.perf_counter()
                if mode == "process":
                    outcomes = pool.score(batch)
                else:
                    guarded = Calls()
                    guarded.submit([GuardedCall(i, guard, exact_match, (c.prompt, c.response, c.answer), as_reward)
                                    for i, c in enumerate(batch)])
                    outcomes = guarded.wait_all()
                elapsed = (time.perf_counter() - started) / calls * 1e6
                (process_us if mode == "process" else thread_us).append(elapsed)
                assert len(outcomes) == calls
    return {"what": "per_call_us", "calls": calls, "process": spread(process_us), "thread": spread(thread_us),
            "ratio_process_over_thread": statistics.median(process_us) / statistics.median(thread_us)}


def past_deadline(reps: int, timeout_s: float = 0.5) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spin.py"
        path.write_text(textwrap.dedent("""
            def spin(prompt, response, answer):
                while True:
                    pass
        """))
        freed, answered = [], []
        with RewardPool({"name": "jsonl", "train_path": "unused", "reward": f"{path}:spin"}, 0, processes=1,
                        timeout_s=timeout_s) as pool:
            for _ in range(reps):
                worker = psutil.Process(pool.workers[0].process.pid)
                started = time.perf_counter()
                [outcome] = pool.score([Call("p", "r", "a")])
                answered.append(time.perf_counter() - started - timeout_s)
                assert outcome.reason == "timeout"
                while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.001)
                freed.append(time.perf_counter() - started - timeout_s)
                pool.wait_ready()  # the replacement, before the next round
    return {"what": "past_deadline_s", "timeout_s": timeout_s, "answered_after_deadline": spread(answered),
            "core_free_after_deadline": spread(freed)}


def sandbox(runs: int) -> dict:
    from async_rl.sandbox import LocalSandbox

    box = LocalSandbox(max_concurrency=1)
    sandboxed, floor = [], []
    for _ in range(runs):
        started = time.perf_counter()
        result = box.run("print(1)")
        sandboxed.append(time.perf_counter() - started)
        assert result.ok and result.stdout.strip() == "1", result
        started = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        floor.append(time.perf_counter() - started)
    return {"what": "sandbox_run_ms", "isolation": box.isolation.label,
            "sandbox": spread([s * 1e3 for s in sandboxed]), "bare_python": spread([s * 1e3 for s in floor])}


def code_calls(calls: int, workers: int) -> dict:
    """`calls` code_tests calls (the coding task's reference solutions against their
    tests, one sandboxed run each) through a pool of `workers`: calls/s."""
    from async_rl.tasks.coding import CodingTask

    task = CodingTask(seed=0, eval_size=1)
    prompts = [task.train_prompt(i) for i in range(calls)]
    batch = [Call(p.text, p.answer, p.answer, p.fields) for p in prompts]
    with RewardPool({"name": "coding"}, 0, processes=workers, timeout_s=30) as pool:
        pool.score(batch[:workers])  # each worker's sandbox built (its trial run) before the clock
        started = time.perf_counter()
        outcomes = pool.score(batch)
        seconds = time.perf_counter() - started
    assert all(o == 1.0 for o in outcomes), outcomes  # the reference solutions pass their own tests
    return {"what": "code_tests_calls_per_s", "calls": calls, "workers": workers, "calls_per_s": calls / seconds}


def demo(runs: int, out: Path) -> dict:
    rates: dict[str, list[float]] = {"thread": [], "process": []}
    for rep in range(runs):
        for executor in (("thread", "process") if rep % 2 == 0 else ("process", "thread")):
            lines = _train(out / f"demo-{executor}-{rep}", f"reward.executor={executor}")
            last = [s for s in lines if "train/samples" in s][-1]  # samples so far, at its time
            rates[executor].append(last["train/samples"] / last["time"])
    return {"what": "demo_samples_per_s", "thread": spread(rates["thread"]), "process": spread(rates["process"]),
            "ratio_process_over_thread": statistics.median(rates["process"]) / statistics.median(rates["thread"])}


def _train(run_dir: Path, *overrides: str, config: str = "configs/demo.yaml") -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "async_rl.cli", "train", str(ROOT / config),
                           f"run_dir={run_dir}", *overrides], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"demo run {run_dir} failed: {done.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def slow_reward(runs: int, out: Path, *, ms: float, workers: int, steps: int, groups: int, config: str) -> dict:
    reward = out / "slow_reward.py"
    out.mkdir(parents=True, exist_ok=True)
    reward.write_text(f"import time\n\n\ndef score(prompt, response, answer):\n    time.sleep({ms / 1e3})\n"
                      "    return float(response.strip() == answer)\n")
    rates: dict[int, list[float]] = {0: [], 2: []}
    actor: dict[int, dict[str, list[float]]] = {k: {"generate": [], "rewards": [], "admission": []} for k in (0, 2)}
    for rep in range(runs):
        for in_flight in ((0, 2) if rep % 2 == 0 else (2, 0)):
            run_dir = out / f"slow-{in_flight}-{rep}"
            lines = _train(run_dir, f"task.reward={reward}:score", f"reward.workers={workers}",
                           f"reward.in_flight={in_flight}", f"train.max_steps={steps}", f"train.batch_groups={groups}",
                           "eval.every=0", "eval.size=8", "eval.batch_size=8", "checkpoint.every=0", config=config)
            steps_done = [s for s in lines if "train/samples" in s]
            first, last = steps_done[0], steps_done[-1]  # from the end of step 1: the pool's start left out
            rates[in_flight].append((last["train/samples"] - first["train/samples"]) / (last["time"] - first["time"]))
            spans = [s for s in read_trace(run_dir / "trace.json") or [] if s.track.startswith("actor")]
            waited = "score" if in_flight == 0 else "wait-for-rewards"  # the actor's thread waiting for rewards
            for key, name in (("generate", "generate"), ("rewards", waited), ("admission", "wait-for-admission")):
                actor[in_flight][key].append(sum(s.dur_s for s in spans if s.name == name) / len(steps_done))
    return {"what": "slow_reward", "config": config, "reward_ms": ms, "workers": workers, "batch_groups": groups,
            "samples_per_s": {"on_path": spread(rates[0]), "off_path": spread(rates[2])},
            "actor_s_per_step": {"on_path": {k: spread(v) for k, v in actor[0].items()},
                                 "off_path": {k: spread(v) for k, v in actor[2].items()}},
            "ratio_off_over_on": statistics.median(rates[2]) / statistics.median(rates[0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sandbox-runs", type=int, default=10)
    parser.add_argument("--demo-runs", type=int, default=0)
    parser.add_argument("--code-calls", type=int, default=64)
    parser.add_argument("--slow-runs", type=int, default=0)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--slow-workers", type=int, default=8)
    parser.add_argument("--slow-steps", type=int, default=12)
    parser.add_argument("--slow-groups", type=int, default=16)
    parser.add_argument("--slow-config", default="configs/demo.yaml")
    parser.add_argument("--skip-micro", action="store_true", help="only the runs (--demo-runs, --slow-runs)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = [] if args.skip_micro else [pool_start(args.workers, args.reps),
                                          per_call(args.calls, args.reps, args.workers),
                                          past_deadline(args.reps), sandbox(args.sandbox_runs),
                                          code_calls(args.code_calls, args.workers)]
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-rewards-"))
    if args.demo_runs:
        results.append(demo(args.demo_runs, out))
    if args.slow_runs:
        results.append(slow_reward(args.slow_runs, out, ms=args.slow_ms, workers=args.slow_workers,
                                   steps=args.slow_steps, groups=args.slow_groups, config=args.slow_config))
    report(results, args.out)
    return 0


def report(results: list[dict], out: Path | None) -> None:
    """One JSON line per measurement, with the machine's load; results.jsonl in `out`."""
    load = os.getloadavg()[0]
    for row in results:
        print(json.dumps({**row, "load_1min": round(load, 2)}), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    sys.exit(main())
