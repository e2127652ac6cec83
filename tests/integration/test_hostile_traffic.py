"""Malformed and hostile messages sent to a training run's real endpoints: every one is
rejected and counted, the run is unaffected and finishes with status 0."""
import random
import subprocess
import sys
import time

import numpy as np
import zmq
from conftest import ROOT, kill_tree, read_metrics, subprocess_env
from msgspec.structs import replace
from wire_samples import CASES, make_group

from async_rl.run.directory import RunDir
from async_rl.wire import WorkRequest, encode

# Well-formed messages the coordinator's state must refuse.
STATEFUL = {
    "unknown_actor": encode(WorkRequest(actor_id=999, version=0, max_groups=4)),
    "future_version": encode(WorkRequest(actor_id=0, version=10**6, max_groups=4)),
    "not_granted": encode(replace(make_group(), actor_id=999, group=10**6)),
}


def hostile_messages(n: int, seed: int = 0) -> list[list[bytes]]:
    rng = random.Random(seed)
    corpus = [list(f) for f, _ in CASES.values()] + [list(f) for f in STATEFUL.values()]
    out = []
    for i in range(n):
        if i % 3 == 0:  # random bytes, 1-3 frames
            out.append([rng.randbytes(rng.randint(1, 200)) for _ in range(rng.randint(1, 3))])
        else:
            out.append([bytes(f) for f in rng.choice(corpus)])
    return [m for m in out if m]  # zmq cannot send a message with no frames


def test_thousands_of_malformed_messages_do_not_disturb_training(tmp_path, demo_model):
    run = tmp_path / "hostile"
    cmd = [sys.executable, "-m", "async_rl.cli", "train", str(ROOT / "configs/demo.yaml"), f"run_dir={run}",
           f"model.path={demo_model}", "train.batch_groups=8", "train.group_size=4", "actors.groups_per_request=4",
           "task.eval_size=32", "eval.every=0", "train.max_steps=100000", "learner.ranks=1"]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        deadline = time.time() + 90
        while RunDir(run).last_step() < 1:
            assert time.time() < deadline and proc.poll() is None, "no training step within 90 s"
            time.sleep(0.2)
        endpoints = RunDir(run).endpoints()
        push, dealer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
        for sock, addr in ((push, endpoints["experience"]), (dealer, endpoints["hub"])):
            sock.setsockopt(zmq.LINGER, 0)
            # Beyond the high-water marks a send waits for the coordinator to drain its
            # queues: as long as a loaded machine needs.
            sock.setsockopt(zmq.SNDTIMEO, 60_000)
            sock.connect(addr)
        messages = hostile_messages(3000)
        for i, frames in enumerate(messages):
            (push if i % 2 else dealer).send_multipart(frames)
        # Training goes on while the coordinator counts them: wait for a step line that
        # shows them counted.
        deadline = time.time() + 120
        while True:
            steps, _ = RunDir(run).steps_and_evals()
            if steps and steps[-1]["wire/rejected"] >= 0.95 * len(messages):
                break
            assert time.time() < deadline and proc.poll() is None, "the hostile messages were not counted within 120 s"
            time.sleep(0.2)
        before = steps[-1]["step"]
        proc.send_signal(2)  # Ctrl-C: stop cleanly, as a user would
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        ctx.destroy(linger=0)
    assert proc.returncode == 130, err[-3000:]
    steps, evals = read_metrics(run)
    last = steps[-1]
    assert last["step"] >= before  # an interrupted run waits for no evaluation: it may have none
    # Every hostile message is counted (a step line may precede the final few).
    assert last["wire/rejected"] >= 0.95 * len(messages), (last["wire/rejected"], len(messages))
    assert last["staleness/dropped"] == 0 and last["actors/live"] == 1
    assert all(np.isfinite(s["loss/total"]) for s in steps)
    # Logged once per reason, not once per message.
    logged = [line for line in err.splitlines() if "rejected wire message" in line]
    assert 0 < len(logged) == len({line.split("rejected wire message: ")[1].split(" ")[0] for line in logged})
