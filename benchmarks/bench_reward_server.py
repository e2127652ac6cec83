"""The reward server measured: its scores/s by batch size, whether a batch scores as one
row at a time does, and how long actors wait for it in real runs.

    python benchmarks/bench_reward_server.py RM_DIR PAIRS.jsonl [--rows 256] [--batches 1,8,32] [--reps 3]
        [--clients 4] [--runs 0 --config configs/smollm2.yaml --steps 12] [--out DIR]

- scores_per_s: a server process (`python -m async_rl.reward_server`, one torch thread,
  max_wait_ms 5) per --batches value as reward_server.max_batch; --clients threads send
  the --rows pairs' sides (prompt + chosen, prompt + rejected, from PAIRS) in requests of
  8 rows, as the actors' reward workers do, all at once; rows/s from the first request
  to the last answer. --reps repetitions, the batch sizes in alternating order; median
  (min-max).
- batched_vs_alone: the largest |difference| between the server's scores (the largest
  batch) and RewardModel's, one row at a time in this process.
- --runs N: N runs each of `async-rl train --config` with RM_DIR as the only trained
  reward (placement: server) and the task's watched at weight 0, with 1 and with 2
  actors, --steps steps, no evaluation: per step, the seconds the actors' grants spend
  being scored by the server and the actors spend blocked on it, generating, and the
  learner waiting for data (trace.json); samples/s from the end of step 1; the server's
  mean batch (its status file).
Prints one JSON line per measurement; nothing is written unless --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_rewards import report, spread  # noqa: E402 - the analysis folder is the script's own

REQUEST_ROWS = 8  # what a reward worker sends at once (rewards/worker.py BATCH)


def read_rows(pairs: Path, n: int) -> list[tuple[str, str]]:
    rows = []
    for line in pairs.read_text().splitlines():
        pair = json.loads(line)
        rows += [(pair["prompt"], pair["chosen"]), (pair["prompt"], pair["rejected"])]
        if len(rows) >= n:
            break
    return rows[:n]


def component(rm: Path) -> str:
    return f"reward.components=[{{name: rm, reward: reward_model, model: {rm}, placement: server}}]"


class Server:
    def __init__(self, rm: Path, max_batch: int) -> None:
        from async_rl.reward_server.client import wait_until_serving
        from async_rl.reward_server.process import free_port

        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "async_rl.reward_server", str(ROOT / "configs/demo.yaml"), component(rm),
             f"reward_server.max_batch={max_batch}", "reward_server.max_wait_ms=5", "reward_server.threads=1",
             "--bind", self.endpoint], env=dict(os.environ, OMP_NUM_THREADS="1"), stderr=subprocess.DEVNULL)
        wait_until_serving(self.endpoint, 300)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def score_all(endpoint: str, rows: list[tuple[str, str]], clients: int) -> tuple[list, float]:
    """(scores in row order, seconds) with `clients` threads sending REQUEST_ROWS rows at a time."""
    from async_rl.reward_server.client import ServerScorer

    chunks = [list(range(k, min(k + REQUEST_ROWS, len(rows)))) for k in range(0, len(rows), REQUEST_ROWS)]
    scores: list = [None] * len(rows)
    lock = threading.Lock()

    def client() -> None:
        scorer = ServerScorer(endpoint, "rm", timeout_s=600)
        while True:
            with lock:
                if not chunks:
                    return
                chunk = chunks.pop(0)
            for i, value in zip(chunk, scorer.score_batch([rows[i][0] for i in chunk], [rows[i][1] for i in chunk])):
                scores[i] = value

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return scores, time.perf_counter() - started


def throughput(rm: Path, rows: list, batches: list[int], reps: int, clients: int) -> tuple[dict, list]:
    rates: dict[int, list[float]] = {b: [] for b in batches}
    largest = []
    for rep in range(reps):
        for b in (batches if rep % 2 == 0 else batches[::-1]):
            server = Server(rm, b)
            try:
                score_all(server.endpoint, rows[:2 * REQUEST_ROWS * clients], clients)  # warm-up
                scores, seconds = score_all(server.endpoint, rows, clients)
            finally:
                server.close()
            rates[b].append(len(rows) / seconds)
            if b == max(batches):
                largest = scores
    return {"what": "scores_per_s", "rows": len(rows), "clients": clients,
            **{f"batch_{b}": spread(r) for b, r in rates.items()}}, largest


def batched_vs_alone(rm: Path, rows: list, batched: list[float]) -> dict:
    import torch

    from async_rl.rewards.reward_model import RewardModel

    torch.set_num_threads(1)
    model = RewardModel(rm, batch_size=1)
    alone = model.score_batch([p for p, _ in rows], [r for _, r in rows])
    return {"what": "batched_vs_alone", "rows": len(rows),
            "max_abs_diff": max(abs(a - b) for a, b in zip(alone, batched))}


def run_figures(run_dir: Path) -> dict[str, float]:
    """A finished run's seconds per step: its actors' grants being scored by the server
    (`score` spans, off the generation path), its actors blocked waiting for those scores
    (`wait-for-rewards`), generating, and the learner waiting for data; samples/s from the
    end of step 1; the server's mean batch (its status file)."""
    from async_rl.run.directory import read_trace

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stepped = [s for s in lines if "train/samples" in s]
    first, last = stepped[0], stepped[-1]
    spans = read_trace(run_dir / "trace.json") or []
    status = json.loads((run_dir / "reward_server.json").read_text())

    def per_step(name: str, actors: bool = True) -> float:
        return sum(s.dur_s for s in spans if s.name == name and s.track.startswith("actor") == actors) / len(stepped)

    return {"scoring_s_per_step": per_step("score"), "wait_for_rewards_s_per_step": per_step("wait-for-rewards"),
            "generate_s_per_step": per_step("generate"), "learner_wait_s_per_step": per_step("wait-for-data", False),
            "samples_per_s": (last["train/samples"] - first["train/samples"]) / (last["time"] - first["time"]),
            "mean_batch": status["rows"] / max(status["batches"], 1)}


def actor_wait(rm: Path, config: str, runs: int, steps: int, out: Path) -> dict:
    figures: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    for rep in range(runs):
        for count in ((1, 2) if rep % 2 == 0 else (2, 1)):
            run_dir = out / f"actors-{count}-{rep}"
            done = subprocess.run(
                [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / config), f"run_dir={run_dir}",
                 f"actors.count={count}", f"train.max_steps={steps}", "eval.every=0", "checkpoint.every=0",
                 component(rm).replace("placement: server}", "placement: server}, {name: exact, reward: task, "
                                                             "weight: 0}")],
                capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise SystemExit(f"run {run_dir} failed: {done.stderr[-2000:]}")
            for key, value in run_figures(run_dir).items():
                figures[count].setdefault(key, []).append(value)
    return {"what": "actor_wait", "config": config, "steps": steps,
            **{f"actors_{n}": {k: spread(v) for k, v in f.items()} for n, f in figures.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rm", type=Path)
    parser.add_argument("pairs", type=Path)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--runs", type=int, default=0)
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = read_rows(args.pairs, args.rows)
    batches = [int(b) for b in args.batches.split(",")]
    speed, batched = throughput(args.rm.resolve(), rows, batches, args.reps, args.clients)
    results = [speed, batched_vs_alone(args.rm, rows, batched)]
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-reward-server-"))
    if args.runs:
        results.append(actor_wait(args.rm.resolve(), args.config, args.runs, args.steps, out))
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
