"""Chaos run: one long real demo run under faults injected at random times, then checks
over the whole run.

    python benchmarks/chaos.py [--minutes 30] [--seed 0] [--out runs/chaos] [--bed] [--disk]
                             [--faults N | --every 45] [--kinds KIND ...] [--baseline ACCURACY SPREAD]
                             [--model PATH] [--memory-every 2] [--set key=value ...]

Runs `async-rl train configs/demo.yaml` in OUT/run with seed --seed, 2 actors,
actors.max_restarts 1000, actors.heartbeat_timeout_s 5, a checkpoint every 100 steps and
train.max_steps 10^6, for --minutes from its launch (or until the last fault has been
recovered from, if later); then SIGTERM ends it (exit 143, counted as the end). Meanwhile
faults come at times drawn from --seed, uniformly over the run (one every --every seconds,
or --faults of them; each kind at least once, actor-stop twice where there is room):

actor-kill    SIGKILL to one of the launcher's actors: the launcher must say it restarts
              it, and the new one must register.
actor-stop    SIGSTOP to one of them, SIGCONT after a random pause, by turns shorter (1-3 s:
              the hub must keep it) and longer (7.5-15 s: the hub must drop it, and it
              registers again) than the heartbeat timeout.
learner-kill  SIGKILL to the learner process: the launcher must exit non-zero naming the
              failure, then `async-rl train ... --resume OUT/run` continues the run.
link          (--bed, root) The launcher runs on node `learner` of a network-namespace bed
              (benchmarks/netns_bed.py), a third actor (`async-rl actor --hub`) on node
              `actors`; that node's link is cut (2-15 s) or held to 1 Mbit/s (3-10 s). The
              actor must be registered again afterwards. It is restarted with each resume.
disk          (--disk, root) OUT/run/checkpoints is a 64 MiB tmpfs; a file fills it to
              half a checkpoint's room, so the next checkpoint write fails: the launcher
              must exit 1 naming the checkpoint; the file is removed and --resume continues.
              The tmpfs, and the run's checkpoints with it, is unmounted at the end.
Where the machine cannot host the bed or the tmpfs, those faults are skipped and a JSON
line says why.

Then an undisturbed run of the same config and seed (OUT/baseline, plain, 2 actors) trains
until its evaluation at the chaos run's last evaluated step: it runs after the chaos run,
which alone says how many steps that is. --baseline ACCURACY SPREAD gives those figures
instead (a previous baseline line's accuracy and spread).

Checks, each a JSON line with "passed": every learner step once in metrics.jsonl across
all resumes and every admitted prompt consumed once (fault_drill's consumed_once); every
sample's staleness within max_staleness and none dropped; the final held-out accuracy
within the baseline's spread (chaos_report.baseline_figures); no process of the run left
after the end; every fault recovered from; the run ended on the final SIGTERM. The
learner's USS and RSS are sampled every --memory-every seconds to OUT/memory.jsonl and
reported as a least-squares slope (MB per 1000 steps; each learner process its own
intercept, its first 100 steps left out) beside the sample-to-sample spread.

Prints to stdout one JSON line per fault (as it happens), per check, the baseline, the
memory trend and a summary (steps, wall time, and the longest pause between two steps
that no fault explains), then Markdown tables (the faults with what each cost, the
checks, the memory); the lines also go to OUT/chaos.jsonl, the tables to OUT/chaos.md.
Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chaos_report
from chaos_faults import CONFIG, KINDS, STOP_S, WAIT_S, Chaos, kill_tree, train_command
from fault_drill import wait_for  # sibling scripts: the drill's wait, the bed, the shared base model
from netns_bed import Bed
from staleness_sweep import base_model

from async_rl.run.directory import RunDir

DISK_MB = 64  # room for checkpoint.keep + 1 demo checkpoints (about 1.7 MiB each), many times over
ORPHAN_WAIT_S = 30.0  # a killed process's children take a moment to follow it on a loaded machine


def unavailable(kind: str) -> str | None:
    """Why this machine cannot host a kind of fault, or None."""
    if kind == "link":
        return Bed.unavailable()
    if kind == "disk" and (sys.platform != "linux" or os.geteuid() != 0):
        return "mounting a tmpfs needs root on Linux"
    return None


def mount_tmpfs(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "chaos", str(path)], check=True,
                   capture_output=True, text=True, timeout=30)


def unmount(path: Path) -> None:
    if os.path.ismount(path) and subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode:
        # Still busy: detached now, freed once its last user has gone.
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True, timeout=30)


def run_baseline(args, step: int, timeout_s: float) -> dict | None:
    """An undisturbed run of the chaos run's config and seed, up to its evaluation at `step`."""
    run = RunDir((args.out / "baseline").resolve())
    shutil.rmtree(run.path, ignore_errors=True)
    run.path.mkdir(parents=True)
    with open(args.out / "baseline.log", "w") as log:
        proc = subprocess.Popen(train_command(args, run), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # last_step() first: it reads only the end of metrics.jsonl, evals() all of it.
        wait_for(f"the baseline's evaluation at step {step}", lambda: run.last_step() >= step and any(
            e["step"] >= step for e in run.evals()), proc, timeout_s)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_S)
    finally:
        kill_tree(proc)
    return chaos_report.baseline_figures(run, step, str(run.path))


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # through the finally blocks: processes, namespaces and mounts go


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the chaos run lasts, from its launch")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed, and the faults' times and choices")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos"), help="run directories, logs, results")
    parser.add_argument("--bed", action="store_true", help="add link faults, on a network-namespace bed (root)")
    parser.add_argument("--disk", action="store_true", help="add disk-full faults, on a tmpfs (root)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, help="the fault kinds (default: actor-kill "
                        "actor-stop learner-kill, with link for --bed and disk for --disk)")
    parser.add_argument("--faults", type=int, help="how many faults (default: one every --every seconds)")
    parser.add_argument("--every", type=float, default=45.0, help="mean seconds between faults")
    parser.add_argument("--baseline", nargs=2, type=float, metavar=("ACCURACY", "SPREAD"),
                        help="an undisturbed run's accuracy and spread at the chaos run's last evaluated step, "
                        "instead of running one")
    parser.add_argument("--model", type=Path, default=None, help="base model (default: the demo, built once)")
    parser.add_argument("--memory-every", type=float, default=2.0, help="seconds between memory samples")
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every run")
    parser.add_argument("--config", type=Path, default=CONFIG, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop_on_signal)
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[dict] = []

    def emit(record: dict) -> None:
        print(json.dumps(record), flush=True)
        lines.append(record)

    kinds = list(args.kinds or ["actor-kill", "actor-stop", "learner-kill", *["link"] * args.bed,
                                *["disk"] * args.disk])
    for kind in [k for k in kinds if unavailable(k)]:
        emit({"skipped": kind, "reason": unavailable(kind)})
        kinds.remove(kind)
    args.model_path = base_model(args)
    run_dir = (args.out / "run").resolve()
    unmount(run_dir / "checkpoints")  # left mounted by a chaos run that was killed
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    code = error = None
    started = time.time()
    # Undone in reverse order whatever happens, each even if another fails: the run's
    # processes first, then the namespaces and the mount they used.
    with contextlib.ExitStack() as cleanup:
        if "disk" in kinds:
            try:
                mount_tmpfs(run_dir / "checkpoints")
                cleanup.callback(unmount, run_dir / "checkpoints")
            except subprocess.CalledProcessError as err:
                emit({"skipped": "disk", "reason": f"mount: {err.stderr.strip()}"})
                kinds.remove("disk")
        bed = cleanup.enter_context(Bed(["learner", "actors"])) if "link" in kinds else None
        chaos = Chaos(args, bed)
        cleanup.callback(chaos.close)
        try:
            code = chaos.play(kinds, args.faults or max(len(kinds), round(args.minutes * 60 / args.every)))
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            error = str(err)
        orphans = chaos_report.orphan_check(chaos.watch.processes, run_dir, ORPHAN_WAIT_S)
    wall_s = time.time() - started
    lines += chaos.faults  # printed as they happened

    run = chaos.run
    final_step = (run.evals() or [{}])[-1].get("step")
    baseline = None
    if args.baseline:
        baseline = {"baseline": "given", "step": final_step, "accuracy": args.baseline[0], "spread": args.baseline[1]}
    elif final_step is not None:
        try:
            baseline = run_baseline(args, final_step, timeout_s=2 * wall_s + WAIT_S)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            emit({"baseline": "failed", "error": str(err)})
    if baseline:
        emit(baseline)
    injected = {f["fault"] for f in chaos.faults}
    checks = [chaos_report.steps_and_prompts_check(run), chaos_report.staleness_check(run),
              chaos_report.accuracy_check(run, baseline), orphans,
              {"check": "every fault recovered from", "faults": len(chaos.faults),
               "failed": [i for i, f in enumerate(chaos.faults, 1) if not f["passed"]],
               "kinds_missing": sorted(set(kinds) - injected),
               "passed": all(f["passed"] for f in chaos.faults) and set(kinds) <= injected},
              {"check": "the run ended on the final SIGTERM", "launcher_exit": code, "error": error,
               "passed": code == 128 + signal.SIGTERM}]
    for check in checks:
        emit(check)
    memory = {key: chaos_report.memory_trend(chaos.watch.memory, f"{key}_mb") for key in ("uss", "rss")}
    emit({"memory": "learner", **memory, "samples": len(chaos.watch.memory),
          "file": str(args.out / "memory.jsonl")})
    passed = all(c["passed"] for c in checks)
    unexplained_s = chaos_report.longest_pause_outside(chaos.watch.advances, chaos.windows)
    emit({"summary": "chaos", "minutes": args.minutes, "seed": args.seed, "kinds": kinds, "faults": len(chaos.faults),
          "steps": run.last_step(), "wall_s": round(wall_s, 1), "longest_pause_without_fault_s": unexplained_s,
          "passed": passed})
    table = chaos_report.markdown(chaos.faults, checks, memory) + (
        f"\n\n{run.last_step()} steps in {wall_s:.0f} s; the longest pause between two steps that no fault "
        f"explains: {unexplained_s} s")
    print("\n" + table, flush=True)
    (args.out / "chaos.md").write_text(table + "\n")
    (args.out / "chaos.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
