"""Fault drill: the fault-tolerance acceptance checks, run on the real CPU demo.

    python benchmarks/fault_drill.py [--scenarios hostile kill-actor stall-actor kill-job] [--out runs/fault-drill]
                                   [--model PATH] [--target 0.9] [--set key=value ...]

hostile     While the demo trains, thousands of malformed messages (random bytes and
            randomly mutated real messages, from peers the hub never registered) hit
            the hub and experience sockets. Passes if the run ends with status 0 and
            eval accuracy >= target, and wire/rejected counts every message.
kill-actor  actors.count=2; once training runs, one actor is SIGKILLed. Passes if
            the hub drops it at once (its connection closed), the longest pause
            between two learner steps after the kill is <= --max-pause (3 s),
            actors/live drops to 1 while steps go on, a new actor started with only
            `async-rl actor --hub ADDR` joins (actors/live back to 2) and completes a
            weight sync, and the run ends with status 0, accuracy >= target and every
            sample's staleness <= max_staleness.
stall-actor The only actor is stopped (SIGSTOP) until the hub removes it (heartbeat
            timeout 3 s), then continued: it registers again and the run finishes
            with status 0, accuracy >= target and every admitted prompt consumed once.
kill-job    Every process of the run is SIGKILLed at once mid-run (a machine failure),
            then `async-rl train ... --resume RUN` continues. Passes if it resumed from
            its latest complete checkpoint (losing at most checkpoint.every steps), every
            step appears once in metrics.jsonl, no prompt was lost or counted twice, and
            the run ends with status 0 and accuracy >= target.

All runs start from one warm-started demo model (built once in OUT/base_model, as in
staleness_sweep.py). One JSON line per scenario goes to stdout (figures + "passed");
the exit status is 1 if any scenario failed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from staleness_sweep import base_model  # sibling script: the same shared base model

from async_rl.run.directory import RunDir

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"


# -- observing a run from outside, as a user would: through its files (RunDir) ---------
def wait_for(what: str, condition, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll `condition()` until true; seconds waited. Fails if the run exits first."""
    start = time.monotonic()
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited (status {proc.returncode}) while waiting for {what}")
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


def start_run(args, name: str, *overrides: str, resume: bool = False) -> tuple[subprocess.Popen, RunDir]:
    path = (args.out / name).resolve()
    if not resume and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(CONFIG), f"run_dir={path}",
           f"model.path={args.model_path}", *overrides, *args.set, *(["--resume", str(path)] if resume else [])]
    log = open(args.out / f"{name}{'-resume' if resume else ''}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), RunDir(path)


def finish(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its learner and actors
        return proc.wait()


def outcome(run: RunDir, code: int, target: float, max_staleness: int) -> dict:
    steps, evals = run.steps_and_evals()
    accuracy = evals[-1]["eval/accuracy"] if evals else 0.0
    return {"exit_code": code, "steps": len(steps), "eval_accuracy": accuracy,
            "staleness_max": max((s["staleness/max"] for s in steps), default=0),
            "staleness_dropped": steps[-1]["staleness/dropped"] if steps else 0,
            "ok": code == 0 and accuracy >= target and all(s["staleness/max"] <= max_staleness for s in steps)}


def config_value(run: RunDir, dotted: str):
    node = run.config()
    for part in dotted.split("."):
        node = node[part]
    return node


def consumed_once(run: RunDir) -> dict:
    """Whether each learner step appears once in metrics.jsonl, and the prompts consumed
    against steps × train.batch_groups: batches are taken in admission order, so the count
    says every admitted prompt up to it was consumed once (none lost, none twice)."""
    steps = run.steps()
    return {"each_step_once": [s["step"] for s in steps] == list(range(1, len(steps) + 1)),
            "prompts_consumed": steps[-1]["data/prompts_consumed"] if steps else 0,
            "prompts_expected": len(steps) * config_value(run, "train.batch_groups")}


# -- hostile -------------------------------------------------------------------------
def hostile_messages(n: int, seed: int = 0) -> list[list[bytes]]:
    """Random bytes, and real messages mutated at random (header bytes flipped, frames
    cut, dropped or repeated, fields set to wrong types or values). Senders claim actor
    ids the hub never issued: a forged id of a live actor could steal its grants."""
    import msgpack
    import numpy as np

    from async_rl.wire import ExperienceGroup, Heartbeat, SyncDone, WorkRequest, encode

    rng = random.Random(seed)
    g, t = 8, 4  # responses of t tokens each
    group = ExperienceGroup(
        actor_id=10**6, group=10**6, prompt_id=0, version=0, prompt_tokens=np.arange(1, 7, dtype=np.int32),
        response_tokens=np.ones(g * t, np.int32), response_lengths=np.full(g, t, np.int32),
        logprobs=np.full(g * t, -0.5, np.float32), token_versions=np.zeros(g * t, np.int32),
        rewards=np.ones(g, np.float32), truncated=np.zeros(g, np.uint8), gen_seconds=0.1)
    seeds = [encode(group), encode(WorkRequest(actor_id=10**6, version=0, max_groups=4)),
             encode(Heartbeat(actor_id=10**6, version=0, generated_groups=1)),
             encode(SyncDone(actor_id=10**6, epoch=1, version=0))]
    seeds = [[bytes(f) for f in frames] for frames in seeds]
    junk = [None, True, -1, 2**64 - 1, 1.5, float("nan"), "x", [1], {"a": 1}, b"\x00"]

    def mutate(frames: list[bytes]) -> list[bytes]:
        frames = list(frames)
        how = rng.randrange(5)
        if how == 0:  # flip bytes of the header
            head = bytearray(frames[0])
            for _ in range(rng.randint(1, 4)):
                head[rng.randrange(len(head))] = rng.randrange(256)
            frames[0] = bytes(head)
        elif how == 1 and len(frames) > 1:  # cut, drop or repeat an array frame
            k = rng.randrange(1, len(frames))
            frames[k:k + 1] = rng.choice([[frames[k][:len(frames[k]) // 2]], [], [frames[k], frames[k]]])
        else:  # a header value or array reference set to a wrong type or value
            header = msgpack.unpackb(frames[0])  # {"schema": ..., "message": {"kind": ..., field: value}}
            message = header["message"]
            refs = [v for v in message.values() if isinstance(v, dict)]  # arrays: {"dtype", "shape", "frame"}
            target = rng.choice(["schema", "message", "kind", "array"] if how == 2 else ["field"])
            if target == "array" and refs:
                rng.choice(refs)[rng.choice(["dtype", "shape", "frame"])] = rng.choice(junk)
            elif target in ("field", "kind"):
                message[rng.choice(list(message)) if target == "field" else "kind"] = rng.choice(junk)
            else:
                header[target] = rng.choice(junk)
            frames[0] = msgpack.packb(header, strict_types=False)
        return frames

    out = []
    for i in range(n):
        if i % 4 == 0:
            out.append([rng.randbytes(rng.randint(1, 300)) for _ in range(rng.randint(1, 3))])
        else:
            out.append(mutate(rng.choice(seeds)) or [b""])
    return out


def drill_hostile(args) -> dict:
    import zmq

    proc, run = start_run(args, "hostile")
    ctx = zmq.Context()
    try:
        wait_for("the first training step", lambda: run.last_step() >= 1, proc, args.timeout)
        ep = run.endpoints()
        push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
        for sock, addr in ((push, ep["experience"]), (dealer, ep["hub"])):
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.connect(addr)
        messages = hostile_messages(args.messages)
        sent_at = run.last_step()
        for i, frames in enumerate(messages):
            (push if i % 2 else dealer).send_multipart(frames)
        # A step line is written once per step: wait for one that has counted them all,
        # rather than reading the last line of a run that may end first.
        wait_for("the hostile messages in a step line",
                 lambda: (run.steps() or [{}])[-1].get("wire/rejected", 0) >= len(messages), proc, args.timeout)
        code = finish(proc, args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=1)
    steps = run.steps()
    result = {"scenario": "hostile", "messages": len(messages), "sent_at_step": sent_at,
              "wire_rejected": steps[-1]["wire/rejected"] if steps else 0,
              **outcome(run, code, args.target, config_value(run, "max_staleness"))}
    result["passed"] = result.pop("ok") and result["wire_rejected"] >= len(messages)
    return result


# -- kill-actor ------------------------------------------------------------------------
def drill_kill_actor(args) -> dict:
    # No restarts by the launcher: the drill itself brings the replacement, by hand.
    proc, run = start_run(args, "kill-actor", "actors.count=2", "actors.max_restarts=0")
    newcomer = None
    try:
        wait_for("two actors and training", lambda: run.last_step() >= args.kill_at
                 and len((run.endpoints() or {}).get("actors", [])) == 2, proc, args.timeout)
        victim = run.endpoints()["actors"][0]
        killed_at = run.last_step()
        os.kill(victim["pid"], signal.SIGKILL)
        detect_s = wait_for("the registry to drop the dead actor",
                            lambda: len(run.endpoints()["actors"]) == 1, proc, args.timeout)
        wait_for("a step with actors/live == 1",
                 lambda: any(s["actors/live"] == 1 for s in run.steps()), proc, args.timeout)
        newcomer = subprocess.Popen([sys.executable, "-m", "async_rl.cli", "actor", "--hub", run.endpoints()["hub"],
                                     "--name", "newcomer"], stdout=open(args.out / "kill-actor-newcomer.log", "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
        join_s = wait_for("the new actor in endpoints.json", lambda: newcomer.pid in
                          [a["pid"] for a in run.endpoints()["actors"]], proc, args.timeout)
        sync_s = join_s + wait_for("the new actor's first weight sync", lambda: " synced to version " in
                                   (args.out / "kill-actor-newcomer.log").read_text(), proc, args.timeout)
        degraded = [s["step"] for s in run.steps() if s["actors/live"] == 1]
        times = [s["time"] for s in run.steps() if s["step"] >= killed_at]
        pause_s = max((b - a for a, b in zip(times, times[1:])), default=float("inf"))
        wait_for("a step with actors/live == 2 after the join", lambda: any(
            s["actors/live"] == 2 and s["step"] > max(degraded, default=0) for s in run.steps()),
                 proc, args.timeout)
        code = finish(proc, args.timeout)
        newcomer_code = newcomer.wait(timeout=60)  # the hub says goodbye when the run ends
    finally:
        for p in (proc, newcomer):
            if p is not None and p.poll() is None:
                p.kill()
    log = (args.out / "kill-actor-newcomer.log").read_text()
    steps = run.steps()
    result = {"scenario": "kill-actor", "killed_at_step": killed_at, "detected_after_s": round(detect_s, 1),
              "longest_pause_s": round(pause_s, 2),
              "rejoined_after_s": round(join_s, 1), "newcomer_synced_after_s": round(sync_s, 1),
              "steps_with_one_actor": len(degraded),
              "newcomer_synced": " synced to version " in log, "newcomer_exit_code": newcomer_code,
              "live_at_end": steps[-1]["actors/live"],
              **outcome(run, code, args.target, config_value(run, "max_staleness"))}
    result["passed"] = (result.pop("ok") and result["steps_with_one_actor"] > 0 and result["newcomer_synced"]
                        and newcomer_code == 0 and pause_s <= args.max_pause)
    return result


# -- stall-actor ------------------------------------------------------------------------
def drill_stall_actor(args) -> dict:
    """The only actor is stopped (SIGSTOP) past its heartbeat timeout, then continued."""
    timeout = 3
    # A broadcast under way when the actor stopped waits sync.timeout_s for it (a gloo
    # collective cannot be called off): keep that short too.
    proc, run = start_run(args, "stall-actor", "actors.count=1", f"actors.heartbeat_timeout_s={timeout}",
                          "sync.timeout_s=5")
    try:
        wait_for("training", lambda: run.last_step() >= args.kill_at and run.endpoints()["actors"], proc, args.timeout)
        actor = run.endpoints()["actors"][0]
        stopped_at = run.last_step()
        os.kill(actor["pid"], signal.SIGSTOP)
        wait_for("the hub to remove the stopped actor", lambda: not run.endpoints()["actors"], proc, args.timeout)
        time.sleep(1.0)
        os.kill(actor["pid"], signal.SIGCONT)
        back_s = wait_for("training to go on", lambda: run.last_step() > stopped_at + 2, proc, args.timeout)
        code = finish(proc, args.timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    consumed = consumed_once(run)
    result = {"scenario": "stall-actor", "stopped_at_step": stopped_at, "back_after_sigcont_s": round(back_s, 1),
              "registered_again": "registered again" in (run.logs_dir / "actor-0.log").read_text(),
              "prompts_consumed": consumed["prompts_consumed"],
              **outcome(run, code, args.target, config_value(run, "max_staleness"))}
    result["passed"] = result.pop("ok") and result["registered_again"] and \
        consumed["prompts_consumed"] == consumed["prompts_expected"]
    return result


# -- kill-job --------------------------------------------------------------------------
def drill_kill_job(args) -> dict:
    from async_rl.run.processes import process_tree

    every = args.checkpoint_every
    proc, run = start_run(args, "kill-job", f"checkpoint.every={every}")
    try:
        wait_for(f"step {args.kill_at}", lambda: run.last_step() >= args.kill_at, proc, args.timeout)
        tree = process_tree(proc.pid)
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = run.last_step()
    checkpoint = (run.checkpoints() or [None])[-1]
    resumed_from = int(checkpoint.name.split("_")[1]) if checkpoint else 0
    start = time.monotonic()
    proc, _ = start_run(args, "kill-job", f"checkpoint.every={every}", resume=True)
    code = finish(proc, args.timeout)
    consumed = consumed_once(run)
    result = {"scenario": "kill-job", "killed_processes": len(tree), "killed_at_step": killed_at,
              "resumed_from_step": resumed_from, "steps_lost": killed_at - resumed_from,
              "resume_wall_s": round(time.monotonic() - start, 1),
              "each_step_once": consumed["each_step_once"], "prompts_consumed": consumed["prompts_consumed"],
              **outcome(run, code, args.target, config_value(run, "max_staleness"))}
    result["passed"] = (result.pop("ok") and 0 < resumed_from and result["steps_lost"] <= every
                        and result["each_step_once"] and consumed["prompts_consumed"] == consumed["prompts_expected"])
    return result


DRILLS = {"hostile": drill_hostile, "kill-actor": drill_kill_actor, "stall-actor": drill_stall_actor,
          "kill-job": drill_kill_job}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", choices=list(DRILLS), default=list(DRILLS))
    parser.add_argument("--out", type=Path, default=Path("runs/fault-drill"), help="run directories and logs")
    parser.add_argument("--model", type=Path, default=None, help="base model (default: the demo, built once)")
    parser.add_argument("--target", type=float, default=0.9, help="eval accuracy every run must reach")
    parser.add_argument("--messages", type=int, default=3000, help="hostile messages to send")
    parser.add_argument("--kill-at", type=int, default=100, help="learner step after which to kill")
    parser.add_argument("--max-pause", type=float, default=3.0,
                        help="kill-actor: the longest learner pause (s) between two steps after the kill")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="checkpoint.every of the kill-job run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds any one wait may take")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=CONFIG, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_path = base_model(args)
    failed = 0
    for name in args.scenarios:
        try:
            result = DRILLS[name](args)
        except RuntimeError as err:
            result = {"scenario": name, "passed": False, "error": str(err)}
        failed += not result["passed"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
